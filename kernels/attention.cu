// Decode attention over the KV cache's valid length (docs/kernels.md, "Decode attention"): one query token per
// sequence (T = 1) at cache slot pos, row b seeing the slots j <= pos with j >= offset[b] (its left padding
// hidden; the query's own slot always seen), grouped-query heads (H = G * Hkv) reading their KV head once.
// One launch, split along the sequence (flash-decoding): block (chunk c, KV head, row) scores the chunk's CHUNK
// slots against the G query heads of that KV head, takes the chunk's softmax max and sum and its weighted sum of
// V in float32, and hands them over in part_o / part_ml; the last block of a (row, KV head) to finish (a ticket
// counter, reset by that block, so a CUDA graph replays it) combines the chunks into the output, rounded to
// float16 once. Chunks past pos read nothing and take no ticket (the grid covers the allocated length, so a graph
// replays it at any pos).
// With `codes` set, the combining block also writes o_proj's quantized input for its G heads (act_quant.cu's rule,
// bit for bit, on the float16 outputs): the host passes it only when those G * D channels are whole quantization
// groups (gm divides G * D) and no channel is permuted (no outlier side), so one launch replaces the act_quant one.
// With `rq` set (the fused form, docs/kernels.md "Decode attention"), the launch also does glue.cu's rotary_cache
// for its token: q, k and v are the raw rows of the Q/K/V product, every block rotates its G query heads itself
// (glue.cu's arithmetic, so the same float16 values), and the block whose chunk holds slot pos rotates k, writes k
// and v into the caches at pos and uses them from registers (no block reads slot pos from the cache in this
// launch). One launch a layer instead of two.
// Memory-level parallelism is the point at batch 1 (a layer's K and V are a few MB): each lane loads its D/32
// halves of K and V of all SLOTS slots of its warp before using any (vector loads, one slot's row per warp load).
#include "act_rule.cuh"
#include "cluster.cuh"

#define CHUNK 32
#define WARPS 4
#define SLOTS (CHUNK / WARPS)  // slots per warp: 8 (slot_sums)
#define MAX_G 8
#define MAX_D 256
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY macro
#ifndef ATTN_EARLY
#define ATTN_EARLY 1  // attention.py passes -DATTN_EARLY=<attention.EARLY>; 0: wait first, every load after it
#endif

// The warp's sums of a[0..7] over its 32 lanes in 9 shuffles instead of 40: a transposing butterfly in which
// each exchange halves the slots a lane carries. Lane l ends with the sum of slot ((l >> 2) & 7).
__device__ __forceinline__ float slot_sums(const float* a, int lane) {
    static_assert(SLOTS == 8, "slot_sums reduces 8 slots a warp");
    float b[4], c[2];
    const bool h16 = lane & 16, h8 = lane & 8, h4 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float send = h16 ? a[i] : a[i + 4];
        b[i] = (h16 ? a[i + 4] : a[i]) + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float send = h8 ? b[i] : b[i + 2];
        c[i] = (h8 ? b[i + 2] : b[i]) + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    float d = (h4 ? c[1] : c[0]) + __shfl_xor_sync(0xffffffffu, h4 ? c[0] : c[1], 4);
    d += __shfl_xor_sync(0xffffffffu, d, 2);
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    return d;
}

// What the kernel before wrote (q, the raw Q/K/V rows, the cache slot pos that glue.cu's rotary_cache wrote), read
// after the wait with ld.global.cg (volatile: the compiler keeps them after it, pdl.cuh), PER halves at p into
// (PER + 1) / 2 words as load_raw lays them out below, or as floats.
__device__ __forceinline__ unsigned int ld_cg_u32(const u16* p) {
    unsigned int v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned int ld_cg_u16(const u16* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

template <int PER>
__device__ __forceinline__ void load_raw_produced(const u16* p, unsigned int* w) {
    if (PER % 8 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 8) {
            const int4 x = ld_after_wait(reinterpret_cast<const int4*>(p + i));
            w[i / 2] = x.x;
            w[i / 2 + 1] = x.y;
            w[i / 2 + 2] = x.z;
            w[i / 2 + 3] = x.w;
        }
    } else if (PER % 2 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 2) w[i / 2] = ld_cg_u32(p + i);
    } else {
#pragma unroll
        for (int i = 0; i < PER; i += 2) w[i / 2] = ld_cg_u16(p + i) | (i + 1 < PER ? ld_cg_u16(p + i + 1) << 16 : 0u);
    }
}

template <int PER>
__device__ __forceinline__ void load_produced(const u16* p, float* out) {
    unsigned int w[(PER + 1) / 2];
    load_raw_produced<PER>(p, w);
#pragma unroll
    for (int i = 0; i < PER; ++i) out[i] = h2f((u16)(i & 1 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu));
}

// o_proj's input rule for the combine's quantized output (codes == nullptr: none): codes int8 [B, Kp] (Kp >= H * D,
// the padding zeroed by KV head 0's block), scales float32 [B, H * D / gm]; bits, clip, grid_max, tiny as act_quant.cu.
struct OutQuant {
    signed char* codes;
    float* scales;
    int Kp, gm, bits;
    float clip, grid, tiny;
};

// o_proj's quantized input (act_rule.cuh) from the combined float16 outputs red[0, GD) of row b, which are the row's
// channels [first, first + GD) of HD, whole groups of oq.gm: a warp a group (NWARPS warps); KV head 0's block also
// zeroes the codes' padding [HD, Kp).
template <int NWARPS>
__device__ __forceinline__ void quantize_o_input(const OutQuant& oq, const float* red, int b, int hk, int first, int GD,
                                                 int HD, int warp, int lane) {
    const int ng = GD / oq.gm;
    const int lo = act_code_lo(oq.bits), hi = act_code_hi(oq.bits);
    for (int gi = warp; gi < ng; gi += NWARPS) {
        const float* v = red + gi * oq.gm;
        float amax = 0.f;
        for (int i = lane; i < oq.gm; i += 32) amax = fmaxf(amax, fabsf(v[i]));
        const float s = act_scale(warp_max(amax), oq.clip, oq.grid, oq.tiny);
        const int c0 = first + gi * oq.gm;  // first channel of the group in the row
        for (int i = lane; i < oq.gm; i += 32) oq.codes[(long long)b * oq.Kp + c0 + i] = act_code(v[i], s, lo, hi);
        if (lane == 0) oq.scales[(long long)b * (HD / oq.gm) + c0 / oq.gm] = s;
    }
    if (hk == 0)
        for (int p = HD + threadIdx.x; p < oq.Kp; p += blockDim.x) oq.codes[(long long)b * oq.Kp + p] = 0;
}

// The fused rotary embedding (rq == nullptr: none): raw q [B, H * D] and k, v [B, Hkv * D] rows ld_q / ld_k / ld_v
// apart (16-byte aligned rows), the [L, D] cos / sin tables, the rotary position rpos [B], the caches to write.
struct Rope {
    const u16* rq;
    long long ld_q;
    const u16* rk;
    long long ld_k;
    const u16* rv;
    long long ld_v;
    const u16* cos_t;
    const u16* sin_t;
    const long long* rpos;
    u16* k_out;
    u16* v_out;
};

// glue.cu's rotation of one head, the lane's PER elements d = lane * PER + i: the partner x[d +- D/2] is the same
// element of lane ^ 16; out = fp16(fp16(x * cos) + fp16(rot * sin)) as float16 bits.
template <int PER>
__device__ __forceinline__ void rotate(const float* x, const float* cs, const float* sn, int lane, u16* out) {
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const float partner = __shfl_xor_sync(0xffffffffu, x[i], 16);
        const float rot = lane < 16 ? -partner : partner;
        out[i] = f2h(h2f(f2h(x[i] * cs[i])) + h2f(f2h(rot * sn[i])));
    }
}

// PER halves at p kept as float16 bits, two a word (word i / 2, low half first): a slot's K or V in half the
// registers of floats, so every slot's load has its own registers and all are in flight together (as floats the
// compiler reused the load registers across slots and the loads waited on each other).
template <int PER>
__device__ __forceinline__ void load_raw(const u16* __restrict__ p, unsigned int* w) {
    if (PER % 8 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 8) {
            const uint4 x = *reinterpret_cast<const uint4*>(p + i);
            w[i / 2] = x.x;
            w[i / 2 + 1] = x.y;
            w[i / 2 + 2] = x.z;
            w[i / 2 + 3] = x.w;
        }
    } else if (PER % 4 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 4) {
            const uint2 x = *reinterpret_cast<const uint2*>(p + i);
            w[i / 2] = x.x;
            w[i / 2 + 1] = x.y;
        }
    } else if (PER % 2 == 0) {
#pragma unroll
        for (int i = 0; i < PER; i += 2) w[i / 2] = *reinterpret_cast<const unsigned int*>(p + i);
    } else {
#pragma unroll
        for (int i = 0; i < PER; i += 2) w[i / 2] = p[i] | (i + 1 < PER ? (unsigned int)p[i + 1] << 16 : 0u);
    }
}

// element i of a load_raw word array, as a float
__device__ __forceinline__ float raw_at(const unsigned int* w, int i) {
    return h2f((u16)(i & 1 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu));
}

// float16 bits h as element i of a load_raw word array
__device__ __forceinline__ void raw_set(unsigned int* w, int i, u16 h) {
    w[i / 2] = i & 1 ? (w[i / 2] & 0xffffu) | ((unsigned int)h << 16) : (w[i / 2] & 0xffff0000u) | h;
}

// The rotary tables at row b's position (the fused form; rp.rq == nullptr: none, cs and sn left unset), the lane's
// PER elements. Loaded before the wait: no kernel of the step writes them.
template <int PER>
__device__ __forceinline__ void rope_tables(const Rope& rp, int b, int lane, float* cs, float* sn) {
    constexpr int D = PER * 32;
    if (rp.rq == nullptr) return;
    const long long pr = rp.rpos[b];
    load_halves<PER>(rp.cos_t + pr * D + lane * PER, cs);
    load_halves<PER>(rp.sin_t + pr * D + lane * PER, sn);
}

// The lane's PER elements of query head h (of the row's H; `at`: its index into q [B, H, 1, D]), as floats, after
// the wait: with the fused rotary the raw row rotated here and rounded to float16 as rotary_cache writes it; else q.
template <int PER>
__device__ __forceinline__ void load_q(const u16* __restrict__ q, const Rope& rp, int b, int h, long long at,
                                       int lane, const float* cs, const float* sn, float* x) {
    constexpr int D = PER * 32;
    if (rp.rq != nullptr) {
        u16 r[PER];
        load_produced<PER>(rp.rq + (long long)b * rp.ld_q + (long long)h * D + lane * PER, x);
        rotate<PER>(x, cs, sn, lane, r);
#pragma unroll
        for (int i = 0; i < PER; ++i) x[i] = h2f(r[i]);
    } else {
        load_produced<PER>(q + at * D + lane * PER, x);
    }
}

// The warp's slot pos (mine; -1: none of its slots) into its registers, after the wait: with the fused rotary this
// token's k, rotated, and v, also written into the caches at element `at`; else what rotary_cache, the launch
// before, wrote there. Both forms call it where a pass begins.
template <int PER>
__device__ __forceinline__ void slot_pos(int mine, unsigned int (*kv)[(PER + 1) / 2],
                                         unsigned int (*vv)[(PER + 1) / 2], const u16* __restrict__ k_cache,
                                         const u16* __restrict__ v_cache, long long at, int b, int hk, int lane,
                                         const float* cs, const float* sn, const Rope& rp) {
    constexpr int D = PER * 32;
#pragma unroll
    for (int u = 0; u < SLOTS; ++u)  // (a constant index: the slots stay in registers)
        if (u == mine) {  // (warp-uniform)
            if (rp.rq != nullptr) {
                float x[PER];
                u16 h[PER];
                load_produced<PER>(rp.rk + (long long)b * rp.ld_k + hk * D + lane * PER, x);
                rotate<PER>(x, cs, sn, lane, h);
                load_raw_produced<PER>(rp.rv + (long long)b * rp.ld_v + hk * D + lane * PER, vv[u]);
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    raw_set(kv[u], i, h[i]);
                    rp.k_out[at + i] = h[i];
                    rp.v_out[at + i] = f2h(raw_at(vv[u], i));
                }
            } else {
                load_raw_produced<PER>(k_cache + at, kv[u]);
                load_raw_produced<PER>(v_cache + at, vv[u]);
            }
        }
}

// load_slots in two halves, so that a warp can load the next pass's K once its scores are made and V once its
// weighted V is: which slots row b sees and their K (but slot pos), returning slot pos or -1; then their V.
template <int PER>
__device__ __forceinline__ int load_k_slots(const u16* __restrict__ k_cache, long long base, long long j0, int warp,
                                            int lane, long long p, long long off, bool* seen,
                                            unsigned int (*kv)[(PER + 1) / 2]) {
    constexpr int D = PER * 32;
    int mine = -1;
#pragma unroll
    for (int u = 0; u < SLOTS; ++u) {
        const long long j = j0 + warp * SLOTS + u;
        seen[u] = j <= p && (j >= off || j == p);
        if (j == p) mine = u;
        else if (seen[u]) load_raw<PER>(k_cache + base + (j - j0) * D + lane * PER, kv[u]);
    }
    return mine;
}

template <int PER>
__device__ __forceinline__ void load_v_slots(const u16* __restrict__ v_cache, long long base, long long j0, int warp,
                                             int lane, long long p, const bool* seen,
                                             unsigned int (*vv)[(PER + 1) / 2]) {
    constexpr int D = PER * 32;
#pragma unroll
    for (int u = 0; u < SLOTS; ++u) {
        const long long j = j0 + warp * SLOTS + u;
        if (seen[u] && j != p) load_raw<PER>(v_cache + base + (j - j0) * D + lane * PER, vv[u]);
    }
}

// Load the warp's SLOTS slots of the pass at j0 that row b sees (all loads issued before any use: K, then V), but
// the slot holding pos, which the pass's loop reads or makes after the wait (this token's k and v, rotated, with the
// fused rotary; else what rotary_cache, the launch before, wrote). Returns that slot or -1.
template <int PER>
__device__ __forceinline__ int load_slots(const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
                                          long long base, long long j0, int warp, int lane, long long p,
                                          long long off, bool* seen, unsigned int (*kv)[(PER + 1) / 2],
                                          unsigned int (*vv)[(PER + 1) / 2]) {
    const int mine = load_k_slots<PER>(k_cache, base, j0, warp, lane, p, off, seen, kv);
    load_v_slots<PER>(v_cache, base, j0, warp, lane, p, seen, vv);
    return mine;
}

// q [B, H, 1, D]; caches [B, Hkv, L, D]; part_o [B, H, chunks, D] and part_ml [B, H, chunks, 2] (float32);
// ticket [B * Hkv] int32, zero between launches; out [B, 1, H * D]. Dynamic shared memory: WARPS * G * D floats.
// GM: at least the query heads a KV head (the unrolled head loops: q of GM heads in registers).
template <int PER, int GM>
__device__ __forceinline__ void decode(const u16* __restrict__ q, const u16* __restrict__ k_cache,
                                       const u16* __restrict__ v_cache, const long long* __restrict__ pos,
                                       const long long* __restrict__ offset, int H, int Hkv, int L, float scale,
                                       float* __restrict__ part_o, float* __restrict__ part_ml,
                                       int* __restrict__ ticket, u16* __restrict__ out, float* red,
                                       const OutQuant& oq, const Rope& rp) {
    constexpr int D = PER * 32;
    __shared__ float sc[MAX_G][CHUNK];
    __shared__ float cm[MAX_G], cl[MAX_G];
    __shared__ int last;
    const int c = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int G = H / Hkv, chunks = gridDim.x;
    // Before the wait (the kernel's first statement was allow_dependents) only what no kernel of the step writes
    // (docs/kernels.md, "Decode attention"): pos, offset and rpos (torch operations before the step's first
    // kernel), the rotary tables, and the cache's slots other than pos (earlier steps' launches). So a layer's
    // K/V reads overlap the Q/K/V product instead of following it.
#if !ATTN_EARLY
    wait_for_producer();
#endif
    const long long p = *pos;
    const int j0 = c * CHUNK;
    if (j0 > p) return;  // past the valid length: no ticket, the combine does not read this chunk
    const int used = (int)min((long long)chunks, p / CHUNK + 1);
    const long long off = offset[b];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long head0 = (long long)b * H + (long long)hk * G;  // first query head of this KV head

    // the warp's SLOTS slots but pos, all loads first; slot pos is `mine` (read or made after the wait)
    const long long base = (((long long)b * Hkv + hk) * L + j0) * D;
    bool seen[SLOTS];
    unsigned int kv[SLOTS][(PER + 1) / 2], vv[SLOTS][(PER + 1) / 2];  // float16 bits (load_raw), all in flight
    const int mine = load_slots<PER>(k_cache, v_cache, base, j0, warp, lane, p, off, seen, kv, vv);
    float cs[PER], sn[PER];  // the rotary tables at this row's position (fused form)
    rope_tables<PER>(rp, b, lane, cs, sn);
#if ATTN_EARLY
    wait_for_producer();
#endif

    float qr[GM][PER];
#pragma unroll
    for (int g = 0; g < GM; ++g)
        if (g < G) {
            load_q<PER>(q, rp, b, hk * G + g, head0 + g, lane, cs, sn, qr[g]);
#pragma unroll
            for (int i = 0; i < PER; ++i) qr[g][i] *= scale;
        }
    slot_pos<PER>(mine, kv, vv, k_cache, v_cache, base + (p - j0) * D + lane * PER, b, hk, lane, cs, sn, rp);
    // lane's slot after the transposing reduction, and whether the row sees it
    const int uw = (lane >> 2) & 7;
    const long long jw = j0 + warp * SLOTS + uw;
    const bool seen_w = jw <= p && (jw >= off || jw == p);
#pragma unroll
    for (int g = 0; g < GM; ++g)
        if (g < G) {
            float a[SLOTS];
#pragma unroll
            for (int u = 0; u < SLOTS; ++u) {
                a[u] = 0.f;
                if (seen[u]) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) a[u] = fmaf(qr[g][i], raw_at(kv[u], i), a[u]);
                }
            }
            const float s = slot_sums(a, lane);
            if ((lane & 3) == 0) sc[g][warp * SLOTS + uw] = seen_w ? s : NEG_INF;
        }
    __syncthreads();

    // the chunk's max and sum per head (one slot per lane); sc becomes exp(s - max)
    for (int g = warp; g < G; g += WARPS) {
        const float s = sc[g][lane];
        const float m = warp_max(s);
        const float e = m == NEG_INF ? 0.f : expf(s - m);
        sc[g][lane] = e;
        const float l = warp_sum(e);
        if (lane == 0) {
            float* ml = part_ml + ((head0 + g) * chunks + c) * 2;
            ml[0] = m;
            ml[1] = l;
        }
    }
    __syncthreads();

    // weighted V: the warp's slots into red[warp], then summed over the warps
#pragma unroll
    for (int g = 0; g < GM; ++g)
        if (g < G) {
            float acc[PER];
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[i] = 0.f;
#pragma unroll
            for (int u = 0; u < SLOTS; ++u)
                if (seen[u]) {
                    const float w = sc[g][warp * SLOTS + u];
#pragma unroll
                    for (int i = 0; i < PER; ++i) acc[i] = fmaf(w, raw_at(vv[u], i), acc[i]);
                }
#pragma unroll
            for (int i = 0; i < PER; ++i) red[(warp * G + g) * D + lane * PER + i] = acc[i];
        }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) o += red[w * G * D + e];
        part_o[((head0 + e / D) * chunks + c) * D + e % D] = o;
    }

    // the last block of (b, hk) to finish combines the used chunks
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket + (long long)b * Hkv + hk, 1) == used - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int g = warp; g < G; g += WARPS) {
        const float* ml = part_ml + (head0 + g) * chunks * 2;
        float m = NEG_INF;
        for (int k = lane; k < used; k += 32) m = fmaxf(m, __ldcg(ml + 2 * k));
        m = warp_max(m);
        float l = 0.f;
        for (int k = lane; k < used; k += 32) {
            const float mk = __ldcg(ml + 2 * k);
            if (mk != NEG_INF) l += __ldcg(ml + 2 * k + 1) * expf(mk - m);
        }
        l = warp_sum(l);
        if (lane == 0) {
            cm[g] = m;
            cl[g] = l;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
        const int g = e / D, d = e % D;
        const float* ml = part_ml + (head0 + g) * chunks * 2;
        const float* po = part_o + (head0 + g) * chunks * D + d;
        float o = 0.f;
#pragma unroll 8
        for (int k = 0; k < used; ++k) {
            const float mk = __ldcg(ml + 2 * k);
            if (mk != NEG_INF) o = fmaf(__ldcg(po + (long long)k * D), expf(mk - cm[g]), o);
        }
        const u16 h = f2h(o / cl[g]);
        out[(head0 + g) * D + d] = h;
        red[e] = h2f(h);  // red is free here (the partial sums went to part_o)
    }
    if (threadIdx.x == 0) ticket[(long long)b * Hkv + hk] = 0;
    if (oq.codes == nullptr) return;
    // o_proj's quantized input: this block's channels [hk G D, (hk + 1) G D) of row b are whole groups of gm
    __syncthreads();
    quantize_o_input<WARPS>(oq, red, b, hk, hk * G * D, G * D, H * D, warp, lane);
}

// ---- The cluster form (sm_90; attention.CLUSTER): the chunks of a (row, KV head) combined in shared memory ----
// Grid (CL, Hkv, B), one cluster of CL CTAs per (row, KV head), CL_WARPS warps of SLOTS slots a CTA: CTA r takes the
// CL_CHUNK slots at r * CL_CHUNK, then every CL * CL_CHUNK further up to pos (one pass at context <= 512), keeping a
// running max, sum and weighted V per head (online softmax). At the end rank 0 reads the CL partials from the
// other CTAs' shared memory (distributed shared memory) and writes the output, rounded to float16 once. No global
// partials, fence, ticket or second read of them: the split kernel's chain of memory trips after the scores was
// longer than its K/V loads (15.5 us a layer at context 512 against about 3 us of bytes, H100).
// Each pass issues its K/V loads first; the first pass's are in flight while q is loaded and rotated.
#define CL 8
#define CL_WARPS 8
#define CL_CHUNK (CL_WARPS * SLOTS)  // 64 slots a CTA a pass

template <int PER, int GM>  // GM: at least the query heads a KV head (the unrolled head loops; fewer registers)
__device__ __forceinline__ void decode_cluster(const u16* __restrict__ q, const u16* __restrict__ k_cache,
                                               const u16* __restrict__ v_cache, const long long* __restrict__ pos,
                                               const long long* __restrict__ offset, int H, int Hkv, int L,
                                               float scale, u16* __restrict__ out, float* dyn, const OutQuant& oq,
                                               const Rope& rp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int D = PER * 32;
    __shared__ float run_m[MAX_G], run_l[MAX_G], ew[MAX_G][CL];
    const int r = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;  // r: the rank in the cluster (grid x == CL)
    const int G = H / Hkv, GD = G * D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* red = dyn;                        // [CL_WARPS / 2][G * D]: the warps' weighted V of a pass
    float* acc = dyn + (CL_WARPS / 2) * GD;  // [G * D]: the CTA's running weighted V (read by rank 0 at the end)
    float* qs = acc + GD;                    // [G * D]: q times the scale
    // before the wait only what no kernel of the step writes, as in decode above
#if !ATTN_EARLY
    wait_for_producer();
#endif
    const long long p = *pos;
    const long long off = offset[b];
    const long long head0 = (long long)b * H + (long long)hk * G;  // first query head of this KV head
    const long long row0 = ((long long)b * Hkv + hk) * L * D;       // this (row, KV head)'s cache

    long long j0 = (long long)r * CL_CHUNK;
    bool seen[SLOTS];
    unsigned int kv[SLOTS][(PER + 1) / 2], vv[SLOTS][(PER + 1) / 2];  // float16 bits (load_raw)
    int mine = -1;
    if (j0 <= p)  // the first pass's loads before anything else
        mine = load_slots<PER>(k_cache, v_cache, row0 + j0 * D, j0, warp, lane, p, off, seen, kv, vv);

    float cs[PER], sn[PER];  // the rotary tables at this row's position (fused form)
    rope_tables<PER>(rp, b, lane, cs, sn);
#if ATTN_EARLY
    wait_for_producer();
#endif
    // q times the scale, in shared memory (registers hold the slots; each lane reads back its own elements)
    for (int g = warp; g < G; g += CL_WARPS) {
        float x[PER];
        load_q<PER>(q, rp, b, hk * G + g, head0 + g, lane, cs, sn, x);
#pragma unroll
        for (int i = 0; i < PER; ++i) qs[g * D + lane * PER + i] = x[i] * scale;
    }
    for (int e = threadIdx.x; e < GD; e += blockDim.x) acc[e] = 0.f;
    if (threadIdx.x < MAX_G) {
        run_m[threadIdx.x] = NEG_INF;
        run_l[threadIdx.x] = 0.f;
    }

    __syncthreads();  // qs, acc, run_m and run_l written
    const int uw = (lane >> 2) & 7;  // the lane's slot after the transposing reduction
    // Each warp its own online softmax over its slots of every pass: per query head its running max, sum and
    // weighted V in registers, so a pass needs no barrier; the next pass's K is loaded once this pass's scores are
    // made, its V once this pass's weighted V is. The CTA combines its warps at the end.
    float m[GM], l[GM], o[GM][PER];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[g][i] = 0.f;
    }
    while (j0 <= p) {
        slot_pos<PER>(mine, kv, vv, k_cache, v_cache, row0 + p * D + lane * PER, b, hk, lane, cs, sn, rp);
        const long long jw = j0 + warp * SLOTS + uw;
        const bool seen_w = jw <= p && (jw >= off || jw == p);
        float sm[GM];  // the score of the lane's slot uw, per head
#pragma unroll
        for (int g = 0; g < GM; ++g)
            if (g < G) {
                float a[SLOTS];
#pragma unroll
                for (int u = 0; u < SLOTS; ++u) a[u] = 0.f;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const float qi = qs[g * D + lane * PER + i];
#pragma unroll
                    for (int u = 0; u < SLOTS; ++u)
                        if (seen[u]) a[u] = fmaf(qi, raw_at(kv[u], i), a[u]);
                }
                const float sg = slot_sums(a, lane);
                sm[g] = seen_w ? sg : NEG_INF;
            }
        const long long jn = j0 + CL * CL_CHUNK;
        bool seen_n[SLOTS];
#pragma unroll
        for (int u = 0; u < SLOTS; ++u) seen_n[u] = false;
        int mine_n = -1;
        if (jn <= p) mine_n = load_k_slots<PER>(k_cache, row0 + jn * D, jn, warp, lane, p, off, seen_n, kv);
#pragma unroll
        for (int g = 0; g < GM; ++g)
            if (g < G) {
                const float mn = fmaxf(m[g], warp_max(sm[g]));
                if (mn != NEG_INF) {  // warp-uniform: some slot seen so far
                    const float alpha = m[g] == NEG_INF ? 0.f : expf(m[g] - mn);
                    const float e = sm[g] == NEG_INF ? 0.f : expf(sm[g] - mn);
                    float w[SLOTS], sum = 0.f;
#pragma unroll
                    for (int u = 0; u < SLOTS; ++u) {
                        w[u] = __shfl_sync(0xffffffffu, e, 4 * u);  // slot u's weight (lanes 4u.. hold its score)
                        sum += w[u];
                    }
                    l[g] = l[g] * alpha + sum;
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        float t = o[g][i] * alpha;
#pragma unroll
                        for (int u = 0; u < SLOTS; ++u)
                            if (seen[u]) t = fmaf(w[u], raw_at(vv[u], i), t);
                        o[g][i] = t;
                    }
                    m[g] = mn;
                }
            }
        if (jn <= p) load_v_slots<PER>(v_cache, row0 + jn * D, jn, warp, lane, p, seen_n, vv);
        j0 = jn;
        mine = mine_n;
#pragma unroll
        for (int u = 0; u < SLOTS; ++u) seen[u] = seen_n[u];
    }
    // the CTA's warps combined: per head the CTA's max and sum (run_m, run_l), then its weighted V (acc) as the sum
    // of the warps' scaled by exp(their max - the CTA's), warps CL_WARPS/2.. into red, then the others added
    __shared__ float wm[CL_WARPS][MAX_G], wl[CL_WARPS][MAX_G];
    if (lane == 0)
#pragma unroll
        for (int g = 0; g < GM; ++g)
            if (g < G) {
                wm[warp][g] = m[g];
                wl[warp][g] = l[g];
            }
    __syncthreads();
    if (threadIdx.x < G) {
        const int g = threadIdx.x;
        float mx = NEG_INF, sum = 0.f;
        for (int w = 0; w < CL_WARPS; ++w) mx = fmaxf(mx, wm[w][g]);
        for (int w = 0; w < CL_WARPS; ++w) sum += wm[w][g] == NEG_INF ? 0.f : wl[w][g] * expf(wm[w][g] - mx);
        run_m[g] = mx;
        run_l[g] = sum;
    }
    __syncthreads();
    for (int half = 1; half >= 0; --half) {
        if ((warp >= CL_WARPS / 2) == (half == 1)) {
            float* dst = red + (warp % (CL_WARPS / 2)) * GD;
#pragma unroll
            for (int g = 0; g < GM; ++g)
                if (g < G) {
                    const float f = m[g] == NEG_INF ? 0.f : expf(m[g] - run_m[g]);
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        float* at = dst + g * D + lane * PER + i;
                        *at = half ? o[g][i] * f : fmaf(o[g][i], f, *at);
                    }
                }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < GD; e += blockDim.x) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < CL_WARPS / 2; ++w) t += red[w * GD + e];
        acc[e] = t;
    }

    // rank 0 combines the CL partials: o = sum_k acc_k exp(m_k - M) / sum_k l_k exp(m_k - M)
    __syncthreads();
    cluster_sync();
    if (r == 0) {
        for (int g = warp; g < G; g += CL_WARPS) {
            const float mk = lane < CL ? ld_cluster_f32(smem_addr(run_m + g), lane) : NEG_INF;
            const float lk = lane < CL ? ld_cluster_f32(smem_addr(run_l + g), lane) : 0.f;
            const float m = warp_max(mk);
            const float w = mk == NEG_INF ? 0.f : expf(mk - m);
            const float l = warp_sum(lk * w);
            if (lane < CL) ew[g][lane] = w / l;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < GD; e += blockDim.x) {
            const int g = e / D;
            float o = 0.f;
#pragma unroll
            for (int k = 0; k < CL; ++k) o = fmaf(ld_cluster_f32(smem_addr(acc + e), k), ew[g][k], o);
            const u16 h = f2h(o);
            out[(head0 + g) * D + e % D] = h;
            red[e] = h2f(h);  // red is rank 0's own and free here
        }
    }
    cluster_sync();  // no CTA leaves while rank 0 still reads its shared memory
    if (r != 0 || oq.codes == nullptr) return;
    // o_proj's quantized input: this cluster's channels [hk G D, (hk + 1) G D) of row b are whole groups of gm
    __syncthreads();
    quantize_o_input<CL_WARPS>(oq, red, b, hk, hk * GD, GD, H * D, warp, lane);
#endif
}

#define DECODE_ARGS                                                                                             \
    const u16 *__restrict__ q, const u16 *__restrict__ k_cache, const u16 *__restrict__ v_cache,              \
        const long long *__restrict__ pos, const long long *__restrict__ offset, int H, int Hkv, int L, int D, \
        float scale, float *__restrict__ part_o, float *__restrict__ part_ml, int *__restrict__ ticket,         \
        u16 *__restrict__ out, signed char *__restrict__ codes, float *__restrict__ scales, int Kp, int gm,      \
        int bits, float clip, float grid, float tiny, const u16 *rq, long long ld_q, const u16 *rk,             \
        long long ld_k, const u16 *rv, long long ld_v, const u16 *cos_t, const u16 *sin_t,                     \
        const long long *rpos  // D: unused (the kernel's PER * 32), kept so every kernel takes the same arguments

// one kernel per head dimension (attention_decode_<D / 32>), so each gets the registers it needs; its head loops
// unrolled to the module's bound ATTN_GM (attention.py passes the least of attention.CL_GM that holds G), else MAX_G
#ifdef ATTN_GM
#define SPLIT_GM ATTN_GM
#else
#define SPLIT_GM MAX_G
#endif
#define KERNEL(PER)                                                                                               \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attention_decode_##PER(DECODE_ARGS) {               \
        allow_dependents(); /* the wait: in decode, after the loads that may come first */                       \
        extern __shared__ float red[];                                                                          \
        const OutQuant oq{codes, scales, Kp, gm, bits, clip, grid, tiny};                                      \
        const Rope rp{rq, ld_q, rk, ld_k, rv, ld_v, cos_t, sin_t, rpos, const_cast<u16*>(k_cache),              \
                      const_cast<u16*>(v_cache)};                                                                 \
        decode<PER, SPLIT_GM>(q, k_cache, v_cache, pos, offset, H, Hkv, L, scale, part_o, part_ml, ticket, out, red, oq,  \
                    rp);                                                                                          \
    }
// ATTN_PER (attention.py passes -DATTN_PER=<D / 32>): only that head dimension's kernels are built, so a model
// compiles its two kernels, not all sixteen (about 15 s of nvcc for sm_90a on the development VM, 2026-12-07); without
// it every head dimension (compile checks)
#define ATTN_EXPAND(M, PER) M(PER)  // ATTN_PER expanded before M pastes it into the kernel's name
#ifdef ATTN_PER
ATTN_EXPAND(KERNEL, ATTN_PER)
#else
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)
KERNEL(7)
KERNEL(8)
#endif

// the cluster form, one kernel per head dimension and bound GM on the query heads a KV head (1: MHA; 4; 8:
// attention.py picks the least that holds G), attention_decode_cl_<D / 32>_g<GM>; part_o, part_ml and ticket unused
#define KERNEL_CL(PER, GM)                                                                                        \
    extern "C" __global__ void __launch_bounds__(CL_WARPS * 32, (PER) <= 4 ? 2 : 1) attention_decode_cl_##PER##_g##GM(DECODE_ARGS) { \
        allow_dependents(); /* the wait: in decode_cluster */                                                    \
        extern __shared__ float dyn[];                                                                          \
        const OutQuant oq{codes, scales, Kp, gm, bits, clip, grid, tiny};                                      \
        const Rope rp{rq, ld_q, rk, ld_k, rv, ld_v, cos_t, sin_t, rpos, const_cast<u16*>(k_cache),              \
                      const_cast<u16*>(v_cache)};                                                                 \
        decode_cluster<PER, GM>(q, k_cache, v_cache, pos, offset, H, Hkv, L, scale, out, dyn, oq, rp);          \
    }
#define KERNELS_CL(PER) KERNEL_CL(PER, 1) KERNEL_CL(PER, 4) KERNEL_CL(PER, 8)
#define ATTN_EXPAND2(M, PER, GM) M(PER, GM)
#if defined(ATTN_PER) && defined(ATTN_GM)  // attention.py: the model's head dimension and bound, one kernel a form
ATTN_EXPAND2(KERNEL_CL, ATTN_PER, ATTN_GM)
#elif defined(ATTN_PER)
ATTN_EXPAND(KERNELS_CL, ATTN_PER)
#else
KERNELS_CL(1)
KERNELS_CL(2)
KERNELS_CL(3)
KERNELS_CL(4)
KERNELS_CL(5)
KERNELS_CL(6)
KERNELS_CL(7)
KERNELS_CL(8)
#endif
