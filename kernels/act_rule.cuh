// The activation quantizer of formats/arithmetic/activations.py (docs/kernels.md, "Activation quantization"), bit for
// bit, in float32 with IEEE division and no contraction; every kernel that writes an IE-BME input uses these
// (act_quant.cu, norm_quant.cu, attention.cu's o_proj epilogue):
//   scale = max(fp16(max(clip * absmax / grid, tiny)), tiny)
//   code  = clamp(rint(x / scale), lo, hi), lo = -2^(bits-1), hi = 2^(bits-1) - 1   (round half to even)
#pragma once
#include "fp16.cuh"

__device__ __forceinline__ float act_scale(float amax, float clip, float grid, float tiny) {
    const float s = __fdiv_rn(__fmul_rn(amax, clip), grid);
    return fmaxf(h2f(f2h(fmaxf(s, tiny))), tiny);
}

__device__ __forceinline__ int act_code_lo(int bits) { return -(1 << (bits - 1)); }
__device__ __forceinline__ int act_code_hi(int bits) { return (1 << (bits - 1)) - 1; }

__device__ __forceinline__ signed char act_code(float x, float scale, int lo, int hi) {
    return (signed char)min(max(__float2int_rn(__fdiv_rn(x, scale)), lo), hi);
}
