// The decode step's last launch (docs/kernels.md, "lm_head and the greedy choice"): logits = fp16(x . W^T) of B <= 8
// rows, stored as float32 (what the model's lm_head followed by .float() gives, up to the float32 summation order),
// and with `tokens` each row's argmax as torch.argmax takes it (the largest logit, the first of equal ones, a NaN
// above everything), so the final norm, lm_head and the greedy choice are two launches instead of four.
//
// A warp takes 16 vocabulary rows at a time through mma.m16n8k16 (float16 in, float32 accumulators), the batch as
// the mma's 8 columns: lane (g, t) loads 16 bytes of rows g and g + 8 at k = 32j + 8t (each row's 64 bytes of a
// k block are one coalesced segment) and the 16 bytes of x's row g at the same k from shared memory. Inside the
// k block the mma's k order is permuted (logical columns 2t, 2t+1, 2t+8, 2t+9 of the first mma are k = 8t .. 8t+3,
// those of the second 8t+4 .. 8t+7), the same for W and x, so a dot product sums the same terms. The weight is no
// kernel's output, so each warp's first loads go out before griddepcontrol.wait (pdl.cuh); x is read after it.
// Every block keeps the best (logit, index) of each row; the last block to finish (an atomic ticket, reset by that
// block so that a CUDA graph replays it) reduces the blocks' and writes the tokens.
#include "fp16.cuh"

#define HEAD_WARPS 8
#define HEAD_U 4      // k blocks of 32 a warp has in flight (2 x 16 bytes a lane each)
#define HEAD_XPAD 32  // halves of padding a shared x row: rows 64 bytes apart mod 128, conflict-free 16-byte loads

// (v1, i1) comes before (v2, i2) in torch.argmax's order: a NaN above every number, then the larger value, then
// the smaller index.
__device__ __forceinline__ bool beats(float v1, int i1, float v2, int i2) {
    const bool n1 = v1 != v1, n2 = v2 != v2;
    if (n1 != n2) return n1;
    if (!n1 && v1 != v2) return v1 > v2;
    return i1 < i2;
}

__device__ __forceinline__ void take_best(float& v, int& i, float v2, int i2) {
    if (beats(v2, i2, v, i)) {
        v = v2;
        i = i2;
    }
}

__device__ __forceinline__ uint4 ld_weight(const u16* p) {  // streamed once: no L1 allocation
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void mma16816(float* c, const uint4& a_lo, const uint4& a_hi, unsigned b0, unsigned b1,
                                         bool second) {
    // A fragment: a0 = (row g, k 2t..2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8..), a3 = (row g+8, same).
    const unsigned a0 = second ? a_lo.z : a_lo.x, a2 = second ? a_lo.w : a_lo.y;
    const unsigned a1 = second ? a_hi.z : a_hi.x, a3 = second ? a_hi.w : a_hi.y;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x [B, K] float16 (rows ld_x apart, 16-byte aligned), w [V, K] float16 contiguous, K % 8 == 0, B <= 8.
// logits [B, V] float32; tokens [B] int64 or null (no choice); part_v / part_i [8, gridDim.x] and ticket [1]
// (zero between launches) only with tokens. Dynamic shared memory: B * (K + HEAD_XPAD) halves.
extern "C" __global__ void __launch_bounds__(HEAD_WARPS * 32)
    lm_head_greedy(const u16* x, long long ld_x, const u16* __restrict__ w, int V, int K, int B,
                   float* __restrict__ logits, long long* tokens, float* part_v, int* part_i, int* ticket) {
    extern __shared__ __align__(16) u16 xs[];
    __shared__ float warp_v[HEAD_WARPS][8];
    __shared__ int warp_i[HEAD_WARPS][8];
    __shared__ bool last;
    allow_dependents();  // the wait comes after the first weight loads
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kblocks = (K + 31) / 32, steps = (kblocks + HEAD_U - 1) / HEAD_U;
    const int groups = (V + 15) / 16, stride = gridDim.x * HEAD_WARPS, ldx = K + HEAD_XPAD;
    const int first = blockIdx.x * HEAD_WARPS + warp;
    const int mine = first < groups ? (groups - first + stride - 1) / stride : 0;  // this warp's 16-row groups
    const int total = mine * steps;

    // step s: group first + (s / steps) * stride, k blocks (s % steps) * HEAD_U ...; a lane's two rows' 16 bytes
    uint4 lo[HEAD_U], hi[HEAD_U];
    auto load = [&](int s) {
        const int row = (first + (s / steps) * stride) * 16 + g, kb0 = (s % steps) * HEAD_U;
#pragma unroll
        for (int u = 0; u < HEAD_U; ++u) {
            const int k = (kb0 + u) * 32 + 8 * t;
            const bool in_k = k < K;
            lo[u] = in_k && row < V ? ld_weight(w + (long long)row * K + k) : make_uint4(0, 0, 0, 0);
            hi[u] = in_k && row + 8 < V ? ld_weight(w + (long long)(row + 8) * K + k) : make_uint4(0, 0, 0, 0);
        }
    };
    if (total > 0) load(0);
    wait_for_producer();
    const int xn = B * (K / 8);  // x's 16-byte pieces, after the wait (ld.global.cg, pdl.cuh), 4 a thread in flight
    for (int i0 = threadIdx.x; i0 < xn; i0 += 4 * blockDim.x) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * blockDim.x, r = i / (K / 8), c = i % (K / 8);
            if (i < xn) v[u] = ld_after_wait(reinterpret_cast<const int4*>(x + (long long)r * ld_x + 8 * c));
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * blockDim.x, r = i / (K / 8), c = i % (K / 8);
            if (i < xn) *reinterpret_cast<int4*>(xs + r * ldx + 8 * c) = v[u];
        }
    }
    __syncthreads();

    float best_v[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};  // batch columns 2t, 2t+1
    int best_i[2] = {0x7fffffff, 0x7fffffff};
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < total; ++s) {
        uint4 cl[HEAD_U], ch[HEAD_U];
#pragma unroll
        for (int u = 0; u < HEAD_U; ++u) {
            cl[u] = lo[u];
            ch[u] = hi[u];
        }
        if (s + 1 < total) load(s + 1);
        const int kb0 = (s % steps) * HEAD_U;
#pragma unroll
        for (int u = 0; u < HEAD_U; ++u) {
            const int k = (kb0 + u) * 32 + 8 * t;
            uint4 b = make_uint4(0, 0, 0, 0);
            if (g < B && k < K) b = *reinterpret_cast<const uint4*>(xs + g * ldx + k);
            mma16816(acc, cl[u], ch[u], b.x, b.y, false);
            mma16816(acc, cl[u], ch[u], b.z, b.w, true);
        }
        if (s % steps == steps - 1) {  // the group is done: c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g + 8
            const int row = (first + (s / steps) * stride) * 16 + g;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int v = row + (j >> 1) * 8, n = 2 * t + (j & 1);
                const float y = h2f(f2h(acc[j]));
                if (v < V && n < B) {
                    logits[(long long)n * V + v] = y;
                    take_best(best_v[j & 1], best_i[j & 1], y, v);
                }
                acc[j] = 0.f;
            }
        }
    }
    if (tokens == nullptr) return;

    // The block's best of each batch column: over the lanes of a column (g = lane bits 2..4), then the warps.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
            take_best(best_v[j], best_i[j], __shfl_xor_sync(0xffffffffu, best_v[j], o),
                      __shfl_xor_sync(0xffffffffu, best_i[j], o));
        if (g == 0) {
            warp_v[warp][2 * t + j] = best_v[j];
            warp_i[warp][2 * t + j] = best_i[j];
        }
    }
    __syncthreads();
    if (threadIdx.x < B) {
        float v = warp_v[0][threadIdx.x];
        int i = warp_i[0][threadIdx.x];
        for (int k = 1; k < HEAD_WARPS; ++k) take_best(v, i, warp_v[k][threadIdx.x], warp_i[k][threadIdx.x]);
        part_v[threadIdx.x * gridDim.x + blockIdx.x] = v;
        part_i[threadIdx.x * gridDim.x + blockIdx.x] = i;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (warp < B) {  // warp n reduces column n over the blocks
        const volatile float* pv = part_v + warp * gridDim.x;
        const volatile int* pi = part_i + warp * gridDim.x;
        float v = -__int_as_float(0x7f800000);
        int i = 0x7fffffff;
        for (int b = lane; b < (int)gridDim.x; b += 32) take_best(v, i, pv[b], pi[b]);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1)
            take_best(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        if (lane == 0) tokens[warp] = i;
    }
    if (threadIdx.x == 0) *ticket = 0;
}
