// The 8-bit outlier side product added to the IE-BME kernel's output in one launch (docs/kernels.md, "Outlier side
// product"): out[r, m] = fp16(y[r, m] + sum over side groups j of (sx[r, j] * sw[m, j]) * (q_x[r, g_j] . q_w[m, g_j])),
// float32 in group order, each product and sum rounded once (no fused multiply-add), the integer dot products exact:
// the arithmetic of formats/arithmetic/grouped.py's grouped_int_matmul on the float32 of y, then one float16 rounding.
// One thread per output element; the token row's side codes in shared memory.
#include "fp16.cuh"

extern "C" __global__ void side_product(const u16* __restrict__ y, long long ld_y, const signed char* __restrict__ xq,
                                        const float* __restrict__ sx, const signed char* __restrict__ wq,
                                        const float* __restrict__ sw, u16* __restrict__ out, int M, int n, int gs) {
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
        acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(sx[(long long)r * G + j], sw[(long long)m * G + j]), (float)dot));
    }
    out[(long long)r * M + m] = f2h(acc);
}
