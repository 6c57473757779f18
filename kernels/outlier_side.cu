// The 8-bit outlier side product added to the IE-BME kernel's output in one launch (docs/kernels.md, "Outlier side
// product"): out[r, m] = fp16(y[r, m] + sum over side groups j of (sx[r, j] * sw[m, j]) * (q_x[r, g_j] . q_w[m, g_j])),
// float32 in group order, each product and sum rounded once (no fused multiply-add), the integer dot products exact:
// the arithmetic of formats/arithmetic/grouped.py's grouped_int_matmul on the float32 of y, then one float16 rounding.
#include "fp16.cuh"

__device__ __forceinline__ float side_term(float acc, float sx, float sw, int dot) {
    return __fadd_rn(acc, __fmul_rn(__fmul_rn(sx, sw), (float)dot));
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {  // c + the dot product of a's and b's four signed bytes
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Any n and group size: one thread per output element, the token row's side codes in shared memory. Grid
// (ceil(M / blockDim.x), N).
extern "C" __global__ void side_product(const u16* __restrict__ y, long long ld_y, const signed char* __restrict__ xq,
                                        const float* __restrict__ sx, const signed char* __restrict__ wq,
                                        const float* __restrict__ sw, u16* __restrict__ out, int M, int n, int gs) {
    pdl_enter();
    extern __shared__ int xs[];
    const int r = blockIdx.y;
    const int G = (n + gs - 1) / gs;
    for (int c = threadIdx.x; c < n; c += blockDim.x) xs[c] = xq[(long long)r * n + c];
    __syncthreads();
    const int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    float acc = h2f(y[(long long)r * ld_y + m]);
    const signed char* w = wq + (long long)m * n;
    for (int j = 0; j < G; ++j) {
        const int a = j * gs, b = min(a + gs, n);
        int dot = 0;
        for (int c = a; c < b; ++c) dot += xs[c] * (int)w[c];
        acc = side_term(acc, sx[(long long)r * G + j], sw[(long long)m * G + j], dot);
    }
    out[(long long)r * M + m] = f2h(acc);
}

// n a multiple of 16 and one group or groups of a multiple of 16 channels, wq 16-byte aligned (the default: 128
// outlier channels in one group). Eight lanes per output row, four rows per warp: lane s of a row reads the row's
// 16-byte chunks s, s + 8, ... (a row of 128 codes is one coalesced 128-byte line; the one-thread-per-row kernel
// above reads it a byte at a time, 32 lines per warp load) and dots them with the token's codes in shared memory
// (dp4a, exact); three shuffles complete each group's integer sum, which is scaled in group order as above.
// Grid (ceil(M / (4 * warps)), ceil(N / ROWS)); a block takes up to ROWS token rows, their codes in shared memory.
#define SIDE16_ROWS 8
extern "C" __global__ void side_product16(const u16* __restrict__ y, long long ld_y,
                                          const signed char* __restrict__ xq, const float* __restrict__ sx,
                                          const signed char* __restrict__ wq, const float* __restrict__ sw,
                                          u16* __restrict__ out, int M, int n, int gs, int N) {
    pdl_enter();
    extern __shared__ int4 xs4[];
    const int r0 = blockIdx.y * SIDE16_ROWS, rows = min(SIDE16_ROWS, N - r0);
    signed char* xsb = reinterpret_cast<signed char*>(xs4);
    for (int i = threadIdx.x; i < rows * n; i += blockDim.x) xsb[i] = xq[(long long)r0 * n + i];
    __syncthreads();
    const int lane = threadIdx.x & 31, sub = lane & 7;
    const int m = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 4 + (lane >> 3);
    if (m >= M) return;  // the row's eight lanes leave together
    const unsigned seg = 0xffu << (lane & 24);
    const int nc = n >> 4, G = (n + gs - 1) / gs, cg = G == 1 ? nc : gs >> 4;
    const int4* w4 = reinterpret_cast<const int4*>(wq + (long long)m * n);
    for (int i = 0; i < rows; ++i) {
        const int r = r0 + i;
        const int4* x4 = xs4 + i * nc;
        float acc = h2f(y[(long long)r * ld_y + m]);
        for (int j = 0; j < G; ++j) {
            const int c1 = min((j + 1) * cg, nc);
            int dot = 0;
            for (int c = j * cg + sub; c < c1; c += 8) {
                const int4 w = w4[c], x = x4[c];
                dot = dp4a(w.w, x.w, dp4a(w.z, x.z, dp4a(w.y, x.y, dp4a(w.x, x.x, dot))));
            }
            dot += __shfl_xor_sync(seg, dot, 1);
            dot += __shfl_xor_sync(seg, dot, 2);
            dot += __shfl_xor_sync(seg, dot, 4);
            acc = side_term(acc, sx[(long long)r * G + j], sw[(long long)m * G + j], dot);
        }
        if (sub == 0) out[(long long)r * M + m] = f2h(acc);
    }
}
