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

// The first statement of a step kernel.
__device__ __forceinline__ void pdl_enter() {
    allow_dependents();
    wait_for_producer();
}

// A scalar an earlier kernel wrote, read after the wait: a volatile L2 load the compiler keeps in place (it
// hoisted the plain read-only load of attention's `pos` above the wait). Pinning every pointer after the wait
// instead (an empty asm on each) kept all loads in place but cost 0.7-2.2 us a launch on an H100
// (benchmarks/pdl_kernel_ab.py), so the SASS check decides where a load needs this.
__device__ __forceinline__ long long ld_after_wait(const long long* p) {
    long long v;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
