// float16 as its bit pattern in an unsigned short, converted by PTX (NVRTC compiles the kernels without the CUDA
// include path, so no cuda_fp16.h), and a block-wide sum of squares of a float16 row. Included by the runtime's
// small kernels (act_quant.cu, glue.cu, norm_quant.cu, outlier_side.cu); load_module passes this folder as -I.
#pragma once
typedef unsigned short u16;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {  // nearest float16, ties to even
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// sum over k < K of xr[k]^2 in float32 (fused multiply-adds, then a warp and block reduction), for every thread of
// the block; blockDim.x a multiple of 32, at most 1024.
__device__ __forceinline__ float block_sum_squares(const u16* __restrict__ xr, int K) {
    __shared__ float part[32];
    float s = 0.f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const float v = h2f(xr[k]);
        s = fmaf(v, v, s);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x + 31) / 32 ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    return part[0];
}

// Row blockIdx.x of x (rows ld_x apart), or, with a residual delta (rows ld_d apart; null: none), that row replaced
// by fp16(x + delta) and written to row blockIdx.x of x_out [R, K], which is returned. Thread t handles elements
// t, t + blockDim.x, ..., as block_sum_squares and the callers' loops do, so each thread reads back only what it
// wrote and no barrier is needed before them.
__device__ __forceinline__ const u16* residual_row(const u16* __restrict__ x, long long ld_x, const u16* delta,
                                                   long long ld_d, u16* x_out, int K) {
    const u16* xr = x + (long long)blockIdx.x * ld_x;
    if (delta == nullptr) return xr;
    const u16* dr = delta + (long long)blockIdx.x * ld_d;
    u16* xo = x_out + (long long)blockIdx.x * K;
    for (int k = threadIdx.x; k < K; k += blockDim.x) xo[k] = f2h(h2f(xr[k]) + h2f(dr[k]));
    return xo;
}
