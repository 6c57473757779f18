// Tiled-CBC spMspV (decode, N = 1) on CUDA cores with dynamic pruning (SPDP, HAD-SMBD): tcbc_spmspv2 (v2,
// described further down). The first kernel (v1: a compacted list of active columns, one cp.async + wait per
// column) is gone; docs/kernels.md keeps its figures. What v2 keeps of it:
//  - HAD-SMBD: lane l owns rows 8l..8l+7 = byte (l & 7) of bitmap word l >> 3. Its first value's rank
//    is the masked popcount of the bits below it; the next set bits take rank+1, rank+2, ... so one
//    popcount serves all 8 rows. fp32 FMA into 8 register accumulators.
//  - Warps reduce through shared memory; with split-K each block writes an fp32 partial row and the
//    last block of the GTile row (atomic ticket) sums the partials in split order (deterministic) and
//    writes the output, then resets its ticket for the next launch.
// Values: BITS = 16 (float16) or 4 / 2 (two's-complement codes, LSB-first packing) times an fp16 group
// scale read from scales_t [ngroups, Mp] (the [M, ngroups] scales transposed once on the host).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
// v2's copies on sm_90: cp.async.bulk (the TMA engine) completing on one mbarrier per ring slot; before sm_90,
// or with -DTCBC_BULK=0, 16-byte cp.async by every lane in commit groups.
#ifndef TCBC_BULK
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TCBC_BULK 1
#else
#define TCBC_BULK 0
#endif
#endif
// TCBC_WHOLE=1 (study build, sm_90 copies, b-bit codes): a GTile with any active column is copied whole (its 16
// bitmaps and every value, inactive columns' too) by two bulk copies of one lane, instead of two a run of active
// columns issued lane by lane: more bytes, fewer instructions (the 4-bit kernel is issue-bound, docs/kernels.md)
#ifndef TCBC_WHOLE
#define TCBC_WHOLE 0
#endif
#if TCBC_BULK
__device__ __forceinline__ void mbar_init(u32 bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar)); }
__device__ __forceinline__ void mbar_expect_arrive(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}"
                 ::"r"(bar), "r"(parity) : "memory");
}
// two bulk copies on one mbarrier, in one asm statement: issued from divergent lanes, the copy's operands go
// through uniform registers one lane at a time, and one statement makes that one loop for both copies
__device__ __forceinline__ void bulk_copy2(u32 dst0, const void* src0, u32 bytes0, u32 dst1, const void* src1,
                                           u32 bytes1, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%6];\n"
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%3], [%4], %5, [%6];"
                 ::"r"(dst0), "l"(src0), "r"(bytes0), "r"(dst1), "l"(src1), "r"(bytes1), "r"(bar) : "memory");
}
#endif
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

#define TILE_M 256
#define TILE_K 16

template <int BITS>
struct Slot {
    static constexpr int VAL_BYTES = TILE_M * BITS / 8;  // a full column, already a multiple of 16
    static constexpr int BYTES = VAL_BYTES + 32;          // + 4 bitmap words
};

template <int BITS>
__device__ __forceinline__ float code_at(const unsigned char* v, int i) {
    if (BITS == 16) return h2f(reinterpret_cast<const u16*>(v)[i]);
    const int per = BITS == 16 ? 1 : 8 / BITS;
    int c = (v[i / per] >> ((i % per) * BITS)) & ((1 << BITS) - 1);
    const int half = 1 << (BITS - 1);
    return (float)((c ^ half) - half);
}

// b-bit codes to float on the FMA pipe, not the quarter-rate integer-to-float unit (sm_90: I2FP runs at 16 per
// clock per SM, FADD at 128). `win` holds codes in offset binary (each code's top bit flipped: q + 2^(b-1)),
// the next code in its top b bits; shifted down and added to the bits of 2^23 it makes the float
// 2^23 + q + 2^(b-1) exactly, and one FADD leaves q. Shift and add are one LEA.HI with an immediate (a
// funnel shift would need the exponent in a register, which the compiler re-materializes per row).
template <int BITS>
__device__ __forceinline__ float top_code_to_float(u32 win) {
    return __uint_as_float((win >> (32 - BITS)) + 0x4B000000u) - (8388608.f + (float)(1 << (BITS - 1)));
}
// every code's top bit, for the offset-binary window above
template <int BITS>
__device__ __forceinline__ constexpr u32 code_flip() {
    return BITS == 4 ? 0x88888888u : 0xAAAAAAAAu;
}

// prmt.b32 as it is: the selector's nibbles used whole (__byte_perm masks them to 3 bits, two LOP3 a use here)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// MODE 4 (4-bit codes): the byte-permute selectors that scatter a lane's packed codes to its 8 rows. For bitmap byte
// b, nibble r of the entry (rows 0-3: bits 0-15, rows 4-7: bits 16-31) is the source byte, in the pair of registers
// {even codes, odd codes} that scatter8 builds, of row r's code: its rank n among the byte's set bits gives byte n / 2
// of the even register (n even) or 4 + n / 2 of the odd one; an unset row takes byte 7 (code 7), which scatter8 has
// set to the offset-binary zero since such a byte holds at most 7 codes.
__device__ __forceinline__ u32 scatter_selectors(u32 b) {
    u32 e = 0u, n = 0u;
    for (int r = 0; r < 8; ++r) {
        u32 idx = 7u;
        if ((b >> r) & 1u) {
            idx = (n & 1u) ? 4u + (n >> 1) : n >> 1;
            ++n;
        }
        e |= idx << (4 * r);
    }
    return e;
}

// MODE 4: q x of one lane's 8 rows of one column into q[0..7], no predicate per row. `v` holds the lane's c codes
// in its low nibbles (row order, two's complement), `sel` the selectors of its bitmap byte. The codes beyond c are
// cleared and every code's top bit flipped (offset binary: an absent row reads 8, the code 0); the even and odd
// codes go to the bytes of two registers, two byte permutes put row r's code in byte r & 3 of r0 / r1, and per row
// one byte permute with the bits of 2^23 makes the float 2^23 + q + 8 exactly (top_code_to_float's trick), one FADD
// leaves q, one FFMA adds q x: 3 instructions a row against mode 0's 4 under predicates plus their tests.
__device__ __forceinline__ void scatter8(u32 v, u32 c, u32 sel, float x, float* q) {
    const u32 keep = __funnelshift_lc(0u, 0xFFFFFFFFu, 4u * c);  // the low 4c bits (c = 8: all)
    const u32 t = (v & keep) ^ 0x88888888u;
    const u32 ev = t & 0x0F0F0F0Fu, od = (t >> 4) & 0x0F0F0F0Fu;
    const u32 r0 = prmt(ev, od, sel), r1 = prmt(ev, od, sel >> 16);  // selector nibbles < 8: no sign replication
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const u32 bits = __byte_perm(r < 4 ? r0 : r1, 0x4B000000u, 0x7540u | (u32)(r & 3));
        q[r] = fmaf(__uint_as_float(bits) - 8388616.f, x, q[r]);
    }
}

// The reduction: the NW warps' accumulators (lane l: rows 8l..8l+7 of GTile row tr, for each of the NR input
// rows) are summed through `red` (shared, NR * NW * TILE_M floats, free to reuse: the caller has synchronized the
// block). When the block is the row's only part it writes the output [NR, M] directly; otherwise it writes its fp32
// partial rows as part `part` of `nparts` (partial [nparts][NR][Mp]), and the last part to finish (atomic ticket,
// `last_s` a __shared__ int) sums the partials in part order (deterministic), writes the output and resets its
// ticket for the next launch. Input rows n >= nrows are not written.
template <int NW, int NR>
__device__ __forceinline__ void reduce_store(const float (&acc)[NR][8], float* red, int& last_s, int M, int Mp,
                                             float* __restrict__ partial, u32* __restrict__ tickets,
                                             void* __restrict__ out, int out_f32, int tr, int part, int nparts,
                                             int nrows) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
        for (int r = 0; r < 8; ++r) red[(n * NW + warp) * TILE_M + lane * 8 + r] = acc[n][r];
    __syncthreads();
    const bool single = nparts == 1;
    for (int i = tid; i < NR * TILE_M; i += NW * 32) {
        const int n = (int)((unsigned)i / TILE_M), r = i - n * TILE_M;  // i >= 0: a shift
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) v += red[(n * NW + w) * TILE_M + r];
        const int row = tr * TILE_M + r;
        if (single) {
            if (row < M && (NR == 1 || n < nrows)) {
                if (out_f32) reinterpret_cast<float*>(out)[(size_t)n * M + row] = v;
                else reinterpret_cast<u16*>(out)[(size_t)n * M + row] = f2h(v);
            }
        } else {
            partial[((size_t)part * NR + n) * Mp + row] = v;
        }
    }
    if (single) return;
    __threadfence();
    __syncthreads();
    if (tid == 0) last_s = atomicAdd(&tickets[tr], 1u) == (u32)nparts - 1u;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    for (int i = tid; i < NR * TILE_M; i += NW * 32) {
        const int n = (int)((unsigned)i / TILE_M), r = i - n * TILE_M;  // i >= 0: a shift
        const int row = tr * TILE_M + r;
        float v = 0.f;
        for (int s = 0; s < nparts; ++s) v += ld_cg(partial + ((size_t)s * NR + n) * Mp + row);
        if (row < M && (NR == 1 || n < nrows)) {
            if (out_f32) reinterpret_cast<float*>(out)[(size_t)n * M + row] = v;
            else reinterpret_cast<u16*>(out)[(size_t)n * M + row] = f2h(v);
        }
    }
    if (tid == 0) tickets[tr] = 0u;
}

// ---------------------------------------------------------------------------------------------------
// v2: a warp per GTile, one cp.async batch (one commit, one wait) per GTile, D GTiles in flight per warp.
//
// Block = NW warps = one GTile row x a chunk of GTiles along K (split-K), or, with `streamk`, an
// equal share of all GTiles in row-major order, run as one segment per GTile row it meets (see the
// kernel); warp w takes the segment's GTiles w, w + NW, ... Each warp owns a ring of D slots, one GTile per
// slot:
//   [0, 512)      the 16 column bitmaps (32 B each, by column index; inactive columns are not copied)
//   [512, 768)    the compacted active-column list, one 16-B entry per active column c: {x_k (f32 bits),
//                 32 c (its bitmap's offset in the slot), 32 c | 16-B chunks << 16, start in bytes (of its
//                 run in the GTile)}; fields pre-scaled so that the decode spends no instruction on them
//   [768, 1280)   BITS < 16 only: the lane's 8 group scales (16 B per lane, one group per GTile)
//   [VOFF, ...)   the GTile's values at their in-GTile offsets (only active columns' runs are copied)
// Issue (GTile j + D - 1, metadata loaded one GTile earlier into registers): lanes 0..15 test their
// column (|x_k| > tau, nnz > 0), a ballot + popcount compacts the active ones into the list. sm_90: the lane
// of the first column of each run of consecutive active columns issues two bulk copies (the run's bitmaps,
// its values: consecutive columns' value runs are adjacent), after lane 0 has set the slot's mbarrier to
// expect their bytes (a warp sum); about 4 runs per GTile at 30% dynamic sparsity. Before sm_90: lane l
// copies bitmap chunk l (16 B) if its column is active, then 32 lanes copy the active runs, 32 / (2 BITS)
// columns per pass (fp16: a full 256-row column is exactly 32 x 16 B), one commit group per GTile.
// Decode (GTile j, after one wait + __syncwarp): lane l loads bitmap chunk l, popcounts its 4 words and
// packs the column's prefix popcounts of u32 words 4h..4h+3 into one register (bytes); per active column
// a lane then needs one shuffle (prefix of its bitmap word) + one LDS.32 (its word) + one popcount for
// its rank, then <= 8 predicated value loads + FMA. No division in the loops; no block barrier until the end.
template <int BITS, int NR = 1>
struct Hdr {
    static constexpr int LIST = 512;
    static constexpr int SCL = 768;
    static constexpr int XL = BITS == 16 ? 768 : 1280;      // NR > 1: each list entry's NR masked inputs (floats)
    static constexpr int VOFF = XL + (NR > 1 ? 64 * NR : 0);  // mirrors v2_slot_bytes() in tiled_cbc_spmspv.py
    static constexpr int MAXCH = 2 * BITS;  // 16-byte chunks of a full 256-row column
};

__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// MODE 0: per set bit one predicated 2-byte LDS or code (8 per lane and column). MODE 3 (fp16): as MODE 0 but
// two columns per pass, a half-warp per column and 16 rows per lane. (MODE 2, a wide decode of two 16-byte LDS and
// register shifts, was slower and is gone: docs/kernels.md, "Tried and rejected".)
//
// NR > 1 (MODE 0): nrows <= NR input rows at once (x [nrows, ldx], out [nrows, M]; a batched decode step), each
// with its own threshold rule: row n's input k counts iff |x_nk| > tau. A column is read once if it is active in
// ANY row (the union), and each row multiplies it by its own masked input (0 where |x_nk| <= tau), so row n's sums
// are those of its own spMspV. The list entry of an active column is followed (region XL) by its NR masked inputs;
// b-bit codes are scaled per value (code * scale, as the CPU reference forms its weights) instead of per GTile,
// which keeps one accumulator per (row, input row) instead of two.
template <int BITS, int NW, int D, int MODE = 0, int NR = 1>
__global__ void __launch_bounds__(NW * 32, MODE == 4 ? 7 : 0) tcbc_spmspv2(
    const u64* __restrict__ bitmap, const u32* __restrict__ colinfo, const u32* __restrict__ tile_offset,
    const unsigned char* __restrict__ values, const u16* __restrict__ x, float tau,
    const u16* __restrict__ scales_t, int group, int grid_c, int M, int K, int Mp, int chunk, int slot_bytes,
    int streamk, float* __restrict__ partial, u32* __restrict__ tickets, void* __restrict__ out, int out_f32,
    int nrows, int ldx) {
    static_assert(NR == 1 || MODE == 0, "several input rows: MODE 0 only");
    static_assert(MODE != 4 || BITS == 4, "MODE 4: 4-bit codes only");
    using H = Hdr<BITS, NR>;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int nact[NW][D];
    __shared__ int last_s;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if TCBC_BULK
    __shared__ __align__(8) u64 mbar[NW][D];  // one per ring slot; slot s's phase parity is bit s of `ph`
    const u32 bar0 = smem_addr(&mbar[warp][0]);
    u32 ph = 0u;
    if (lane == 0) {
        for (int s = 0; s < D; ++s) mbar_init(bar0 + 8 * s);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
#endif
    // MODE 4: scatter_selectors of every bitmap byte, after the ring and the reduction's floats (the host adds
    // SEL_TABLE_BYTES to the dynamic shared memory), made once per block
    u32* const sel_tab = reinterpret_cast<u32*>(smem + max(NW * D * slot_bytes, NR * NW * TILE_M * 4));
    if (MODE == 4) {
        for (int i = tid; i < 256; i += NW * 32) sel_tab[i] = scatter_selectors((u32)i);
        __syncthreads();
    }
    // The block's GTiles in the row-major order of the GTile grid: split-K, one row's chunk blockIdx.x of
    // `chunk` GTiles (grid splits x rows); stream-K (`streamk` != 0, a 1-D grid of B blocks), the equal share
    // [b T / B, (b + 1) T / B) of all T GTiles, which may start and end inside rows. Each row the range meets
    // is one segment, reduced as part `part` of the row's `nparts` (the blocks whose share meets the row).
    const long long T = (long long)(Mp / TILE_M) * grid_c, B = gridDim.x;  // T < 2^31 GTiles
    int f, fend;
    if (streamk) {
        f = (int)(blockIdx.x * T / B);
        fend = (int)((blockIdx.x + 1) * T / B);
    } else {
        f = blockIdx.y * grid_c + blockIdx.x * chunk;
        fend = f + min(chunk, grid_c - (int)blockIdx.x * chunk);
    }
    for (bool first_seg = true; f < fend; first_seg = false) {
        const int tr = f / grid_c;
        const int c0 = f - tr * grid_c;
        const int nct = min(fend, (tr + 1) * grid_c) - f;
        f += nct;
        int part = blockIdx.x, nparts = gridDim.x;
        if (streamk) {  // owner(g) = ((g + 1) B - 1) / T, the block whose share holds GTile g
            const int first = (int)((((long long)tr * grid_c + 1) * B - 1) / T);
            part -= first;
            nparts = (int)((((long long)tr + 1) * grid_c * B - 1) / T) - first + 1;
        }
        if (!first_seg) __syncthreads();  // the previous segment's reduction has left the shared memory
        const int mine = nct > warp ? (nct - warp + NW - 1) / NW : 0;
        unsigned char* ring = smem + warp * D * slot_bytes;
        const int row0 = tr * TILE_M + lane * 8;

        // metadata of the next GTile to issue (registers, loaded one GTile ahead)
        u32 m_ci = 0u, m_toff = 0u;
        u16 m_x[NR];
#pragma unroll
        for (int n = 0; n < NR; ++n) m_x[n] = 0;
        uint4 m_sc = make_uint4(0u, 0u, 0u, 0u);
        auto load_meta = [&](int j) {
            m_ci = 0u;
            if (j < mine) {
                const int gtc = c0 + warp + j * NW, gt = tr * grid_c + gtc;
                if (lane < TILE_K) {
                    const int k = gtc * TILE_K + lane;
                    m_ci = colinfo[gt * TILE_K + lane];
#pragma unroll
                    for (int n = 0; n < NR; ++n) m_x[n] = k < K && (NR == 1 || n < nrows) ? x[(size_t)n * ldx + k] : (u16)0;
                } else if (lane == TILE_K) {
                    m_toff = tile_offset[gt];
                }
                if (BITS != 16)
                    m_sc = *reinterpret_cast<const uint4*>(scales_t + (size_t)((gtc * TILE_K) / group) * Mp + row0);
            }
        };
        auto issue = [&](int j) {
            if (j < mine) {
                unsigned char* slot = ring + (j % D) * slot_bytes;
                const int gt = tr * grid_c + c0 + warp + j * NW;
                float xm[NR];  // the masked inputs: x where |x| > tau, else 0 (one row: x, the column is active)
                bool any = false;
#pragma unroll
                for (int n = 0; n < NR; ++n) {
                    const float xf = h2f(m_x[n]);
                    const bool on = fabsf(xf) > tau;
                    any |= on;
                    xm[n] = NR == 1 || on ? xf : 0.f;
                }
                const u32 nnz = m_ci & 0xFFFFu;
                const bool act = lane < TILE_K && nnz != 0u && any;
                const u32 b = __ballot_sync(0xFFFFFFFFu, act);
                const u32 toff = __shfl_sync(0xFFFFFFFFu, m_toff, TILE_K);
                if (act) {
                    const int p = __popc(b & ((1u << lane) - 1u));
                    const u32 start = m_ci >> 16, c32 = 32u * (u32)lane;
                    *reinterpret_cast<uint4*>(slot + H::LIST + 16 * p) =
                        make_uint4(__float_as_uint(xm[0]), c32, c32 | ((nnz * BITS + 127u) >> 7) << 16, start * BITS / 8);
                    if (NR > 1) {
                        float* xl = reinterpret_cast<float*>(slot + H::XL) + NR * p;
#pragma unroll
                        for (int n = 0; n < NR; ++n) xl[n] = xm[n];
                    }
                }
                if (BITS != 16) *reinterpret_cast<uint4*>(slot + H::SCL + 16 * lane) = m_sc;
                if (lane == 0) nact[warp][j % D] = __popc(b);
#if TCBC_BULK
                // lane c heads a run if column c is active and c - 1 is not; the run is its L consecutive active
                // columns, whose values end where the last one's 16-byte chunks end
                const u32 sb = (m_ci >> 16) * BITS / 8, endb = sb + 16u * ((nnz * BITS + 127u) >> 7);
#if TCBC_WHOLE
                if (BITS != 16) {  // study build: the GTile's 16 bitmaps and all its values, two copies by lane 0
                    const u32 vall = __shfl_sync(0xFFFFFFFFu, endb, TILE_K - 1), bar = bar0 + 8 * (j % D);
                    if (lane == 0) {
                        mbar_expect_arrive(bar, b ? 32u * TILE_K + vall : 0u);
                        if (b)
                            bulk_copy2(smem_addr(slot), bitmap + (size_t)gt * (TILE_K * 4), 32u * TILE_K,
                                       smem_addr(slot + H::VOFF), values + (size_t)toff * BITS / 8, vall, bar);
                    }
                    __syncwarp();
                    return;
                }
#endif
                const int L = __ffs(~(b >> lane)) - 1;
                const u32 rend = __shfl_sync(0xFFFFFFFFu, endb, (lane + L - 1) & 31);
                const bool head = act && !(((b << 1) >> lane) & 1u);
                const u32 vb = head ? rend - sb : 0u, bb = head ? 32u * (u32)L : 0u;
                const u32 bar = bar0 + 8 * (j % D);
                const u32 tot = __reduce_add_sync(0xFFFFFFFFu, vb + bb);
                if (lane == 0) mbar_expect_arrive(bar, tot);
                __syncwarp();
                if (head)
                    bulk_copy2(smem_addr(slot) + 32u * lane, bitmap + (size_t)gt * (TILE_K * 4) + 4 * lane, bb,
                               smem_addr(slot + H::VOFF) + sb, values + (size_t)toff * BITS / 8 + sb, vb, bar);
            }
#else
                if ((b >> (lane >> 1)) & 1u)
                    cp_async16(slot + 16 * lane, bitmap + (size_t)gt * (TILE_K * 4) + 2 * lane);
                __syncwarp();
                const int n = __popc(b);
                constexpr int CPP = 32 / H::MAXCH;
                const int sub = lane / H::MAXCH, jj = lane % H::MAXCH;
                // lane jj of sub-group sub copies 16-byte chunk jj of the sub-group's columns: the addresses of
                // chunk jj of the GTile are formed once, a column adds its run's byte offset (one 8-byte LDS of
                // {32 c | chunks << 16, byte offset}; jj < chunks <=> (jj + 1) << 16 <= that word)
                const unsigned char* src = values + (size_t)toff * BITS / 8 + 16 * jj;
                const u32 dst = smem_addr(slot + H::VOFF) + 16 * jj, need = (u32)(jj + 1) << 16;
                for (int i = sub; i < n; i += CPP) {
                    const uint2 e = *reinterpret_cast<const uint2*>(slot + H::LIST + 16 * i + 8);  // 8-aligned
                    if (need <= e.x)
                        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + e.y), "l"(src + e.y));
                }
            }
            cp_commit();
#endif
        };

        float acc[NR][8], acc16[16];  // acc16: MODE 3's and 4's 16 rows per lane
#pragma unroll
        for (int n = 0; n < NR; ++n)
#pragma unroll
            for (int r = 0; r < 8; ++r) acc[n][r] = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r) acc16[r] = 0.f;
        // per lane: rows 8 lane .. 8 lane + 7 = byte lane & 3 of u32 word lane >> 2 of a column's bitmap, whose
        // prefix popcount is byte (lane >> 2) & 3 of the P of lane 2 c + (lane >> 4)
        const int src_h = lane >> 4, sh = 8 * (lane & 3);
        const u32 below = (1u << sh) - 1u, bsel = 0x4440u | ((u32)(lane >> 2) & 3u);

        load_meta(0);
#pragma unroll
        for (int j = 0; j < D - 1; ++j) {
            issue(j);
            load_meta(j + 1);
        }
        for (int j = 0; j < mine; ++j) {
            issue(j + D - 1);
            load_meta(j + D);
#if TCBC_BULK
            mbar_wait(bar0 + 8 * (j % D), (ph >> (j % D)) & 1u);
            ph ^= 1u << (j % D);
#else
            cp_wait<D - 1>();
#endif
            __syncwarp();
            const unsigned char* slot = ring + (j % D) * slot_bytes;
            const int n = nact[warp][j % D];
            // prefix popcounts of this lane's bitmap chunk (column lane >> 1, u32 words 4h..4h+3)
            const uint4 q = lds128(slot + 16 * lane);
            const u32 a0 = __popc(q.x), a1 = __popc(q.y), a2 = __popc(q.z), a3 = __popc(q.w);
            const u32 tp = __shfl_xor_sync(0xFFFFFFFFu, a0 + a1 + a2 + a3, 1);
            const u32 P = ((lane & 1) ? tp : 0u) * 0x01010101u + (a0 << 8) + ((a0 + a1) << 16) + ((a0 + a1 + a2) << 24);
            float accq[8];  // b-bit codes: sums of q x over this GTile (one scale group), scaled at its end
#pragma unroll
            for (int r = 0; r < 8; ++r) accq[r] = 0.f;
            const unsigned char* bm = slot + 4 * (lane >> 2);
            // unroll 1: unrolled twice, the compiler routed the predicated FMAs of the first copy through
            // moves (64 instead of 59 SASS instructions per column)
            const unsigned char* const list = slot + H::LIST;
            if (BITS == 4 && MODE == 4) {
                // MODE 3's layout for 4-bit codes: half-warp hh takes list entry 2 i + hh, lane p = lane & 15 of it
                // rows 16 p .. 16 p + 15 (bytes 2 (p & 1), + 1 of u32 word p >> 1); its 16 codes are one 64-bit
                // window from its first code's nibble, and each byte's 8 rows are scattered by scatter8 (no per-row
                // predicate); q x is summed per GTile (one scale group) and scaled at its end (the lane's 16 rows'
                // scales are those of lanes 2 p and 2 p + 1)
                const int hh = lane >> 4, p = lane & 15;
                const u32 bsel3 = 0x4440u | ((u32)(p >> 1) & 3u), sh16 = 16u * (u32)(p & 1);
                const u32 below16 = (p & 1) ? 0xFFFFu : 0u;
                const unsigned char* bm3 = slot + 4 * (p >> 1);
                const u32* vw = reinterpret_cast<const u32*>(slot + H::VOFF);
                float q16[16];
#pragma unroll
                for (int r = 0; r < 16; ++r) q16[r] = 0.f;
#pragma unroll 1
                for (int o = 0; o < 16 * n; o += 32) {
                    const bool ok = o + 16 * hh < 16 * n;
                    const uint4 e = lds128(list + (ok ? o + 16 * hh : 0));
                    const u32 pc = __shfl_sync(0xFFFFFFFFu, P, (int)((e.z >> 4) + (u32)(p >> 3)));
                    const u32 w32 = *reinterpret_cast<const u32*>(bm3 + e.y);
                    const u32 rank = __byte_perm(pc, 0u, bsel3) + (u32)__popc(w32 & below16);
                    const u32 bits = ok ? (w32 >> sh16) & 0xFFFFu : 0u;  // no column: every row absent
                    const u32 b0 = bits & 0xFFu, b1 = bits >> 8, c0 = (u32)__popc(b0);
                    const u32 s = e.w * 2u + rank;  // the nibble of the lane's first code
                    const u32* wp = vw + (s >> 3);
                    const u32 sh = (s & 7u) * 4u;
                    const u32 lo = __funnelshift_r(wp[0], wp[1], sh), hi = __funnelshift_r(wp[1], wp[2], sh);
                    scatter8(lo, c0, sel_tab[b0], __uint_as_float(e.x), q16);
                    scatter8(__funnelshift_rc(lo, hi, 4u * c0), (u32)__popc(b1), sel_tab[b1], __uint_as_float(e.x),
                             q16 + 8);
                }
                const uint4 s0 = lds128(slot + H::SCL + 32 * p), s1 = lds128(slot + H::SCL + 32 * p + 16);
                const u32 sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    acc16[2 * t] = fmaf(q16[2 * t], h2f((u16)(sw[t] & 0xFFFFu)), acc16[2 * t]);
                    acc16[2 * t + 1] = fmaf(q16[2 * t + 1], h2f((u16)(sw[t] >> 16)), acc16[2 * t + 1]);
                }
                __syncwarp();
                continue;  // next GTile
            }
            if (BITS == 16 && MODE == 3) {
                // two columns per pass: half-warp hh takes list entry 2 i + hh, lane p = lane & 15 of it rows
                // 16 p .. 16 p + 15 = half p & 1 of u32 word p >> 1 (prefix: byte (p >> 1) & 3 of the P of lane
                // 2 c + (p >> 3)). The per-column work (entry, shuffle, word, rank) is paid once per 16 rows
                // instead of 8; a half without a column in the last pass shuffles along with its bits cleared.
                const int hh = lane >> 4, p = lane & 15;
                const u32 bsel3 = 0x4440u | ((u32)(p >> 1) & 3u), sh16 = 16u * (u32)(p & 1);
                const u32 below16 = (p & 1) ? 0xFFFFu : 0u;
                const unsigned char* bm3 = slot + 4 * (p >> 1);
#pragma unroll 1
                for (int o = 0; o < 16 * n; o += 32) {
                    const bool ok = o + 16 * hh < 16 * n;
                    const uint4 e = lds128(list + (ok ? o + 16 * hh : 0));
                    const float xk = __uint_as_float(e.x);
                    const u32 pc = __shfl_sync(0xFFFFFFFFu, P, (int)((e.z >> 4) + (u32)(p >> 3)));
                    const u32 w32 = *reinterpret_cast<const u32*>(bm3 + e.y);
                    const int rank = (int)__byte_perm(pc, 0u, bsel3) + __popc(w32 & below16);
                    const u32 bits = ok ? (w32 >> sh16) & 0xFFFFu : 0u;
                    const u16* v = reinterpret_cast<const u16*>(slot + H::VOFF + e.w) + rank;
#pragma unroll
                    for (int r = 0; r < 16; ++r) {
                        if (bits & (1u << r)) {
                            acc16[r] = fmaf(h2f(*v), xk, acc16[r]);
                            ++v;
                        }
                    }
                }
                __syncwarp();
                continue;  // next GTile
            }
            float sc[8];  // NR > 1, b-bit codes: the lane's 8 rows' group scales, applied per value
            if (NR > 1 && BITS != 16) {
                const uint4 s4 = lds128(slot + H::SCL + 16 * lane);
                const u32 sw[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    sc[2 * t] = h2f((u16)(sw[t] & 0xFFFFu));
                    sc[2 * t + 1] = h2f((u16)(sw[t] >> 16));
                }
            }
#pragma unroll 1
            for (int o = 0; o < 16 * n; o += 16) {
                const uint4 e = lds128(list + o);
                float xk[NR];  // the column's (masked) input of each input row
                if constexpr (NR == 1) {
                    xk[0] = __uint_as_float(e.x);
                } else if constexpr (NR % 4 == 0) {
                    const float4* xl = reinterpret_cast<const float4*>(slot + H::XL) + (NR / 4) * (o >> 4);
#pragma unroll
                    for (int i = 0; i < NR / 4; ++i) {
                        const float4 f4 = xl[i];
                        xk[4 * i] = f4.x;
                        xk[4 * i + 1] = f4.y;
                        xk[4 * i + 2] = f4.z;
                        xk[4 * i + 3] = f4.w;
                    }
                } else {
                    const float* xl = reinterpret_cast<const float*>(slot + H::XL) + NR * (o >> 4);
#pragma unroll
                    for (int i = 0; i < NR; ++i) xk[i] = xl[i];
                }
                // e.z >> 4 = 2 c | chunks << 12: shfl.idx reads the source lane from bits 4:0 alone (PTX ISA)
                const u32 pc = __shfl_sync(0xFFFFFFFFu, P, (int)((e.z >> 4) + (u32)src_h));
                const u32 w32 = *reinterpret_cast<const u32*>(bm + e.y);
                const int rank = (int)__byte_perm(pc, 0u, bsel) + __popc(w32 & below);
                const u32 byte = (w32 >> sh) & 0xFFu;
                if (BITS == 16) {
                    const u16* v = reinterpret_cast<const u16*>(slot + H::VOFF + e.w) + rank;
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        if (byte & (1u << r)) {
                            const float w = h2f(*v);
#pragma unroll
                            for (int i = 0; i < NR; ++i) acc[i][r] = fmaf(w, xk[i], acc[i][r]);
                            ++v;
                        }
                    }
                } else {
                    constexpr int PER = 32 / BITS;
                    const u32* vw = reinterpret_cast<const u32*>(slot + H::VOFF);
                    // a 32-bit window of codes ending at the lane's last one (end - 1; packing is LSB first, so it
                    // sits in the top bits): rows are taken last first, each code read off the top (fewer
                    // instructions per row than from the bottom) and converted on the FMA pipe
                    // (top_code_to_float); q x is summed per GTile (one scale group) and scaled once after its
                    // last column. Unsigned: / and % by PER are shifts; word end / PER - 1 may be -1, the
                    // scales' last word (bits below the lane's codes).
                    const u32 end = e.w * 8u / BITS + (u32)rank + (u32)__popc(byte);
                    const u32* wp = vw + end / PER;
                    u32 win = __funnelshift_r(wp[-1], wp[0], (end % PER) * BITS) ^ code_flip<BITS>();
#pragma unroll
                    for (int r = 7; r >= 0; --r) {
                        if (byte & (1u << r)) {
                            if constexpr (NR == 1) {
                                accq[r] = fmaf(top_code_to_float<BITS>(win), xk[0], accq[r]);
                            } else {
                                const float w = top_code_to_float<BITS>(win) * sc[r];  // exact: b-bit code x fp16
#pragma unroll
                                for (int i = 0; i < NR; ++i) acc[i][r] = fmaf(w, xk[i], acc[i][r]);
                            }
                            win <<= BITS;
                        }
                    }
                }
            }
            if (NR == 1 && BITS != 16 && MODE == 0) {  // the lane's 8 rows' group scales
                const uint4 s4 = lds128(slot + H::SCL + 16 * lane);
                const u32 sw[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    acc[0][2 * t] = fmaf(accq[2 * t], h2f((u16)(sw[t] & 0xFFFFu)), acc[0][2 * t]);
                    acc[0][2 * t + 1] = fmaf(accq[2 * t + 1], h2f((u16)(sw[t] >> 16)), acc[0][2 * t + 1]);
                }
            }
            __syncwarp();  // all lanes are done with this slot before a later issue overwrites it
        }
#if !TCBC_BULK
        cp_wait<0>();
#endif
        if (MODE == 3 || MODE == 4) {  // the halves' sums of rows 16 p .. 16 p + 15, then lane l takes rows 8 l .. 8 l + 7
#pragma unroll
            for (int r = 0; r < 16; ++r) acc16[r] += __shfl_xor_sync(0xFFFFFFFFu, acc16[r], 16);
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const float lo = __shfl_sync(0xFFFFFFFFu, acc16[r], lane >> 1);
                const float hi = __shfl_sync(0xFFFFFFFFu, acc16[8 + r], lane >> 1);
                acc[0][r] = (lane & 1) ? hi : lo;
            }
        }
        __syncthreads();

        // reduce warps, then the row's parts (the host sizes smem for the NR * NW * 256-float reduction)
        reduce_store<NW, NR>(acc, reinterpret_cast<float*>(smem), last_s, M, Mp, partial, tickets, out, out_f32, tr,
                             part, nparts, nrows);
    }  // segments
}

// explicit instantiations (compile checks with nvcc; CuPy uses name_expressions)
#define TCBC2R(B, W, S, MODE, NR)                                                                               \
    template __global__ void tcbc_spmspv2<B, W, S, MODE, NR>(const u64*, const u32*, const u32*,                   \
                                                             const unsigned char*, const u16*, float, const u16*,  \
                                                             int, int, int, int, int, int, int, int, float*,       \
                                                             u32*, void*, int, int, int);
#define TCBC2(B, W, S, MODE) TCBC2R(B, W, S, MODE, 1)
// TCBC_BITS (tiled_cbc_spmspv.py passes -DTCBC_BITS=<16, 4 or 2>): only that value type's kernels are built, so a
// layer compiles its own (a first decode step on a fresh machine; docs/kernels.md, "Compile time")
// Several input rows (a batched decode step): 2, 4 and 8 rows with each value type's default (warps, stages).
#if !defined(TCBC_BITS) || TCBC_BITS == 16
TCBC2(16, 4, 2, 0)
TCBC2(16, 4, 3, 0)
TCBC2(16, 8, 2, 0)
TCBC2(16, 4, 2, 3)
TCBC2(16, 4, 3, 3)
TCBC2(16, 8, 2, 3)
TCBC2R(16, 4, 2, 0, 2)
TCBC2R(16, 4, 2, 0, 4)
TCBC2R(16, 4, 2, 0, 8)
#endif
#if !defined(TCBC_BITS) || TCBC_BITS == 4
TCBC2(4, 4, 3, 0)
TCBC2(4, 4, 3, 4)
TCBC2R(4, 4, 3, 0, 2)
TCBC2R(4, 4, 3, 0, 4)
TCBC2R(4, 4, 3, 0, 8)
#endif
#if !defined(TCBC_BITS) || TCBC_BITS == 2
TCBC2(2, 4, 3, 0)
TCBC2R(2, 4, 3, 0, 2)
TCBC2R(2, 4, 3, 0, 4)
TCBC2R(2, 4, 3, 0, 8)
#endif
