// Programmatic dependent launch (sm_90; docs/kernels.md, "Programmatic dependent launch"). The step's kernels are
// launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (kernels/cluster_launch.py:launch), so a
// kernel's CTAs are scheduled while the kernel before it still runs, and hide the gap between the two:
//   allow_dependents()   this grid lets the next one start (executed by every CTA: the next one starts once all
//                        of this grid's CTAs have executed it or exited);
//   wait_for_producer()  returns when the grid before has completed and its writes are visible. No load of
//                        anything an earlier kernel writes may come before it, and the compiler moves read-only
//                        loads (__ldg, const __restrict__) freely: benchmarks/check_pdl_order.py checks the
//                        SASS of every step kernel, and ld_after_wait below keeps a load in place.
// Both are no-ops when the launch was not programmatic, and below sm_90.
#pragma once

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The first statement of a step kernel; attention.cu, lm_head.cu and the norms (NORM_EARLY) instead start with
// allow_dependents() and load or copy what no kernel of the step writes (earlier cache slots, the lm_head weight, a
// norm's weight and permutation) before their wait_for_producer().
__device__ __forceinline__ void pdl_enter() {
    allow_dependents();
    wait_for_producer();
}

// What an earlier kernel wrote, read after the wait: volatile L2 loads, which the compiler keeps after the wait
// (both are volatile asm). It hoisted plain read-only loads above it: attention's `pos`, IE-BME's activation scales
// (NaN decode steps on an H100). Pinning every pointer after the wait instead (an empty asm on each) kept all
// loads in place but cost 0.7-2.2 us a launch on an H100 (benchmarks/pdl_kernel_ab.py), so the SASS check
// decides where a load needs this.
__device__ __forceinline__ long long ld_after_wait(const long long* p) {
    long long v;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_after_wait(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int4 ld_after_wait(const int4* p) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

#ifndef NORM_EARLY  // 1: the norms copy their weight and permutation before the wait (below); 0: read after it
#define NORM_EARLY 1
#endif

// Copies into shared memory issued before the wait, of what no kernel of the step writes (a norm's weight, a channel
// permutation), so that the kernel reads them from shared memory after it instead of making a DRAM trip on its
// critical path (docs/kernels.md, "Programmatic dependent launch": the step 2.7-3.1% faster on an H100). cp.async
// (sm_80+), which the SASS shows as LDGSTS: nothing reaches a register before the wait, and the SASS check's rule
// holds. Before sm_80 (no programmatic launch either) a plain copy. BYTES: 4 or 16, src and dst aligned to it.
template <int BYTES>
__device__ __forceinline__ void early_copy(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    static_assert(BYTES == 4 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    const unsigned int d = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
    if (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
#else
    if (BYTES == 16) *static_cast<int4*>(dst) = *static_cast<const int4*>(src);
    else *static_cast<unsigned int*>(dst) = *static_cast<const unsigned int*>(src);
#endif
}

// This thread's early copies landed (then a barrier over the threads that read them).
__device__ __forceinline__ void early_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
