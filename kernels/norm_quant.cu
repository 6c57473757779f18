// Producers that quantize for their consumer (docs/kernels.md, "Quantizing producers"): RMSNorm, and SiLU(gate) *
// up, each writing its float16 output AND the IE-BME input of the linear that reads it (codes padded to Kp,
// float32 group scales, the outlier side's codes and scales) in one launch, instead of a producer launch plus
// act_quant.cu. One block per token row; the row's float16 output is kept in shared memory (2 bytes a
// channel, dynamic) and quantized from there by warps, one group at a time, with act_quant.cu's rule:
//   scale = max(fp16(max(clip * absmax / grid_max, tiny)), tiny),  code = clamp(rint(x / scale), -2^(b-1), 2^(b-1)-1)
// over the permuted channels (perm: position p reads channel perm[p]; the last n_side positions are the outlier
// side: zero in the main input). The float16 values are glue.cu's, bit for bit.
#include "fp16.cuh"

struct QuantArgs {  // the consumer's input rule and where its quantized input goes
    const int* perm;
    int K, Kp, n_side, gm, bits, gs, side_bits;
    float clip, grid, side_clip, side_grid, tiny;
    signed char* codes;
    float* scales;
    signed char* side_codes;
    float* side_scales;
};

// Quantize the row held in v (shared, float16 bits) into row r of the outputs; every warp of the block calls it.
__device__ void quantize_row(const u16* v, const QuantArgs& a, int r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int G = (a.K + a.gm - 1) / a.gm;
    const int Gs = a.n_side ? (a.n_side + a.gs - 1) / a.gs : 0;
    const int main_end = a.K - a.n_side;
    for (int g = warp; g < G + Gs; g += nwarps) {
        const bool side = g >= G;
        const int grp = side ? g - G : g;
        const int start = side ? grp * a.gs : grp * a.gm;
        const int len = side ? min(a.gs, a.n_side - start) : min(a.gm, a.K - start);
        const int b = side ? a.side_bits : a.bits;
        float amax = 0.f;
        for (int i = lane; i < len; i += 32) {
            const int p = side ? main_end + start + i : start + i;
            const float x = (!side && p >= main_end) ? 0.f : h2f(v[a.perm ? a.perm[p] : p]);
            amax = fmaxf(amax, fabsf(x));
        }
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float s = __fdiv_rn(__fmul_rn(amax, side ? a.side_clip : a.clip), side ? a.side_grid : a.grid);
        s = fmaxf(h2f(f2h(fmaxf(s, a.tiny))), a.tiny);
        const int lo = -(1 << (b - 1)), hi = (1 << (b - 1)) - 1;
        for (int i = lane; i < len; i += 32) {
            const int p = side ? main_end + start + i : start + i;
            const float x = (!side && p >= main_end) ? 0.f : h2f(v[a.perm ? a.perm[p] : p]);
            const int q = min(max(__float2int_rn(__fdiv_rn(x, s)), lo), hi);
            if (side) a.side_codes[(long long)r * a.n_side + start + i] = (signed char)q;
            else a.codes[(long long)r * a.Kp + start + i] = (signed char)q;
        }
        if (lane == 0) {
            if (side) a.side_scales[(long long)r * Gs + grp] = s;
            else a.scales[(long long)r * G + grp] = s;
        }
    }
    for (int p = a.K + threadIdx.x; p < a.Kp; p += blockDim.x) a.codes[(long long)r * a.Kp + p] = 0;
}

// y[r, :] = w * fp16(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) (glue.cu's rms_norm, residual add included), then its
// quantized input.
extern "C" __global__ void rms_norm_quant(const u16* __restrict__ x, long long ld_x, const u16* __restrict__ delta,
                                          long long ld_d, u16* __restrict__ x_out, const u16* __restrict__ w,
                                          u16* __restrict__ y, float eps, const int* __restrict__ perm, int K,
                                          int Kp, int n_side, int gm, int bits,
                                          float clip, float grid, int gs, int side_bits, float side_clip,
                                          float side_grid, float tiny, signed char* __restrict__ codes,
                                          float* __restrict__ scales, signed char* __restrict__ side_codes,
                                          float* __restrict__ side_scales) {
    extern __shared__ u16 row[];
    const QuantArgs a{perm, K, Kp, n_side, gm, bits, gs, side_bits, clip, grid, side_clip, side_grid, tiny, codes,
                      scales, side_codes, side_scales};
    const u16* xr = residual_row(x, ld_x, delta, ld_d, x_out, K);  // glue.cu's residual add, when delta is given
    const float ss = block_sum_squares(xr, K);
    const float r = rsqrtf(__fdiv_rn(ss, (float)K) + eps);
    u16* yr = y + (long long)blockIdx.x * K;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const u16 v = f2h(h2f(w[k]) * h2f(f2h(h2f(xr[k]) * r)));
        row[k] = v;
        yr[k] = v;
    }
    __syncthreads();
    quantize_row(row, a, blockIdx.x);
}

// y[r, i] = fp16(fp16(silu(gate[r, i])) * up[r, i]) (glue.cu's silu_mul), then its quantized input (K = I).
extern "C" __global__ void silu_mul_quant(const u16* __restrict__ gate, long long ld_g, const u16* __restrict__ up,
                                          long long ld_u, u16* __restrict__ y, const int* __restrict__ perm,
                                          int K, int Kp, int n_side, int gm, int bits,
                                          float clip, float grid, int gs, int side_bits, float side_clip,
                                          float side_grid, float tiny, signed char* __restrict__ codes,
                                          float* __restrict__ scales, signed char* __restrict__ side_codes,
                                          float* __restrict__ side_scales) {
    extern __shared__ u16 row[];
    const QuantArgs a{perm, K, Kp, n_side, gm, bits, gs, side_bits, clip, grid, side_clip, side_grid, tiny, codes,
                      scales, side_codes, side_scales};
    const int r = blockIdx.x, I = K;
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
        const float g = h2f(gate[(long long)r * ld_g + i]);
        const float sg = h2f(f2h(__fdiv_rn(g, 1.f + expf(-g))));
        const u16 v = f2h(sg * h2f(up[(long long)r * ld_u + i]));
        row[i] = v;
        y[(long long)r * I + i] = v;
    }
    __syncthreads();
    quantize_row(row, a, r);
}
