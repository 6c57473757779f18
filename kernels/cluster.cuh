// Thread-block clusters (sm_90): the barrier over a cluster's CTAs and a float read from another CTA's shared
// memory (distributed shared memory). Launched with a cluster attribute (kernels/cluster_launch.py: launch_ex).
// Included by iebme_spmm.cu (its split-K reduction) and attention.cu (its combine of a head's chunks).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// every thread of every CTA of the cluster arrives; writes before it are visible to reads after it
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// fp32 at shared::cta address `off` in the shared memory of cluster CTA `rank`
__device__ __forceinline__ float ld_cluster_f32(unsigned int off, unsigned int rank) {
    unsigned int ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(off), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
}

// the shared::cta address of a shared-memory pointer, as ld_cluster_f32 takes it
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
#endif
