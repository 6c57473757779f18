// Programmatic dependent launch (sm_90; docs/kernels.md, "Programmatic dependent launch"). The step's kernels are
// launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (kernels/cluster_launch.py:launch), so a
// kernel's CTAs are scheduled while the kernel before it still runs, and hide the gap between the two:
//   allow_dependents()   this grid lets the next one start (executed by every CTA: the next one starts once all
//                        of this grid's CTAs have executed it or exited);
//   wait_for_producer()  returns when the grid before has completed and its writes are visible. No load of
//                        anything an earlier kernel writes may come before it, and the compiler moves read-only
//                        loads (__ldg, const __restrict__) freely: pdl_enter below pins them, and
//                        benchmarks/check_pdl_order.py checks the SASS.
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

// The first statement of a step kernel: let the next kernel start, wait for the one before, then pass each pointer
// the kernel reads or writes through an empty asm after the wait, so that no access through it can be scheduled
// before the wait (the compiler hoisted a read-only load of `pos` above it in attention_decode_1 and _3).
template <class P>
__device__ __forceinline__ void pin_after_wait(P& p) {
    asm volatile("" : "+l"(p));
}

template <class... P>
__device__ __forceinline__ void pdl_enter(P&... p) {
    allow_dependents();
    wait_for_producer();
    (pin_after_wait(p), ...);
}
