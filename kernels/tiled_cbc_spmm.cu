// Tiled-CBC SpMM (prefill): Y[N, M] = X[N, K] . W^T on tensor cores (fp16 in, fp32 accumulate, fp16 out), from
// the same arrays as the spMspV kernel (float16 values). The kernels the launcher (tiled_cbc_spmm.py) picks from:
// tcbc_spmm3 (v3, "warp": every warp streams a quarter of a GTile row, mma.sync fragments built in registers),
// tcbc_spmm2 (v2, "fused": split-K, an NST-stage cp.async ring, decode of step t+1 beside the mma of step t),
// tcbc_decode_dense2 ("dense": decode once, then cuBLAS; tiled_cbc_decode.cu) and, on sm_90a, tcbc_spmm4 (v4, "wgmma": decode into
// shared memory, Hopper's asynchronous warpgroup MMA). Earlier generations (v1, v5) are in the git history and
// docs/kernels.md.
//
// Layout alignment (v2): each warp decodes whole columns (lane l: rows 8l..8l+7, one masked popcount, the
// next set bits take the next ranks) and writes the dense column as one 16-byte store per lane into
// At[k][m] (column-major W tile, row stride 256 + 8 halves). The transpose to the row-major A operand
// happens in ldmatrix.x4.trans; the 8-half pad puts the 8 rows an ldmatrix phase reads in 8 distinct
// 4-bank groups, so both the decode stores and the operand loads are free of bank conflicts. X is
// stored [n][k] with stride BK + 8 halves, read with ldmatrix.x4 (no transpose: the B operand is
// "col" = k-contiguous per n).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TILE_M 256
#define TILE_K 16
#define AT_STRIDE (TILE_M + 8)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[4][NT][4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
}

// Split-K end of v2 and v3, after the block wrote its fp32 partials [split][N][Mp]: the last of the nsplit blocks
// of an output tile (atomic ticket) adds the partials in split order (deterministic) for tokens n0..n0+ncol-1 and
// rows tr*256..tr*256+255, writes fp16 Y and resets the ticket for the next launch. NTH = threads per block.
template <int NTH>
__device__ __forceinline__ void split_k_finish(const float* __restrict__ partial, u32* ticket, int nsplit, int n0,
                                               int ncol, int tr, int N, int M, int Mp, u16* __restrict__ Y,
                                               int& last_s) {
    const int tid = threadIdx.x;
    __threadfence();
    __syncthreads();
    if (tid == 0) last_s = atomicAdd(ticket, 1u) == (u32)nsplit - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    for (int idx = tid; idx < ncol * TILE_M; idx += NTH) {
        const int n = n0 + idx / TILE_M, row = tr * TILE_M + idx % TILE_M;
        if (n >= N || row >= M) continue;
        float v = 0.f;
        for (int z = 0; z < nsplit; ++z) v += ld_cg(partial + ((size_t)z * N + n) * Mp + row);
        Y[(size_t)n * M + row] = f2h(v);
    }
    if (tid == 0) *ticket = 0u;
}

// Visits the warp tile's mma accumulators as f(mm, nn, acc[i][j][q]), mm the row of W and nn the token: the
// warp tile starts at (m0, n0); in each m16 x n8 tile c0,c1 -> (m = g, n = 2t, 2t+1), c2,c3 -> (m = g + 8, same
// n), g = lane >> 2, t = lane & 3 (the caller computes g and t once for all its calls).
template <int NT, typename F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[4][NT][4], int m0, int n0, int g, int t, F f) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m = m0 + i * 16 + g;
            const int n = n0 + j * 8 + 2 * t;
#pragma unroll
            for (int q = 0; q < 4; ++q) f(m + (q >> 1) * 8, n + (q & 1), acc[i][j][q]);
        }
}

// raw_bytes: bytes reserved per raw buffer (>= the largest GK-GTile value range, multiple of 16).
// Requires K % 8 == 0 (16-byte X rows); the host pads X otherwise.
// ---------------------------------------------------------------------------------------------------
// v2: split-K (deterministic, one launch), NST-stage cp.async ring with the step's metadata, and the
// decode of step t+1 in the same barrier interval as the mma of step t (one __syncthreads per step).
//
// Grid (ceil(N/BN), GTile rows, splits); a block covers `sps` steps (GK GTiles each) of its row. The
// block's TileOffsets are read once into shared memory; per step one cp.async group moves the raw
// values, the bitmaps (GK x 512 B), the ColInfo (GK x 64 B) and the X tile, so the decode reads only
// shared memory. At is double-buffered: iteration t (after one barrier) issues step t+NST-1, decodes
// step t+1 into At[(t+1)&1] and multiplies step t from At[t&1]; the two are independent, so the warp
// schedulers overlap the decode's shared-memory/ALU work with the mma stream.
// With splits > 1 each block writes fp32 partials [split][N][Mp]; the last block of an output tile (atomic
// ticket) adds them in split order (deterministic), writes fp16 and resets the ticket.
template <int BN, int GK, int NST, int MINB>
__global__ void __launch_bounds__(256, MINB) tcbc_spmm2(
    const u64* __restrict__ bitmap, const u32* __restrict__ colinfo, const u32* __restrict__ tile_offset,
    const u16* __restrict__ values, const u16* __restrict__ X, u16* __restrict__ Y, int grid_c, int M, int K,
    int N, int Mp, int raw_bytes, int sps, float* __restrict__ partial, u32* __restrict__ tickets) {
    constexpr int BK = TILE_K * GK;
    constexpr int XS = BK + 8;
    constexpr int WN = BN / 2;
    constexpr int NT = WN / 8;
    constexpr int BMB = GK * TILE_K * 32;  // bitmap bytes per step
    constexpr int CIB = GK * TILE_K * 4;   // colinfo bytes per step
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int last_s;
    unsigned char* raw = smem;                                                          // NST * raw_bytes
    u16* At = reinterpret_cast<u16*>(smem + NST * raw_bytes);                          // 2 * BK * AT_STRIDE
    u16* Xs = At + 2 * BK * AT_STRIDE;                                                  // NST * BN * XS
    unsigned char* bms = reinterpret_cast<unsigned char*>(Xs + NST * BN * XS);          // NST * BMB
    unsigned char* cis = bms + NST * BMB;                                               // NST * CIB
    u32* toffs = reinterpret_cast<u32*>(cis + NST * CIB);                               // sps * GK + 1

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2;
    const int tr = blockIdx.y, n0 = blockIdx.x * BN;
    const int gt_row = tr * grid_c;
    const int nsteps = (grid_c + GK - 1) / GK;
    const int sb = blockIdx.z * sps;
    const int ns = max(0, min(nsteps, sb + sps) - sb);
    const int cbase = sb * GK;  // first GTile column of the block

    for (int i = tid; i <= ns * GK; i += 256) toffs[i] = tile_offset[gt_row + min(cbase + i, grid_c)];
    __syncthreads();

    auto issue = [&](int t) {
        if (t < ns) {
            const int st = t % NST;
            const int c0 = cbase + t * GK, cn = min(GK, grid_c - c0);
            const u32 v0 = toffs[t * GK], v1 = toffs[t * GK + cn];
            const int chunks = (int)((v1 - v0) >> 3);
            unsigned char* dst = raw + st * raw_bytes;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(values + v0);
            for (int i = tid; i < chunks; i += 256) cp_async16_zfill(dst + i * 16, src + i * 16, true);
            const unsigned char* bsrc = reinterpret_cast<const unsigned char*>(bitmap + (size_t)(gt_row + c0) * TILE_K * 4);
            const unsigned char* csrc = reinterpret_cast<const unsigned char*>(colinfo + (size_t)(gt_row + c0) * TILE_K);
            for (int i = tid; i < cn * (BMB / GK / 16); i += 256) cp_async16_zfill(bms + st * BMB + i * 16, bsrc + i * 16, true);
            if (tid < cn * (CIB / GK / 16)) cp_async16_zfill(cis + st * CIB + tid * 16, csrc + tid * 16, true);
            u16* xd = Xs + st * BN * XS;
            for (int i = tid; i < BN * BK / 8; i += 256) {
                const int n = i / (BK / 8), kc = (i % (BK / 8)) * 8;
                const int k = c0 * TILE_K + kc;
                const bool ok = n0 + n < N && k < K;
                const u16* g = ok ? X + (size_t)(n0 + n) * K + k : X;
                cp_async16_zfill(xd + n * XS + kc, g, ok);
            }
        }
        cp_commit();
    };

    const int wsel = lane >> 3, sh = (lane & 7) * 8;
    auto decode = [&](int t) {
        const int st = t % NST;
        const int c0 = cbase + t * GK;
        const u16* rv = reinterpret_cast<const u16*>(raw + st * raw_bytes);
        const u64* bm = reinterpret_cast<const u64*>(bms + st * BMB);
        const u32* ci_s = reinterpret_cast<const u32*>(cis + st * CIB);
        const u32 vbase = toffs[t * GK];
        u16* at = At + (t & 1) * BK * AT_STRIDE;
#pragma unroll
        for (int q = 0; q < BK / 8; ++q) {
            const int kc = warp * (BK / 8) + q;
            const int gcl = kc / TILE_K;
            u32 h[4] = {0u, 0u, 0u, 0u};
            if (c0 + gcl < grid_c) {
                const u32 ci = ci_s[kc];
                const u64 word = bm[kc * 4 + wsel];
                const int pc = __popcll(word);
                const int p0 = __shfl_sync(0xFFFFFFFFu, pc, 0), p1 = __shfl_sync(0xFFFFFFFFu, pc, 8),
                          p2 = __shfl_sync(0xFFFFFFFFu, pc, 16);
                int rank = (wsel > 0 ? p0 : 0) + (wsel > 1 ? p1 : 0) + (wsel > 2 ? p2 : 0) +
                           __popcll(word & ((1ull << sh) - 1ull));
                const u16* cv = rv + (toffs[t * GK + gcl] - vbase) + (ci >> 16);
                const u32 byte = (u32)(word >> sh) & 0xFFu;
#pragma unroll
                for (int r = 0; r < 8; ++r) {
                    if (byte & (1u << r)) {
                        h[r >> 1] |= (u32)cv[rank] << ((r & 1) * 16);
                        ++rank;
                    }
                }
            }
            *reinterpret_cast<uint4*>(at + kc * AT_STRIDE + lane * 8) = make_uint4(h[0], h[1], h[2], h[3]);
        }
    };

    float acc[4][NT][4];
    zero_acc(acc);

#pragma unroll
    for (int t = 0; t < NST - 1; ++t) issue(t);
    cp_wait<NST - 2>();
    __syncthreads();
    if (ns > 0) decode(0);
    for (int t = 0; t < ns; ++t) {
        cp_wait<NST - 3>();
        __syncthreads();
        issue(t + NST - 1);
        if (t + 1 < ns) decode(t + 1);
        const u16* at = At + (t & 1) * BK * AT_STRIDE;
        const u16* xs = Xs + (t % NST) * BN * XS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 a[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = lane >> 3;
                const int m = wm * 64 + i * 16 + (j & 1) * 8;
                const int k = kk + (j >> 1) * 8 + (lane & 7);
                ldsm_x4_t(a[i], at + k * AT_STRIDE + m);
            }
#pragma unroll
            for (int jj = 0; jj < NT; jj += 2) {
                u32 b[4];
                const int j = lane >> 3;
                const int n = wn * WN + jj * 8 + (j >> 1) * 8 + (lane & 7);
                const int k = kk + (j & 1) * 8;
                ldsm_x4(b, xs + n * XS + k);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    mma16816(acc[i][jj], a[i], b);
                    mma16816(acc[i][jj + 1], a[i], b + 2);
                }
            }
        }
    }
    cp_wait<0>();

    const int g = lane >> 2, tq = lane & 3;
    if (gridDim.z == 1) {
        for_each_acc<NT>(acc, tr * TILE_M + wm * 64, n0 + wn * WN, g, tq, [&](int mm, int nn, float v) {
            if (mm < M && nn < N) Y[(size_t)nn * M + mm] = f2h(v);
        });
        return;
    }
    float* part = partial + (size_t)blockIdx.z * N * Mp;
    for_each_acc<NT>(acc, tr * TILE_M + wm * 64, n0 + wn * WN, g, tq, [&](int mm, int nn, float v) {
        if (nn < N) part[(size_t)nn * Mp + mm] = v;
    });
    split_k_finish<256>(partial, tickets + tr * gridDim.x + blockIdx.x, gridDim.z, n0, BN, tr, N, M, Mp, Y, last_s);
}

// ---------------------------------------------------------------------------------------------------
// v3 (small N, default up to WARP_UP_TO_N tokens): warp-streamed, no block barrier in the main loop, the
// W fragments built in registers (no shared-memory W tile, no ldmatrix).
//
// Block = 4 warps = one GTile row x a range of `cps` GTile columns (split-K as in v2); warp q owns rows
// 64q..64q+63 of the row, i.e. bitmap word q of every column, and streams its own quarter of each GTile
// (and the GTile's X tile) through a private NST-slot ring (cp.async, one commit per GTile, wait_group + __syncwarp; the same
// producer/consumer-in-one-warp schedule as the IE-BME kernel).
// Issue (GTile j + NST - 1; its bitmap, ColInfo and TileOffset were loaded into registers one GTile earlier):
// lane l holds bitmap words 2(l&1), 2(l&1)+1 of column l>>1; the lane holding word q computes the quarter's
// first value (TileOffset + column start + set bits of the earlier words), writes {word q, offset within its
// first 16-byte chunk} to the slot header, and both lanes of the column copy the <= 9 chunks of the
// quarter's run (a column region of 144 B per column). Only the rows of this quarter are copied.
// Fragments without a shared-memory tile: rows are permuted inside the mma (fragment row g of m-slab i is
// quarter row 8g + 2i, fragment row g + 8 is 8g + 2i + 1), so lane (g, t) needs rows 8g..8g+7 = byte g of the
// word of its 4 columns (2t, 2t+1, 2t+8, 2t+9): per column one masked popcount gives the rank of the
// first value and the set bits take the next ones (HAD-SMBD); two columns' values pack into one A register
// with one prmt. The GTile's X tile ([NT*8 tokens][16 k], row stride 48 B) rides in the same ring slot
// (cp.async, zero-filled past K), so B fragments are two conflict-free shared loads. (The first version read
// them from global memory one GTile ahead: its time grew ~1.5x from N = 8 to N = 16 on 28672 x 8192.)
// mma.sync m16n8k16 fp16 -> fp32, 4 m-slabs x NT n-tiles per GTile quarter.
// splits > 1: fp32 partials [split][N][Mp] and the v2 ticket (one per GTile row), deterministic.
#define V3_REG 144                                // bytes per column region (9 chunks)
#define V3_HDR 256                                // 16 columns x {word lo, word hi, offset, 0}
#define V3_W (V3_HDR + TILE_K * V3_REG)           // 2560 bytes of W per GTile quarter, then the X tile
#define V3_XS 48                                  // X tile row stride (16 halves + 8): B loads conflict-free

__device__ __forceinline__ u32 pack2(u32 lo, u32 hi) {  // two zero-extended halves -> one register
    u32 d;
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(d) : "r"(lo), "r"(hi));
    return d;
}

__device__ __forceinline__ u32 lds_u16(u32 addr) {
    u32 v;
    asm("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// The 8 values of one column for rows 8g..8g+7 of the quarter (zero-extended halves, zero when absent):
// one masked popcount for the first rank, then one predicated 2-byte load and one add per set bit.
__device__ __forceinline__ void v3_column(const unsigned char* slot, u32 slot_s, int c, int g, u32 (&v)[8]) {
    const uint4 h = *reinterpret_cast<const uint4*>(slot + 16 * c);
    const u32 sel = g < 4 ? h.x : h.y;
    const int sh = 8 * (g & 3);
    const u32 rank = __popc(sel & ((1u << sh) - 1u)) + (g < 4 ? 0 : __popc(h.x));
    const u32 mb = (sel >> sh) & 0xFFu;
    u32 a = slot_s + V3_HDR + V3_REG * c + 2 * (h.z + rank);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        v[r] = 0u;
        if (mb & (1u << r)) {
            v[r] = lds_u16(a);
            a += 2;
        }
    }
}

// Visits v3's accumulators as f(row, token, value): (i, nt, r) is row rbase + 2i + (r >> 1), token
// nt*8 + 2t + (r & 1) (rbase = the lane's first row, 8g rows into its warp's quarter).
template <int NT, typename F>
__device__ __forceinline__ void v3_each_acc(const float (&acc)[4][NT][4], int rbase, int t, F f) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) f(rbase + 2 * i + (r >> 1), nt * 8 + 2 * t + (r & 1), acc[i][nt][r]);
}

template <int NT, int NST, int MINB>
__global__ void __launch_bounds__(128, MINB) tcbc_spmm3(
    const u64* __restrict__ bitmap, const u32* __restrict__ colinfo, const u32* __restrict__ tile_offset,
    const u16* __restrict__ values, const u16* __restrict__ X, u16* __restrict__ Y, int grid_c, int M, int K,
    int N, int Mp, int cps, float* __restrict__ partial, u32* __restrict__ tickets) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int last_s;
    const int tid = threadIdx.x, lane = tid & 31, q = tid >> 5;
    const int tr = blockIdx.x, c_begin = blockIdx.y * cps;
    const int nct = max(0, min(cps, grid_c - c_begin));
    constexpr int SLOT = V3_W + NT * 8 * V3_XS;     // W of the GTile quarter + X tile [NT * 8][16 halves]
    unsigned char* ring = smem + q * NST * SLOT;
    const size_t gt0 = (size_t)tr * grid_c + c_begin;
    const int g = lane >> 2, t = lane & 3;
    const int mc = lane >> 1, mh = lane & 1;           // issue roles: column mc, bitmap words 2mh, 2mh+1
    const int owner = (lane & ~1) | (q >> 1);           // the lane of column mc holding word q

    // metadata of the next GTile to issue, one GTile ahead in registers
    uint4 m_bw = make_uint4(0u, 0u, 0u, 0u);
    u32 m_ci = 0u, m_toff = 0u;
    auto load_meta = [&](int j) {
        if (j < nct) {
            const size_t gt = gt0 + j;
            m_bw = __ldg(reinterpret_cast<const uint4*>(bitmap + (gt * TILE_K + mc) * 4 + 2 * mh));
            m_ci = __ldg(colinfo + gt * TILE_K + mc);
            m_toff = __ldg(tile_offset + gt);
        }
    };
    auto issue = [&](int j) {
        if (j < nct) {
            const u64 w0 = ((u64)m_bw.y << 32) | m_bw.x, w1 = ((u64)m_bw.w << 32) | m_bw.z;
            const u32 pa = __popcll(w0), pb = __popcll(w1);
            const u32 pp = __shfl_xor_sync(0xFFFFFFFFu, pa + pb, 1);
            const u64 W = (q & 1) ? w1 : w0;
            const u32 base = m_toff + (m_ci >> 16) + (mh ? pp : 0u) + ((q & 1) ? pa : 0u);
            const u32 len = __popcll(W);
            const u32 nch = len ? ((base & 7u) + len + 7u) >> 3 : 0u;
            const u32 lo = __shfl_sync(0xFFFFFFFFu, base >> 3, owner);
            const u32 n_o = __shfl_sync(0xFFFFFFFFu, nch, owner);
            unsigned char* slot = ring + (j % NST) * SLOT;
            if (lane == owner)
                *reinterpret_cast<uint4*>(slot + 16 * mc) = make_uint4((u32)W, (u32)(W >> 32), base & 7u, 0u);
            // lane parity mh copies chunks mh, mh + 2, ... (<= 9 chunks: 7 + 64 + 7 halves)
            u32 dst = smem_addr(slot + V3_HDR + V3_REG * mc + 16 * mh);
            const unsigned char* src = reinterpret_cast<const unsigned char*>(values) + ((size_t)lo + mh) * 16;
#pragma unroll
            for (int i = 0; i < 5; ++i) {
                if (2 * i + mh < (int)n_o)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
                dst += 32;
                src += 32;
            }
            // the GTile's X tile: rows nt*8+g (clamped to N-1), 2 chunks of 8 halves each, zero past K
            const int k = (c_begin + j) * TILE_K;
#pragma unroll
            for (int i = lane; i < NT * 16; i += 32) {
                const int r = i >> 1, h = i & 1;
                const bool ok = k + 8 * h < K;
                const u16* xs = ok ? X + (size_t)min(r, N - 1) * K + k + 8 * h : X;
                cp_async16_zfill(slot + V3_W + r * V3_XS + 16 * h, xs, ok);
            }
        }
        cp_commit();
    };
    float acc[4][NT][4];
    zero_acc(acc);

    load_meta(0);
#pragma unroll
    for (int s = 0; s < NST - 1; ++s) {
        issue(s);
        load_meta(s + 1);
    }
    for (int j = 0; j < nct; ++j) {
        cp_wait<NST - 2>();
        __syncwarp();  // every lane is done with the slot the next issue refills
        issue(j + NST - 1);
        load_meta(j + NST);
        const unsigned char* slot = ring + (j % NST) * SLOT;
        const u32 slot_s = smem_addr(slot);
        u32 a[4][4];
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // column pairs (2t, 2t+1) -> a0/a1, (2t+8, 2t+9) -> a2/a3
            u32 va[8], vb[8];
            v3_column(slot, slot_s, 2 * t + 8 * p, g, va);
            v3_column(slot, slot_s, 2 * t + 8 * p + 1, g, vb);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[i][2 * p] = pack2(va[2 * i], vb[2 * i]);
                a[i][2 * p + 1] = pack2(va[2 * i + 1], vb[2 * i + 1]);
            }
        }
        // B fragments: token nt*8+g, k pairs 2t and 2t+8 (row stride 48 B: the 8 rows x 4 lanes hit 32 banks)
        u32 xb[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const unsigned char* xr = slot + V3_W + (nt * 8 + g) * V3_XS + 4 * t;
            xb[nt][0] = *reinterpret_cast<const u32*>(xr);
            xb[nt][1] = *reinterpret_cast<const u32*>(xr + 16);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma16816(acc[i][nt], a[i], xb[nt]);
    }
    cp_wait<0>();

    const int rbase = tr * TILE_M + 64 * q + 8 * g;
    if (gridDim.y == 1) {
        v3_each_acc<NT>(acc, rbase, t, [&](int row, int n, float v) {
            if (row < M && n < N) Y[(size_t)n * M + row] = f2h(v);
        });
        return;
    }
    float* part = partial + (size_t)blockIdx.y * N * Mp;
    v3_each_acc<NT>(acc, rbase, t, [&](int row, int n, float v) {
        if (n < N) part[(size_t)n * Mp + row] = v;
    });
    split_k_finish<128>(partial, tickets + tr, gridDim.y, 0, N, tr, N, M, Mp, Y, last_s);
}

#define TCBC_SPMM2(BN, NST, MINB)                                                                          \
    template __global__ void tcbc_spmm2<BN, 2, NST, MINB>(const u64*, const u32*, const u32*, const u16*, \
                                                          const u16*, u16*, int, int, int, int, int, int, \
                                                          int, float*, u32*);
TCBC_SPMM2(32, 3, 2)
TCBC_SPMM2(64, 3, 2)
TCBC_SPMM2(64, 3, 1)
TCBC_SPMM2(128, 3, 1)
TCBC_SPMM2(128, 4, 1)
TCBC_SPMM2(32, 5, 2)
TCBC_SPMM2(64, 4, 2)

#define TCBC_SPMM3(NT, NST, MINB)                                                                          \
    template __global__ void tcbc_spmm3<NT, NST, MINB>(const u64*, const u32*, const u32*, const u16*,    \
                                                       const u16*, u16*, int, int, int, int, int, int,    \
                                                       float*, u32*);
TCBC_SPMM3(1, 4, 4)
TCBC_SPMM3(1, 6, 3)
TCBC_SPMM3(2, 4, 4)
TCBC_SPMM3(2, 6, 3)
TCBC_SPMM3(4, 4, 3)
TCBC_SPMM3(4, 4, 4)
TCBC_SPMM3(8, 4, 2)
TCBC_SPMM3(8, 4, 3)

// ---------------------------------------------------------------------------------------------------
// v4 (sm_90a, `method="wgmma"`): decode into shared memory, multiply with Hopper's asynchronous warpgroup
// MMA (wgmma), so the tensor cores run one step while the CUDA cores decode the next.
//
// Block = 256 threads = 2 warpgroups = one GTile row (256 rows of W) x BN tokens x a K range (split-K with
// the v2 ticket). One step = GK GTiles (BK = 16 GK columns). Per step, in shared memory:
//   A: the step's 256 x 64 dense fp16 W tile, written by the decode in wgmma's 128-byte-swizzled K-major
//      layout: row m is 128 bytes at m * 128, its 16-byte k-chunk j stored at chunk j ^ (m % 8) (1024-byte
//      aligned atoms of 8 rows); two buffers (decode t+1 while wgmma reads t). The first version used the
//      no-swizzle layout (8 x 16-byte core matrices) and ran at 0.2x cuBLAS at N >= 512: the tensor cores'
//      shared-memory reads conflict there (docs/kernels.md).
//   X: the step's BN x 64 tokens in the same layout (cp.async, zero-filled past N and K), NST slots.
//   raw values, bitmaps and ColInfo of the step (cp.async, as v2), NST slots; so the copies of step t+2,
//   the decode of step t+1 and the wgmma of step t are in flight together.
// Descriptors: swizzle mode 128 B, stride byte offset 1024 (between 8-row groups), the k16 slice s of the
// 64-wide atom at start address + 32 s. Warpgroup g owns rows 128 g .. 128 g + 127 (two m64 slabs), i.e.
// 8 wgmma.m64nBNk16 per step, accumulators in registers (BN floats per thread).
// Decode (decode_dense2's rule): per (column, 32-row word half) one 8-byte entry {the half's bits, index of
// its first value in the raw buffer}; thread t = row t, so a warp reads one broadcast entry per column, one
// masked popcount gives the rank, one predicated 2-byte load the value; 8 columns make one 16-byte store
// (a quarter-warp's stores cover one 128-byte core matrix: no bank conflicts).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#ifndef TCBC_V4_SKIP  // studies only: 1 skips the decode of steps after the first, 2 the wgmma, 3 both
#define TCBC_V4_SKIP 0
#endif
__device__ __forceinline__ u64 wg_desc(u32 saddr) {  // K-major, 128-byte swizzle, 8-row groups 1024 B apart
    return (u64)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// generic-proxy shared-memory writes (stores, cp.async) made visible to the async proxy wgmma reads with
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {  // keep the compiler from moving the accumulators
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// the accumulator operands d[i .. i + 7] of a wgmma asm statement
#define TCBC_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                   "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void wgmma_f16(float (&d)[8], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7} "
        ", %8, %9, p, 1, 1, 0, 0; }"
        : TCBC_D8(0)
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_f16(float (&d)[16], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15} "
        ", %16, %17, p, 1, 1, 0, 0; }"
        : TCBC_D8(0), TCBC_D8(8)
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_f16(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
        ", %32, %33, p, 1, 1, 0, 0; }"
        : TCBC_D8(0), TCBC_D8(8), TCBC_D8(16), TCBC_D8(24)
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_f16(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
        "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63} "
        ", %64, %65, p, 1, 1, 0, 0; }"
        : TCBC_D8(0), TCBC_D8(8), TCBC_D8(16), TCBC_D8(24), TCBC_D8(32), TCBC_D8(40), TCBC_D8(48), TCBC_D8(56)
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_f16(float (&d)[96], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.eq.u32 p, 1, 1; wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
        "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
        "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
        "%92, %93, %94, %95} "
        ", %96, %97, p, 1, 1, 0, 0; }"
        : TCBC_D8(0), TCBC_D8(8), TCBC_D8(16), TCBC_D8(24), TCBC_D8(32), TCBC_D8(40), TCBC_D8(48), TCBC_D8(56),
          TCBC_D8(64), TCBC_D8(72), TCBC_D8(80), TCBC_D8(88)
        : "l"(da), "l"(db));
}

// Visits a warpgroup's accumulators as f(row, token, value): rbase = the thread's first row, nb = its first
// token (n0 + 2 tq); register 4 j + r of slab i is row rbase + 64 i + 8 (r >= 2), token nb + 8 j + (r & 1).
template <int SL, int BN, typename F>
__device__ __forceinline__ void wg_each_acc(const float (&acc)[SL][BN / 2], int rbase, int nb, F f) {
#pragma unroll
    for (int i = 0; i < SL; ++i)
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) f(rbase + i * 64 + ((r >> 1) & 1) * 8, nb + (r >> 2) * 8 + (r & 1), acc[i][r]);
}

template <int BN, int TPR, int NST>
__global__ void __launch_bounds__(256 * TPR, 1) tcbc_spmm4(
    const u64* __restrict__ bitmap, const u32* __restrict__ colinfo, const u32* __restrict__ tile_offset,
    const u16* __restrict__ values, const u16* __restrict__ X, u16* __restrict__ Y, int grid_c, int M, int K,
    int N, int Mp, int raw_bytes, int sps, float* __restrict__ partial, u32* __restrict__ tickets) {
    constexpr int GK = 4;                    // GTiles per step: 64 columns, one 128-byte swizzle row
    constexpr int NTH = 256 * TPR;           // TPR threads per row of the GTile row
    constexpr int SL = 2 / TPR;              // m64 slabs per warpgroup
    constexpr int BK = TILE_K * GK;
    constexpr int KC = BK / 8;               // 16-byte k-chunks per row
    constexpr int A_BYTES = TILE_M * BK * 2;
    constexpr int X_BYTES = BN * BK * 2;
    constexpr int NCOL = GK * TILE_K;        // columns per step
    constexpr int BMB = NCOL * 32;           // bitmap bytes per step
    constexpr int CIB = NCOL * 4;            // ColInfo bytes per step
    static_assert((TPR == 1 || TPR == 2) && NST >= 3, "1 or 2 threads per row; 3+ slots");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ int last_s;
    // swizzle atoms need 1024-byte alignment (the host adds 1024 bytes of slack)
    unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned char* As = smem;                                             // 2 * A_BYTES
    unsigned char* Xs = As + 2 * A_BYTES;                                 // NST * X_BYTES
    unsigned char* raw = Xs + NST * X_BYTES;                              // NST * raw_bytes
    unsigned char* bms = raw + NST * raw_bytes;                           // NST * BMB
    unsigned char* cis = bms + NST * BMB;                                 // NST * CIB
    uint2* ent = reinterpret_cast<uint2*>(cis + NST * CIB);               // NCOL * 8
    u32* toffs = reinterpret_cast<u32*>(ent + NCOL * 8);                  // sps * GK + 1

    const int tid = threadIdx.x, lane = tid & 31;
    const int tr = blockIdx.y, n0 = blockIdx.x * BN;
    const int gt_row = tr * grid_c;
    const int nsteps = (grid_c + GK - 1) / GK;
    const int sb = blockIdx.z * sps;
    const int ns = max(0, min(nsteps, sb + sps) - sb);
    const int cbase = sb * GK;  // first GTile column of the block

    for (int i = tid; i <= ns * GK; i += NTH) toffs[i] = tile_offset[gt_row + min(cbase + i, grid_c)];
    __syncthreads();

    auto issue = [&](int t) {  // cp.async of step t's values, bitmaps, ColInfo and X tile into slot t % NST
        if (t < ns) {
            const int st = t % NST;
            const int c0 = cbase + t * GK, cn = min(GK, grid_c - c0);
            const u32 v0 = toffs[t * GK], v1 = toffs[t * GK + cn];
            const int chunks = (int)((v1 - v0) >> 3);
            unsigned char* dst = raw + st * raw_bytes;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(values + v0);
            for (int i = tid; i < chunks; i += NTH) cp_async16_zfill(dst + i * 16, src + i * 16, true);
            const unsigned char* bsrc = reinterpret_cast<const unsigned char*>(bitmap + (size_t)(gt_row + c0) * TILE_K * 4);
            const unsigned char* csrc = reinterpret_cast<const unsigned char*>(colinfo + (size_t)(gt_row + c0) * TILE_K);
            for (int i = tid; i < cn * (BMB / GK / 16); i += NTH) cp_async16_zfill(bms + st * BMB + i * 16, bsrc + i * 16, true);
            if (tid < cn * (CIB / GK / 16)) cp_async16_zfill(cis + st * CIB + tid * 16, csrc + tid * 16, true);
            unsigned char* xd = Xs + st * X_BYTES;
            for (int i = tid; i < BN * KC; i += NTH) {  // 8 lanes per token row: one 128-byte line each side
                const int n = i >> 3, j = i & 7;
                const int k = c0 * TILE_K + j * 8;
                const bool ok = n0 + n < N && k < K;
                const u16* g = ok ? X + (size_t)(n0 + n) * K + k : X;
                cp_async16_zfill(xd + n * 128 + ((j ^ (n & 7)) << 4), g, ok);
            }
        }
        cp_commit();
    };

    auto build_entries = [&](int t) {  // thread = (column, bitmap word): two {bits, first value} entries
        if (tid < NCOL * 4) {
            const int st = t % NST, col = tid >> 2, w = tid & 3, gcl = col / TILE_K;
            uint2 e0 = make_uint2(0u, 0u), e1 = e0;
            if (cbase + t * GK + gcl < grid_c) {
                const u64* cw = reinterpret_cast<const u64*>(bms + st * BMB) + col * 4;
                const u32* ci_s = reinterpret_cast<const u32*>(cis + st * CIB);
                u32 s = toffs[t * GK + gcl] - toffs[t * GK] + (ci_s[col] >> 16);
#pragma unroll
                for (int q = 0; q < 3; ++q) s += q < w ? __popcll(cw[q]) : 0;
                const u64 wd = cw[w];
                e0 = make_uint2((u32)wd, s);
                e1 = make_uint2((u32)(wd >> 32), s + __popc((u32)wd));
            }
            ent[col * 8 + 2 * w] = e0;
            ent[col * 8 + 2 * w + 1] = e1;
        }
    };

    const int row = tid & 255, j0 = (tid >> 8) * (KC / TPR);  // this thread's row and first k-chunk
    const int hw = row >> 5;            // the word half of the row (rows 32 hw .. 32 hw + 31)
    const u32 lt = (1u << lane) - 1u;
    auto decode = [&](int t) {          // k-chunks j0 .. j0 + KC / TPR - 1 of the row
        const u16* rv = reinterpret_cast<const u16*>(raw + (t % NST) * raw_bytes);
        unsigned char* a = As + (t & 1) * A_BYTES + row * 128;
#pragma unroll
        for (int j = j0; j < j0 + KC / TPR; ++j) {
            u32 h[4];
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                const uint2 e = ent[(j * 8 + c) * 8 + hw];
                u32 v = 0u;
                if ((e.x >> lane) & 1u) v = rv[e.y + __popc(e.x & lt)];
                if (c & 1) h[c >> 1] |= v << 16;
                else h[c >> 1] = v;
            }
            *reinterpret_cast<uint4*>(a + ((j ^ (row & 7)) << 4)) = make_uint4(h[0], h[1], h[2], h[3]);
        }
    };

    float acc[SL][BN / 2];
#pragma unroll
    for (int i = 0; i < SL; ++i)
#pragma unroll
        for (int r = 0; r < BN / 2; ++r) acc[i][r] = 0.f;
    const int wg = tid >> 7;            // warpgroup wg: rows 64 SL wg .. 64 SL wg + 64 SL - 1
    const u32 a_sm = smem_addr(As) + wg * SL * 64 * 128, x_sm = smem_addr(Xs);

#pragma unroll
    for (int t = 0; t < NST - 1; ++t) issue(t);
    cp_wait<NST - 2>();
    __syncthreads();
    if (ns > 0) {
        build_entries(0);
        __syncthreads();
        decode(0);
    }
    fence_async_smem();
    __syncthreads();
    for (int t = 0; t < ns; ++t) {
        {   // the tensor cores take step t ...
            const u32 a0 = a_sm + (t & 1) * A_BYTES, x0 = x_sm + (t % NST) * X_BYTES;
#pragma unroll
            for (int i = 0; i < SL; ++i) fence_acc(acc[i]);
            wg_fence();
#pragma unroll
            for (int s = 0; s < GK * !(TCBC_V4_SKIP & 2); ++s) {
                const u64 db = wg_desc(x0 + s * 32);
#pragma unroll
                for (int i = 0; i < SL; ++i) wgmma_f16(acc[i], wg_desc(a0 + i * 64 * 128 + s * 32), db);
            }
            wg_commit();
        }
        issue(t + NST - 1);   // ... while the copies of step t + NST - 1 start
        cp_wait<NST - 2>();   // step t + 1 has landed
        __syncthreads();
        if (t + 1 < ns && !(TCBC_V4_SKIP & 1)) {  // ... and the CUDA cores decode step t + 1
            build_entries(t + 1);
            __syncthreads();
            decode(t + 1);
        }
        fence_async_smem();
        wg_wait0();
#pragma unroll
        for (int i = 0; i < SL; ++i) fence_acc(acc[i]);
        __syncthreads();
    }
    cp_wait<0>();

    // D fragment of m64nBN: warp q of the warpgroup holds rows 16 q + g and 16 q + g + 8
    const int g = lane >> 2, tq = lane & 3, wq = (tid >> 5) & 3;
    const int rbase = tr * TILE_M + wg * SL * 64 + wq * 16 + g;
    if (gridDim.z == 1) {
        wg_each_acc<SL, BN>(acc, rbase, n0 + 2 * tq, [&](int mm, int nn, float v) {
            if (mm < M && nn < N) Y[(size_t)nn * M + mm] = f2h(v);
        });
        return;
    }
    float* part = partial + (size_t)blockIdx.z * N * Mp;
    wg_each_acc<SL, BN>(acc, rbase, n0 + 2 * tq, [&](int mm, int nn, float v) {
        if (nn < N) part[(size_t)nn * Mp + mm] = v;
    });
    split_k_finish<NTH>(partial, tickets + tr * gridDim.x + blockIdx.x, gridDim.z, n0, BN, tr, N, M, Mp, Y, last_s);
}

#define TCBC_SPMM4(BN, TPR, NST)                                                                         \
    template __global__ void tcbc_spmm4<BN, TPR, NST>(const u64*, const u32*, const u32*, const u16*,    \
                                                      const u16*, u16*, int, int, int, int, int, int,    \
                                                      int, float*, u32*);
TCBC_SPMM4(16, 2, 6)
TCBC_SPMM4(16, 2, 3)
TCBC_SPMM4(32, 2, 6)
TCBC_SPMM4(32, 2, 3)
TCBC_SPMM4(64, 2, 5)
TCBC_SPMM4(64, 2, 3)
TCBC_SPMM4(128, 1, 4)
TCBC_SPMM4(128, 1, 3)
TCBC_SPMM4(192, 1, 3)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
