// float16 as its bit pattern in an unsigned short, converted by PTX (NVRTC compiles the kernels without the CUDA
// include path, so no cuda_fp16.h), and RMSNorm's pieces: the residual add, a row's sum of squares, one element. Included by the runtime's
// small kernels (act_quant.cu, glue.cu, norm_quant.cu, outlier_side.cu); load_module passes this folder as -I.
#pragma once
typedef unsigned short u16;

#include "pdl.cuh"

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

// fp16(x[k] + delta[k]) (the residual stream's next value; delta null: x[k] itself), as a float.
__device__ __forceinline__ float residual_at(const u16* __restrict__ xr, const u16* __restrict__ dr, int k) {
    return dr == nullptr ? h2f(xr[k]) : h2f(f2h(h2f(xr[k]) + h2f(dr[k])));
}

// PER halves at p (PER * 2 bytes aligned when PER is even) as floats.
template <int PER>
__device__ __forceinline__ void load_halves(const u16* __restrict__ p, float* out) {
    if (PER % 8 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 8) {
            const uint4 w = *reinterpret_cast<const uint4*>(p + i);
            const unsigned int ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                out[i + 2 * k] = h2f((u16)(ws[k] & 0xffffu));
                out[i + 2 * k + 1] = h2f((u16)(ws[k] >> 16));
            }
        }
    } else if (PER % 4 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 4) {
            const uint2 w = *reinterpret_cast<const uint2*>(p + i);
            out[i] = h2f((u16)(w.x & 0xffffu));
            out[i + 1] = h2f((u16)(w.x >> 16));
            out[i + 2] = h2f((u16)(w.y & 0xffffu));
            out[i + 3] = h2f((u16)(w.y >> 16));
        }
    } else if (PER % 2 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 2) {
            const unsigned int w = *reinterpret_cast<const unsigned int*>(p + i);
            out[i] = h2f((u16)(w & 0xffffu));
            out[i + 1] = h2f((u16)(w >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) out[i] = h2f(p[i]);
    }
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// sum over k < K of v[k]^2, v = residual_at(xr, dr, k), in float32 for every thread of the block, then a warp and
// a block reduction. When K is a multiple of 8 and the rows are 16-byte aligned, thread t adds the squares of the
// 8-element groups t, t + blockDim.x, ... (16-byte loads, up to four groups in flight: a row of 4096 at 128
// threads is one round trip); otherwise of elements t, t + blockDim.x, ... (loads issued eight at a time). The
// order depends only on blockDim.x and the rows' alignment, so every block of a row, and every kernel launched
// with the same block size on the same rows, gets the same float. blockDim.x a multiple of 32, <= 1024.
__device__ __forceinline__ float row_sum_squares(const u16* __restrict__ xr, const u16* __restrict__ dr, int K) {
    __shared__ float part[32];
    float s = 0.f;
    const bool vec = K % 8 == 0 && ((unsigned long long)xr | (unsigned long long)dr) % 16 == 0;
    if (vec) {
        const int groups = K / 8;
        for (int g0 = threadIdx.x; g0 < groups; g0 += 4 * blockDim.x) {
            float v[4][8];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int g = g0 + u * blockDim.x;
                if (g < groups) {
                    load_halves<8>(xr + 8 * g, v[u]);
                    if (dr != nullptr) {
                        float d[8];
                        load_halves<8>(dr + 8 * g, d);
#pragma unroll
                        for (int i = 0; i < 8; ++i) v[u][i] = h2f(f2h(v[u][i] + d[i]));
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[u][i] = 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(v[u][i], v[u][i], s);
        }
    } else {
        for (int k0 = threadIdx.x; k0 < K; k0 += 8 * blockDim.x) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int k = k0 + j * blockDim.x;
                v[j] = k < K ? residual_at(xr, dr, k) : 0.f;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) s = fmaf(v[j], v[j], s);
        }
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < (blockDim.x + 31) / 32 ? part[threadIdx.x] : 0.f;
        s = warp_sum(s);
        if (threadIdx.x == 0) part[0] = s;
    }
    __syncthreads();
    return part[0];
}

// RMSNorm's 1 / rms of a row (row_sum_squares, then the division by K and eps as torch does).
__device__ __forceinline__ float row_rsqrt(const u16* __restrict__ xr, const u16* __restrict__ dr, int K, float eps) {
    return rsqrtf(__fdiv_rn(row_sum_squares(xr, dr, K), (float)K) + eps);
}

// w * fp16(v * r): RMSNorm's output at one element, v its (residual) input.
__device__ __forceinline__ u16 norm_at(float v, float r, u16 w) { return f2h(h2f(w) * h2f(f2h(v * r))); }
