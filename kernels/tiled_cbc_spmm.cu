// Tiled-CBC SpMM (prefill): Y[N, M] = X[N, K] . W^T on tensor cores (mma.sync m16n8k16, fp16 in,
// fp32 accumulate, fp16 out), from the same arrays as the spMspV kernel (float16 values).
//
// Block = one GTile row (BM = 256 rows of W) x BN tokens, 8 warps as 4 (M) x 2 (N), warp tile 64 x BN/2.
// One step covers GK consecutive GTiles (BK = 16 GK): their Values are one contiguous range (GTiles are
// row-major), copied with cp.async into a raw buffer together with the X tile, double-buffered so that
// step s+1 is in flight while step s is decoded and multiplied.
// Layout alignment: each warp decodes whole columns (lane l: rows 8l..8l+7, one masked popcount, the
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

// raw_bytes: bytes reserved per raw buffer (>= the largest GK-GTile value range, multiple of 16).
// Requires K % 8 == 0 (16-byte X rows); the host pads X otherwise.
template <int BN, int GK, int MINB>
__global__ void __launch_bounds__(256, MINB) tcbc_spmm(
    const u64* __restrict__ bitmap, const u32* __restrict__ colinfo, const u32* __restrict__ tile_offset,
    const u16* __restrict__ values, const u16* __restrict__ X, u16* __restrict__ Y, int grid_c, int M,
    int K, int N, int raw_bytes) {
    constexpr int BK = TILE_K * GK;
    constexpr int XS = BK + 8;
    constexpr int WN = BN / 2;     // warp tile along N
    constexpr int NT = WN / 8;     // n8 tiles per warp
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* raw = smem;                                               // 2 * raw_bytes
    u16* At = reinterpret_cast<u16*>(smem + 2 * raw_bytes);                  // BK * AT_STRIDE
    u16* Xs = At + BK * AT_STRIDE;                                           // 2 * BN * XS

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2;
    const int tr = blockIdx.y, n0 = blockIdx.x * BN;
    const int gt_row = tr * grid_c;
    const int nsteps = (grid_c + GK - 1) / GK;

    auto issue = [&](int s) {
        int c0 = s * GK, cn = min(GK, grid_c - c0);
        size_t v0 = tile_offset[gt_row + c0], v1 = tile_offset[gt_row + c0 + cn];
        int chunks = (int)((v1 - v0) * 2 / 16);
        unsigned char* dst = raw + (s & 1) * raw_bytes;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(values + v0);
        for (int i = tid; i < chunks; i += 256) cp_async16_zfill(dst + i * 16, src + i * 16, true);
        u16* xd = Xs + (s & 1) * BN * XS;
        for (int i = tid; i < BN * BK / 8; i += 256) {
            int n = i / (BK / 8), kc = (i % (BK / 8)) * 8;
            int k = c0 * TILE_K + kc;
            bool ok = n0 + n < N && k < K;
            const u16* g = ok ? X + (size_t)(n0 + n) * K + k : X;
            cp_async16_zfill(xd + n * XS + kc, g, ok);
        }
        cp_commit();
    };

    float acc[4][NT][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

    issue(0);
    for (int s = 0; s < nsteps; ++s) {
        if (s + 1 < nsteps) issue(s + 1);
        else cp_commit();
        cp_wait<1>();
        __syncthreads();
        // decode GK GTiles: BK columns, BK / 8 per warp
        {
            int c0 = s * GK;
            const u16* rv = reinterpret_cast<const u16*>(raw + (s & 1) * raw_bytes);
            u32 vbase = tile_offset[gt_row + c0];
            const int wsel = lane >> 3, sh = (lane & 7) * 8;
#pragma unroll
            for (int q = 0; q < BK / 8; ++q) {
                int kc = warp * (BK / 8) + q;
                int gc = c0 + kc / TILE_K;
                u32 h[4] = {0u, 0u, 0u, 0u};
                if (gc < grid_c) {
                    int col = (gt_row + gc) * TILE_K + kc % TILE_K;
                    u32 ci = colinfo[col];
                    u64 word = bitmap[(size_t)col * 4 + wsel];
                    int pc = __popcll(word);
                    int p0 = __shfl_sync(0xFFFFFFFFu, pc, 0), p1 = __shfl_sync(0xFFFFFFFFu, pc, 8),
                        p2 = __shfl_sync(0xFFFFFFFFu, pc, 16);
                    int rank = (wsel > 0 ? p0 : 0) + (wsel > 1 ? p1 : 0) + (wsel > 2 ? p2 : 0) +
                               __popcll(word & ((1ull << sh) - 1ull));
                    const u16* cv = rv + (tile_offset[gt_row + gc] - vbase) + (ci >> 16);
                    u32 byte = (u32)(word >> sh) & 0xFFu;
#pragma unroll
                    for (int r = 0; r < 8; ++r) {
                        if (byte & (1u << r)) {
                            h[r >> 1] |= (u32)cv[rank] << ((r & 1) * 16);
                            ++rank;
                        }
                    }
                }
                *reinterpret_cast<uint4*>(At + kc * AT_STRIDE + lane * 8) = make_uint4(h[0], h[1], h[2], h[3]);
            }
        }
        __syncthreads();
        const u16* xs = Xs + (s & 1) * BN * XS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 a[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int j = lane >> 3;
                int m = wm * 64 + i * 16 + (j & 1) * 8;
                int k = kk + (j >> 1) * 8 + (lane & 7);
                ldsm_x4_t(a[i], At + k * AT_STRIDE + m);
            }
#pragma unroll
            for (int jj = 0; jj < NT; jj += 2) {
                u32 b[4];
                int j = lane >> 3;
                int n = wn * WN + jj * 8 + (j >> 1) * 8 + (lane & 7);
                int k = kk + (j & 1) * 8;
                ldsm_x4(b, xs + n * XS + k);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    mma16816(acc[i][jj], a[i], b);
                    mma16816(acc[i][jj + 1], a[i], b + 2);
                }
            }
        }
        __syncthreads();
    }
    cp_wait<0>();

    // epilogue: c0,c1 -> (m = g, n = 2t, 2t+1), c2,c3 -> (m = g + 8, same n)
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            int m = tr * TILE_M + wm * 64 + i * 16 + g;
            int n = n0 + wn * WN + j * 8 + 2 * t;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                int mm = m + (q >> 1) * 8, nn = n + (q & 1);
                if (mm < M && nn < N) Y[(size_t)nn * M + mm] = f2h(acc[i][j][q]);
            }
        }
}

template __global__ void tcbc_spmm<128, 2, 1>(const u64*, const u32*, const u32*, const u16*, const u16*, u16*,
                                              int, int, int, int, int);
template __global__ void tcbc_spmm<64, 2, 2>(const u64*, const u32*, const u32*, const u16*, const u16*, u16*,
                                             int, int, int, int, int);
