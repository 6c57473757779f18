// Decode an IE-BME layer to a dense float16 weight for one cuBLAS GEMM at prefill (docs/kernels.md, "IE-BME
// prefill"): tile 16x64, areas 2x2 (union mask 8x32 = 4 words), b-bit codes (BITS 4 or 2) times the row's float16
// group scale, formed in float32 where it is exact (at most 3 + 11 significant bits). 4-bit weights are written as
// two float16 halves, hi = fp16(w) to Wd[:, 0:kp] and lo = fp16(w - hi) (exact) to Wd[:, kp:2kp], so one GEMM of
// [X, X] over 2 kp columns sums exact products (tiled_cbc_spmm.cu's tcbc_decode_dense_int does the same); 2-bit
// weights (-2..1 times a float16 scale) are float16 already: hi only. A position with code 0 (padding columns share
// union positions with real ones) reads no scale: past K the group index runs off the scales.
// Block = one local tile, thread = 4 of its 1024 elements in original row order (rows r, r + 4, r + 8, r + 12): tile row r is permuted row
// i = pinv[r] (identity without permutations), i.e. area row a = i / 8, union row i % 8; column c is area column
// b = c / 32, union column c % 32; the union position p = (i % 8) * 32 + c % 32 is stored when its bit is set,
// and area q = 2a + b's code is code q * P + rank of the tile's stream (docs/format.md, "IE-BME").
#include "fp16.cuh"

typedef unsigned long long u64;

template <int BITS>
__global__ void __launch_bounds__(256) iebme_decode_dense(const unsigned char* __restrict__ values,
                                                          const u64* __restrict__ bitmaps,
                                                          const unsigned* __restrict__ offsets,
                                                          const unsigned char* __restrict__ pinv,
                                                          const u16* __restrict__ wsT, u16* __restrict__ Wd, int M,
                                                          int tc, int kp, int mp, int gs) {
    constexpr int HALVES = BITS > 2 ? 2 : 1;
    __shared__ u64 words[4];
    __shared__ unsigned before[5];  // set bits of the words before word w; before[4]: the tile's P
    const int t = blockIdx.x, tr = t / tc, tcol = t % tc;
    if (threadIdx.x < 4) words[threadIdx.x] = bitmaps[(size_t)t * 4 + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned s = 0;
        for (int w = 0; w < 4; ++w) {
            before[w] = s;
            s += __popcll(words[w]);
        }
        before[4] = s;
    }
    __syncthreads();
    const unsigned base = offsets[t], P = before[4];
    const size_t ldw = (size_t)HALVES * kp;
    // A thread's four elements in three passes with no branches between their loads, so each pass has its four
    // loads in flight together (the permuted row, the code's byte, the scale). A position whose bit is clear reads
    // the stream's first byte and a code of 0 reads row's group-0 scale (both in bounds; neither is used).
    int code[4];
    unsigned idx[4];
    bool set[4];
    unsigned char perm_row[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) perm_row[j] = pinv == nullptr ? (unsigned char)(j * 4 + (threadIdx.x >> 6))
                                                               : pinv[(size_t)t * 16 + j * 4 + (threadIdx.x >> 6)];
    const int c = threadIdx.x & 63;  // e = threadIdx.x + 256 j: row r = 4 j + threadIdx.x / 64, column c
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = perm_row[j];
        const int p = (i & 7) * 32 + (c & 31), wi = p >> 6, bit = p & 63;
        set[j] = (words[wi] >> bit) & 1ull;
        const unsigned rank = before[wi] + __popcll(words[wi] & ((1ull << bit) - 1ull));
        idx[j] = set[j] ? base + (unsigned)((i >> 3) * 2 + (c >> 5)) * P + rank : base;
    }
    unsigned char byte[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) byte[j] = values[(idx[j] * BITS) >> 3];
    u16 scale[4];
    const int col = tcol * 64 + c;
    const size_t group_row0 = (size_t)(col / gs) * mp;  // the same column for the four elements
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int shift = (int)((idx[j] * BITS) & 7u);  // the code's top bit to bit 31, then back: sign-extended
        code[j] = set[j] ? ((int)((unsigned)byte[j] << (32 - BITS - shift))) >> (32 - BITS) : 0;
        const int row = tr * 16 + j * 4 + (threadIdx.x >> 6);
        scale[j] = wsT[code[j] != 0 ? group_row0 + row : (size_t)min(row, mp - 1)];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int row = tr * 16 + j * 4 + (threadIdx.x >> 6);
        if (row >= M) continue;
        const float w = code[j] != 0 ? (float)code[j] * h2f(scale[j]) : 0.f;
        const u16 hi = f2h(w);
        Wd[(size_t)row * ldw + col] = hi;
        if (HALVES == 2) Wd[(size_t)row * ldw + kp + col] = f2h(w - h2f(hi));
    }
}
template __global__ void iebme_decode_dense<4>(const unsigned char*, const u64*, const unsigned*,
                                               const unsigned char*, const u16*, u16*, int, int, int, int, int);
template __global__ void iebme_decode_dense<2>(const unsigned char*, const u64*, const unsigned*,
                                               const unsigned char*, const u16*, u16*, int, int, int, int, int);
