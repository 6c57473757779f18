// Per-token activation quantization of IE-BME kernel inputs in one launch (docs/kernels.md, "Activation
// quantization"): the rule of formats/arithmetic/activations.py, bit for bit, optionally with the outlier
// split of formats/arithmetic/outlier_side.py (gather by a permutation; the last n_side permuted channels go
// to an 8-bit side input and are zero in the main one).
//
// One block per (group, token row). Group g < G is a main group: permuted positions [g*gm, min((g+1)*gm, K));
// positions >= K - n_side hold zero. Group G + j is side group j: side positions [j*gs, min((j+1)*gs, n_side)),
// the values at permuted positions K - n_side + q. The last main group also zeroes the padding codes [K, Kp).
//   scale = max(fp16(max(clip * absmax / grid_max, tiny)), tiny)   (float32 arithmetic, IEEE division)
//   code  = clamp(rint(x / scale), -2^(b-1), 2^(b-1) - 1)          (round half to even)
#include "act_rule.cuh"

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(u16 h) { return h2f(h); }

template <typename T>
__global__ void act_quant(const T* __restrict__ x, const int* __restrict__ perm, int K, int Kp, int n_side,
                          int gm, int bits, float clip, float grid, int gs, int side_bits, float side_clip,
                          float side_grid, float tiny, signed char* __restrict__ codes, float* __restrict__ scales,
                          signed char* __restrict__ side_codes, float* __restrict__ side_scales) {
    __shared__ float warp_max[32];
    pdl_enter();
    const int row = blockIdx.y;
    const int G = (K + gm - 1) / gm;
    const bool side = (int)blockIdx.x >= G;
    const int grp = side ? blockIdx.x - G : blockIdx.x;
    const int start = side ? grp * gs : grp * gm;
    const int len = side ? min(gs, n_side - start) : min(gm, K - start);
    const int b = side ? side_bits : bits;
    const float c = side ? side_clip : clip;
    const float gmax = side ? side_grid : grid;
    const T* xr = x + (size_t)row * K;
    const int main_end = K - n_side;

    float amax = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const int p = side ? main_end + start + i : start + i;
        const float v = (!side && p >= main_end) ? 0.f : as_float(xr[perm ? perm[p] : p]);
        amax = fmaxf(amax, fabsf(v));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x < 32) {
        amax = threadIdx.x < (blockDim.x + 31) / 32 ? warp_max[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if (threadIdx.x == 0) warp_max[0] = amax;
    }
    __syncthreads();
    amax = warp_max[0];

    const float s = act_scale(amax, c, gmax, tiny);
    const int lo = act_code_lo(b), hi = act_code_hi(b);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const int p = side ? main_end + start + i : start + i;
        const float v = (!side && p >= main_end) ? 0.f : as_float(xr[perm ? perm[p] : p]);
        const signed char q = act_code(v, s, lo, hi);
        if (side) side_codes[(size_t)row * n_side + start + i] = q;
        else codes[(size_t)row * Kp + start + i] = q;
    }
    if (threadIdx.x == 0) {
        if (side) side_scales[(size_t)row * ((n_side + gs - 1) / gs) + grp] = s;
        else scales[(size_t)row * G + grp] = s;
    }
    if (!side && grp == G - 1)
        for (int p = K + threadIdx.x; p < Kp; p += blockDim.x) codes[(size_t)row * Kp + p] = 0;
}

template __global__ void act_quant<float>(const float*, const int*, int, int, int, int, int, float, float, int,
                                          int, float, float, float, signed char*, float*, signed char*, float*);
template __global__ void act_quant<u16>(const u16*, const int*, int, int, int, int, int, float, float, int,
                                        int, float, float, float, signed char*, float*, signed char*, float*);
