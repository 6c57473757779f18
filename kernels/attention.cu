// Decode attention over the KV cache's valid length (docs/kernels.md, "Decode attention"): one query token per
// sequence (T = 1) at cache slot pos, row b seeing the slots j <= pos with j >= offset[b] (its left padding
// hidden; the query's own slot always seen), grouped-query heads (H = G * Hkv) reading their KV head once.
// Split along the sequence (flash-decoding): attention_split's block (chunk c, KV head, row) scores the chunk's
// slots against the G query heads of that KV head, takes the chunk's softmax max and sum and its weighted sum of
// V, in float32; attention_combine rescales the chunks' partials into the output, rounded to float16 once.
// Chunks past pos read nothing (the grid covers the allocated length, so a CUDA graph replays it at any pos).
#include "fp16.cuh"

#define CHUNK 64
#define MAX_G 8
#define MAX_D 256
#define WARPS 4
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY macro

// q [B, H, 1, D]; caches [B, Hkv, L, D]; part_o [B, H, chunks, D] and part_ml [B, H, chunks, 2] (float32).
extern "C" __global__ void __launch_bounds__(WARPS * 32) attention_split(
        const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
        const long long* __restrict__ pos, const long long* __restrict__ offset, int H, int Hkv, int L, int D,
        float scale, float* __restrict__ part_o, float* __restrict__ part_ml) {
    __shared__ float qs[MAX_G * MAX_D];
    __shared__ float sc[MAX_G * CHUNK];
    const int c = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int G = H / Hkv, chunks = gridDim.x;
    const long long p = pos[0];
    const int j0 = c * CHUNK;
    if (j0 > p) return;  // past the valid length: attention_combine does not read this chunk
    const int n = (int)min((long long)CHUNK, p + 1 - j0);
    const long long off = offset[b];
    for (int e = threadIdx.x; e < G * D; e += blockDim.x)
        qs[e] = h2f(q[((long long)b * H + (long long)hk * G) * D + e]) * scale;
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per = D / 32;
    const u16* kb = k_cache + (((long long)b * Hkv + hk) * L + j0) * D;
    for (int jj = warp; jj < n; jj += WARPS) {
        const long long j = j0 + jj;
        const bool seen = j >= off || j == p;
        float acc[MAX_G];
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[g] = 0.f;
        if (seen) {
            for (int e = lane * per; e < (lane + 1) * per; ++e) {
                const float kv = h2f(kb[(long long)jj * D + e]);
#pragma unroll
                for (int g = 0; g < MAX_G; ++g)
                    if (g < G) acc[g] = fmaf(qs[g * D + e], kv, acc[g]);
            }
        }
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g < G) {
                float s = acc[g];
                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (lane == 0) sc[g * CHUNK + jj] = seen ? s : NEG_INF;
            }
        }
    }
    __syncthreads();

    for (int g = warp; g < G; g += WARPS) {  // the chunk's max and sum per head; sc becomes exp(s - max)
        float m = NEG_INF;
        for (int jj = lane; jj < n; jj += 32) m = fmaxf(m, sc[g * CHUNK + jj]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.f;
        for (int jj = lane; jj < n; jj += 32) {
            const float e = m == NEG_INF ? 0.f : expf(sc[g * CHUNK + jj] - m);
            sc[g * CHUNK + jj] = e;
            l += e;
        }
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            float* ml = part_ml + (((long long)b * H + (long long)hk * G + g) * chunks + c) * 2;
            ml[0] = m;
            ml[1] = l;
        }
    }
    __syncthreads();

    const u16* vb = v_cache + (((long long)b * Hkv + hk) * L + j0) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc[MAX_G];
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) acc[g] = 0.f;
        for (int jj = 0; jj < n; ++jj) {
            const float vv = h2f(vb[(long long)jj * D + d]);
#pragma unroll
            for (int g = 0; g < MAX_G; ++g)
                if (g < G) acc[g] = fmaf(sc[g * CHUNK + jj], vv, acc[g]);
        }
#pragma unroll
        for (int g = 0; g < MAX_G; ++g)
            if (g < G) part_o[(((long long)b * H + (long long)hk * G + g) * chunks + c) * D + d] = acc[g];
    }
}

// out [B, 1, H * D] float16: per (row, head) block, the chunks j0 <= pos combined with their maxima.
extern "C" __global__ void attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                             const long long* __restrict__ pos, int chunks, int D,
                                             u16* __restrict__ out) {
    const long long bh = blockIdx.x;  // b * H + head
    const int used = (int)min((long long)chunks, pos[0] / CHUNK + 1);
    const float* ml = part_ml + bh * chunks * 2;
    float m = NEG_INF;
    for (int c = 0; c < used; ++c) m = fmaxf(m, ml[2 * c]);
    float l = 0.f;
    for (int c = 0; c < used; ++c) l += ml[2 * c + 1] * (ml[2 * c] == NEG_INF ? 0.f : expf(ml[2 * c] - m));
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int c = 0; c < used; ++c)
            if (ml[2 * c] != NEG_INF) o = fmaf(part_o[(bh * chunks + c) * D + d], expf(ml[2 * c] - m), o);
        out[bh * D + d] = f2h(o / l);
    }
}
