// The decode step's glue in single launches (docs/kernels.md, "Decode-step glue"): RMSNorm, SiLU(gate) * up,
// and rotary embedding with the KV-cache write. Each computes what the model's torch modules compute on float16
// tensors, operation by operation (every float16 operation is done in float32 and rounded to float16, as torch
// does on CUDA), so the results equal the torch path's bit for bit except RMSNorm's sum of squares, whose
// summation order differs (a float32 rounding).
#include "fp16.cuh"

// y[r, :] = w * fp16(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)), x rows ld_x apart. With a residual delta (rows ld_d
// apart; null: none), x is first replaced by fp16(x + delta), written to x_out [R, K] (the residual stream's next
// value), so the add and the norm are one launch. Grid (slices, rows): every block of a row computes the row's sum
// of squares (the same float: row_sum_squares) and writes its slice of ceil(K / gridDim.x) elements, so a row of
// 4096 is spread over several SMs instead of one (one block a row was 14 us per norm on an H100, latency-bound).
// With NORM_EARLY (pdl.cuh) the block's slice of w is copied into shared memory before the wait.
#define NORM_SLICE_MAX 512  // glue.py's NORM_SLICE: the most of a slice the early copy holds
extern "C" __global__ void rms_norm(const u16* __restrict__ x, long long ld_x, const u16* __restrict__ delta,
                                    long long ld_d, u16* __restrict__ x_out, const u16* __restrict__ w,
                                    u16* __restrict__ y, int K, float eps) {
    const int per = (K + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, end = min(K, lo + per);
#if NORM_EARLY
    __shared__ __align__(16) u16 ws[NORM_SLICE_MAX];
    allow_dependents();
    const bool early = end - lo <= NORM_SLICE_MAX && (end - lo) % 8 == 0 && (unsigned long long)(w + lo) % 16 == 0;
    if (early)
        for (int c = threadIdx.x; c < (end - lo) / 8; c += blockDim.x) early_copy<16>(ws + 8 * c, w + lo + 8 * c);
    wait_for_producer();
#else
    pdl_enter();
#endif
    const u16* xr = x + (long long)blockIdx.y * ld_x;
    const u16* dr = delta == nullptr ? nullptr : delta + (long long)blockIdx.y * ld_d;
    const float r = row_rsqrt(xr, dr, K, eps);
#if NORM_EARLY
    early_copy_wait();
    __syncthreads();
#endif
    u16* yr = y + (long long)blockIdx.y * K;
    for (int k = lo + threadIdx.x; k < end; k += blockDim.x) {
        const float v = residual_at(xr, dr, k);
        if (dr != nullptr) x_out[(long long)blockIdx.y * K + k] = f2h(v);
#if NORM_EARLY
        yr[k] = norm_at(v, r, early ? ws[k - lo] : w[k]);
#else
        yr[k] = norm_at(v, r, w[k]);
#endif
    }
}

// y[r, i] = fp16(fp16(silu(g)) * u) with g = gate[r, i], u = up[r, i] (rows ld_g / ld_u apart); y contiguous.
extern "C" __global__ void silu_mul(const u16* __restrict__ gate, long long ld_g, const u16* __restrict__ up,
                                    long long ld_u, u16* __restrict__ y, int I) {
    pdl_enter();
    const int r = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
        const float g = h2f(gate[(long long)r * ld_g + i]);
        const float s = h2f(f2h(__fdiv_rn(g, 1.f + expf(-g))));
        y[(long long)r * I + i] = f2h(s * h2f(up[(long long)r * ld_u + i]));
    }
}

// Token row r = b * T + t at cache slot pos[t] and rotary position rpos[r]: q (H heads) rotated into q_out
// [B, H, T, D]; k (Hkv heads) rotated and v copied into the layer's caches [B, Hkv, L, D] at that slot.
// Rotation, per head, of x at d < D/2 with x[d + D/2] and back: out[d] = fp16(fp16(x[d] * cos[d]) + fp16(rot[d] * sin[d])), rot[d] = -x[d + D/2] for
// d < D/2 and x[d - D/2] above; cos and sin are the [L, D] tables at the rotary position.
extern "C" __global__ void rotary_cache(const u16* __restrict__ q, long long ld_q, const u16* __restrict__ k,
                                        long long ld_k, const u16* __restrict__ v, long long ld_v,
                                        const u16* __restrict__ cos_t, const u16* __restrict__ sin_t,
                                        const long long* __restrict__ pos, const long long* __restrict__ rpos,
                                        int T, int H, int Hkv, int D, int L,
                                        u16* __restrict__ q_out, u16* __restrict__ k_cache,
                                        u16* __restrict__ v_cache) {
    pdl_enter();
    const int r = blockIdx.y, b = r / T, t = r % T;
    const long long p = ld_after_wait(pos + t), pr = ld_after_wait(rpos + r);  // pdl.cuh
    const int half = D / 2;
    const int n = (H + 2 * Hkv) * D;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int head = e / D, d = e % D;
        if (head >= H + Hkv) {  // v: copied into the cache
            const int h = head - H - Hkv;
            v_cache[(((long long)b * Hkv + h) * L + p) * D + d] = v[(long long)r * ld_v + h * D + d];
            continue;
        }
        const bool is_q = head < H;
        const int h = is_q ? head : head - H;
        const u16* src = is_q ? q + (long long)r * ld_q + h * D : k + (long long)r * ld_k + h * D;
        const float x = h2f(src[d]);
        const float rot = d < half ? -h2f(src[d + half]) : h2f(src[d - half]);
        const float c = h2f(cos_t[pr * D + d]), s = h2f(sin_t[pr * D + d]);
        const u16 out = f2h(h2f(f2h(x * c)) + h2f(f2h(rot * s)));
        if (is_q) q_out[(((long long)b * H + h) * T + t) * D + d] = out;
        else k_cache[(((long long)b * Hkv + h) * L + p) * D + d] = out;
    }
}
