// Tiled-CBC decode to dense (the large-N prefill path, docs/kernels.md "SpMM (prefill)"): W decoded once into a
// dense workspace, then one cuBLAS GEMM (kernels/cublas_gemm.py). float16 values (tcbc_decode_dense2) and b-bit
// codes as exact float16 halves (tcbc_decode_dense_int). A module of its own so that a prompt compiles these three
// kernels only, not the tensor-core SpMM kernels of tiled_cbc_spmm.cu (their templates are most of its compile time).
#include "fp16.cuh"

typedef unsigned int u32;
typedef unsigned long long u64;

#define TILE_M 256
#define TILE_K 16

// Decode to dense (for the large-N prefill path: decode once, then cuBLAS). Block = DD_G GTiles side by
// side (256 rows x 64 columns of W), thread t = row t. Per column one masked popcount plus the column's
// precomputed word prefix gives the rank; the row's 16 halves of a GTile go to a shared staging tile (row
// stride 64 + 8 halves: a quarter-warp's 16-byte stores land on 8 distinct 4-bank groups), then the block
// writes the staging tile out row-contiguously: 8 lanes cover one 128-byte line, so every warp store
// fills 4 whole lines. (A first version wrote each thread's 32-byte row piece straight to global memory: 32 lines per
// warp store, 1.2 TB/s on 28672 x 8192; see docs/kernels.md.) Wd is [M, ldw], ldw >= the padded K.
#define DD_G 4
#define DD_STRIDE (DD_G * TILE_K + 8)
// The decode kernel's output stage: thread t = row t packs value(gg, c) (its row's value of column c of
// the block's GTile gg, 0 where the bit is clear) into the staging tile, 16 halves per GTile, then the block
// writes its rows out, 8 lanes per 128-byte line.
template <class Value>
__device__ __forceinline__ void dd_stage_and_write(u16* stage, u16* __restrict__ Wd, int ng, int tr, int gtc0,
                                                   int M, int ldw, Value value) {
    const int t = threadIdx.x;
    for (int gg = 0; gg < ng; ++gg) {
        u32 h[8];
#pragma unroll
        for (int c = 0; c < TILE_K; ++c) {
            const u32 v = value(gg, c);
            if (c & 1) h[c >> 1] |= v << 16;
            else h[c >> 1] = v;
        }
        uint4* dst = reinterpret_cast<uint4*>(stage + t * DD_STRIDE + gg * TILE_K);
        dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
        dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
    }
    __syncthreads();
    const int chunks = ng * 2;  // 16-byte chunks per row (8 halves each)
    for (int idx = t; idx < TILE_M * DD_G * 2; idx += 256) {
        const int r = idx >> 3, ch = idx & 7, row = tr * TILE_M + r;
        if (ch < chunks && row < M)
            *reinterpret_cast<uint4*>(Wd + (size_t)row * ldw + gtc0 * TILE_K + ch * 8) =
                *reinterpret_cast<const uint4*>(stage + r * DD_STRIDE + ch * 8);
    }
}

// The decode blocks' entries: per (column, 32-bit word half) of the block's ng GTiles (from gt0), {the half's bits,
// the value index of its first set bit}; thread t = (column, word w) reads its column's words 0..w straight from
// global memory (one 32-byte run).
__device__ __forceinline__ void dd_entries(uint2* ent, const u64* __restrict__ bitmap, const u32* __restrict__ colinfo,
                                           const u32* __restrict__ tile_offset, size_t gt0, int ng) {
    const int col = threadIdx.x >> 2, w = threadIdx.x & 3;
    if ((col >> 4) < ng) {
        const ulonglong2* cw = reinterpret_cast<const ulonglong2*>(bitmap + (gt0 * TILE_K + col) * 4);
        const ulonglong2 a = cw[0], b = cw[1];
        const u64 words[4] = {a.x, a.y, b.x, b.y};
        u32 s = tile_offset[gt0 + (col >> 4)] + (colinfo[gt0 * TILE_K + col] >> 16);
#pragma unroll
        for (int q = 0; q < 3; ++q) s += q < w ? __popcll(words[q]) : 0;
        const u64 wd = w == 0 ? words[0] : w == 1 ? words[1] : w == 2 ? words[2] : words[3];
        const u32 lo = (u32)wd, hi = (u32)(wd >> 32);
        ent[col * 8 + 2 * w] = make_uint2(lo, s);
        ent[col * 8 + 2 * w + 1] = make_uint2(hi, s + __popc(lo));
    }
    __syncthreads();
}

// Decode to dense, v2 (the default): the same block shape and output staging, with the per-column work
// halved. A warp's 32 rows are one 32-bit half of one bitmap word (w = t >> 6, half h = (t >> 5) & 1), so
// the block first builds, per (column, word half), one 8-byte entry {the half's 32 bits, the value index of
// its first set bit}; per column a lane then needs one broadcast 8-byte LDS, one masked 32-bit popcount
// and one predicated 2-byte load (the first version: two LDS, 64-bit shifts, a 64-bit popcount and a select).
__global__ void __launch_bounds__(256) tcbc_decode_dense2(const u64* __restrict__ bitmap, const u32* __restrict__ colinfo,
                                                          const u32* __restrict__ tile_offset,
                                                          const u16* __restrict__ values, u16* __restrict__ Wd,
                                                          int grid_c, int M, int ldw) {
    __shared__ uint2 ent[DD_G * TILE_K * 8];  // [column][word half]: {bits, value index of the first set bit}
    __shared__ __align__(16) u16 stage[TILE_M * DD_STRIDE];
    const int gtc0 = blockIdx.x * DD_G, tr = blockIdx.y, t = threadIdx.x;
    const int ng = min(DD_G, grid_c - gtc0);
    const size_t gt0 = (size_t)tr * grid_c + gtc0;  // the block's GTiles are consecutive
    dd_entries(ent, bitmap, colinfo, tile_offset, gt0, ng);
    const int hw = t >> 5, lane = t & 31;
    const u32 lt = (1u << lane) - 1u;
    dd_stage_and_write(stage, Wd, ng, tr, gtc0, M, ldw, [&](int gg, int c) -> u32 {
        const uint2 e = ent[(gg * TILE_K + c) * 8 + hw];
        u32 v = 0u;
        if ((e.x >> lane) & 1u) v = values[e.y + __popc(e.x & lt)];
        return v;
    });
}

// Decode to dense of b-bit codes (BITS 4 or 2), exactly: decode_dense2's block, entries and output staging. The
// weight of a set bit is w = code * scale (the code packed as formats/bitpack.py: code i in byte i*BITS/8 at bit
// (i*BITS) % 8, sign-extended; the row's float16 group scale), formed in float32, where it is exact (at most 3 + 11
// significant bits). It is written as two float16 halves, hi = fp16(w) to Wd[:, 0:kp] and lo = fp16(w - hi) (at
// most 3 significant bits, exact) to Wd[:, kp:2kp], so hi + lo == w and ONE cuBLAS product over 2kp inner columns
// with [X, X] sums exact products in float32: the CPU reference's weights, not a float16 rounding of them (on a tiny
// model that rounding flipped enough threshold decisions to move the perplexity by half the thresholds' effect).
// 2-bit codes (-2..1) times a float16 scale are float16 already: hi only, [M, kp].
// scales_t [groups, Mp] (DeviceTiledCBC), gs the group size (a multiple of 16, or >= K: one group).
template <int BITS>
__global__ void __launch_bounds__(256) tcbc_decode_dense_int(const u64* __restrict__ bitmap,
                                                             const u32* __restrict__ colinfo,
                                                             const u32* __restrict__ tile_offset,
                                                             const unsigned char* __restrict__ values,
                                                             const u16* __restrict__ scales_t, u16* __restrict__ Wd,
                                                             int grid_c, int M, int kp, int Mp, int gs) {
    __shared__ uint2 ent[DD_G * TILE_K * 8];
    __shared__ __align__(16) u16 stage[TILE_M * DD_STRIDE];
    const int gtc0 = blockIdx.x * DD_G, tr = blockIdx.y, t = threadIdx.x;
    const int ng = min(DD_G, grid_c - gtc0);
    dd_entries(ent, bitmap, colinfo, tile_offset, (size_t)tr * grid_c + gtc0, ng);
    const int hw = t >> 5, lane = t & 31, row = tr * TILE_M + t;
    const u32 lt = (1u << lane) - 1u;
    auto weight = [&](int gg, int c) -> float {  // w of this thread's row in column c of GTile gg (0: no bit)
        const uint2 e = ent[(gg * TILE_K + c) * 8 + hw];
        if (!((e.x >> lane) & 1u)) return 0.f;
        const u32 i = e.y + __popc(e.x & lt);
        const int shift = (int)((i * BITS) & 7u);
        // the code's top bit to bit 31, then an arithmetic shift back: sign-extended
        const int code = ((int)((u32)values[(i * BITS) >> 3] << (32 - BITS - shift))) >> (32 - BITS);
        const u16 sh = scales_t[(size_t)(((gtc0 + gg) * TILE_K + c) / gs) * Mp + row];
        float sf;
        asm("cvt.f32.f16 %0, %1;" : "=f"(sf) : "h"(sh));
        return (float)code * sf;
    };
    constexpr int HALVES = BITS > 2 ? 2 : 1;  // 2-bit codes (-2..1) times a float16 scale are float16: no lo
    dd_stage_and_write(stage, Wd, ng, tr, gtc0, M, HALVES * kp, [&](int gg, int c) -> u32 { return f2h(weight(gg, c)); });
    if (HALVES == 1) return;
    __syncthreads();  // the staging tile is written again
    dd_stage_and_write(stage, Wd + kp, ng, tr, gtc0, M, 2 * kp, [&](int gg, int c) -> u32 {
        const float w = weight(gg, c);
        float hi;
        asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(f2h(w)));
        return f2h(w - hi);
    });
}
template __global__ void tcbc_decode_dense_int<4>(const u64*, const u32*, const u32*, const unsigned char*,
                                                  const u16*, u16*, int, int, int, int, int);
template __global__ void tcbc_decode_dense_int<2>(const u64*, const u32*, const u32*, const unsigned char*,
                                                  const u16*, u16*, int, int, int, int, int);
