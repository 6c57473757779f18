// IE-BME W4A4 / W2A4 SpMM for decode widths N <= 32 (SPEC section 7), tensor cores, sm_80+.
//
// Y[n, m] = sum_g s_w[m, g] * s_x[n, g] * sum_{k in g} q_w[m, k] * q_x[n, k]
//
// Geometry fixed to the default IE-BME layout: local tile 16 x 64, areas 2 x 2 (h = 8, w = 32, Q = 4),
// so the union mask of a tile is 8 x 32 bits = 32 segments of 8 bits: lane L of a warp owns segment L
// (mask row g = L / 4, bits 8t..8t+7 with t = L % 4), which is exactly the (groupID, threadID_in_group)
// of the m16n8k32 fragment layout. K order inside the tile: fragment column p of k-step c maps to tile
// column c*32 + sigma(p), sigma(4t + i) = 8t + i, sigma(16 + 4t + i) = 8t + 4 + i, so each lane's 8 mask
// bits are its own 8 A-fragment columns, and the same order read from X is one 8-byte load per lane.
//
// Schedule (DW-PC): a CTA of 4 warps owns 4 tile rows (64 output rows) and a K range (split-K). Warp 0
// is the producer: it issues cp.async copies of the next stage (S tiles per row: values, bitmaps,
// perms, the X slice and the scales of the groups touched) into a STAGES-deep ring, then rejoins as a
// consumer. Every warp decodes its tile row with LSPD (one masked popcount gives the rank that indexes
// all 4 area streams; a per-segment byte-permute table scatters the codes into fragment bytes with
// zeros at inactive positions), unpacks int4/int2 to int8 (the code in the high bits of each byte, so
// products are 16x / 64x and shifted back exactly) and issues mma.m16n8k32.s8.
//
// Per-tile row permutations: the tile's C fragment is in reordered-row order; it is added into a
// per-warp shared accumulator at the original rows perm[t][r] (identity layers keep C in registers).
// Scaling: at the end of every group (and of the CTA's K range) acc += (s_w * s_x) * float(partial),
// with round-to-nearest multiplies and add (no FMA), matching the CPU reference bit for bit when
// there is no split-K. DEBUG writes the exact int32 group partial sums instead (atomicAdd, exact).
// NVRTC (CuPy's run-time compiler) ships no C library headers: fixed-width types by hand
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef signed char int8_t;
typedef int int32_t;
typedef unsigned long long uint64_t;

#define DEVI __device__ __forceinline__

#ifndef IEBME_S
#define IEBME_S 4        // tiles per row per pipeline stage
#endif
#ifndef IEBME_STAGES
#define IEBME_STAGES 3   // ring depth
#endif

namespace iebme {

constexpr int S = IEBME_S;
constexpr int STAGES = IEBME_STAGES;
constexpr int WARPS = 4;

template <int BITS, int NT, bool PERM>
struct Layout {
  static constexpr int VB = 1024 * BITS / 8;          // max value bytes of one tile
  static constexpr int VROW = S * VB + 16;             // + pad: a window may read 4 bytes past the end
  static constexpr int NP = NT * 8;
  static constexpr int XS = S * 64 + 32;               // X row stride (bank-conflict-free 8-byte loads)
  static constexpr int BM_OFF = WARPS * VROW;
  static constexpr int PM_OFF = BM_OFF + WARPS * S * 32;
  static constexpr int X_OFF = PM_OFF + (PERM ? WARPS * S * 16 : 0);
  static constexpr int SW_OFF = X_OFF + NP * XS;
  static constexpr int SX_OFF = SW_OFF + S * 128;
  static constexpr int STAGE = SX_OFF + S * 128;
  static constexpr int TAB = 1024;
  static constexpr int ACC = PERM ? WARPS * 16 * NP * 4 : 0;
  static constexpr int TOTAL = TAB + ACC + STAGES * STAGE;
};

DEVI uint32_t sptr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
DEVI void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sptr(dst)), "l"(src));
}
DEVI void cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sptr(dst)), "l"(src));
}
DEVI void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
DEVI float h2f(uint16_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
DEVI uint16_t f2h(float f) { uint16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

DEVI void mma_s8(int c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Args {
  const uint8_t* values;     // packed b-bit codes
  const uint8_t* bitmaps;    // uint64 [T * 4] as bytes
  const uint32_t* offsets;   // [T + 1], in codes
  const uint8_t* perm;       // [T, 16] or null
  const uint16_t* wsT;       // fp16 weight scales, transposed [G, Mp64]
  const float* xs;           // fp32 activation scales [N, G]
  const int8_t* x;           // int8 activation codes [N, Kp]
  float* ws_acc;             // fp32 [32, Mp64] split-K workspace, zero between calls
  int* counters;             // [gridDim.x] split-K arrival counters, zero between calls
  uint16_t* y;               // fp16 [N, M]
  int* partial;              // int32 [N, M, G] (DEBUG), zeroed by the caller
  int N, M, G, Kp, Mp64, TR, TC, gs_tiles, chunk;
};

template <int BITS, int NT, bool PERM, bool DEBUG>
DEVI void spmm(const Args& a) {
  using L = Layout<BITS, NT, PERM>;
  constexpr int SHIFT = 8 - BITS;           // codes sit in the high bits of each int8
  constexpr int ALIGN = 128 / BITS;         // value segments start on 16-byte boundaries
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* tab = reinterpret_cast<uint32_t*>(smem);
  int* accs = reinterpret_cast<int*>(smem + L::TAB);
  uint8_t* ring = smem + L::TAB + L::ACC;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * WARPS;       // first tile row of this CTA
  const int kbeg = blockIdx.y * a.chunk;
  const int kend = min(kbeg + a.chunk, a.TC);
  const int tr = row0 + warp;
  const bool row_ok = tr < a.TR;

  // byte-permute selectors: output byte b of a segment = rank of bit b, or a zero byte when inactive
  for (int s = tid; s < 256; s += blockDim.x) {
    const int n = __popc(s);
    uint32_t sel = 0;
    int r = 0;
    for (int b = 0; b < 8; ++b) {
      const int idx = ((s >> b) & 1) ? r++ : n;
      const int byte = BITS == 4 ? ((idx & 1) * 4 + (idx >> 1)) : (2 * (idx & 3) + (idx >> 2));
      sel |= static_cast<uint32_t>(byte) << (4 * (b & 3) + 16 * (b >> 2));
    }
    tab[s] = sel;
  }
  if (PERM)
    for (int i = tid; i < WARPS * 16 * L::NP; i += blockDim.x) accs[i] = 0;

  // ---------------- producer (warp 0) ----------------
  uint32_t off_cur = 0, off_nxt = 0;
  auto load_offsets = [&](int s) -> uint32_t {
    const int k0 = kbeg + s * S;
    if (lane >= 8 || k0 >= kend) return 0u;
    const int k1 = min(k0 + S, kend);
    const int r = lane >> 1;
    if (row0 + r >= a.TR) return 0u;
    return __ldg(a.offsets + static_cast<size_t>(row0 + r) * a.TC + ((lane & 1) ? k1 : k0));
  };
  auto issue = [&](int s) {
    const int k0 = kbeg + s * S;
    const uint32_t mine = off_cur;
    off_cur = off_nxt;
    if (k0 < kend) {
      off_nxt = load_offsets(s + 2);
      uint8_t* st = ring + (s % STAGES) * L::STAGE;
      const int k1 = min(k0 + S, kend), ns = k1 - k0;
#pragma unroll
      for (int r = 0; r < WARPS; ++r) {
        const uint32_t o0 = __shfl_sync(0xffffffffu, mine, 2 * r);
        const uint32_t o1 = __shfl_sync(0xffffffffu, mine, 2 * r + 1);
        if (row0 + r >= a.TR) continue;
        const size_t t0 = static_cast<size_t>(row0 + r) * a.TC + k0;
        const size_t b0 = static_cast<size_t>(o0) * BITS / 8;
        const int nch = static_cast<int>((static_cast<size_t>(o1) * BITS / 8 - b0) / 16);
        for (int c = lane; c < nch; c += 32) cp16(st + r * L::VROW + 16 * c, a.values + b0 + 16 * c);
        for (int c = lane; c < 2 * ns; c += 32) cp16(st + L::BM_OFF + r * S * 32 + 16 * c, a.bitmaps + t0 * 32 + 16 * c);
        if (PERM)
          for (int c = lane; c < ns; c += 32) cp16(st + L::PM_OFF + r * S * 16 + 16 * c, a.perm + t0 * 16 + 16 * c);
      }
      const int xch = ns * 4;
      for (int i = lane; i < a.N * xch; i += 32) {
        const int n = i / xch, c = i - n * xch;
        cp16(st + L::X_OFF + n * L::XS + 16 * c, a.x + static_cast<size_t>(n) * a.Kp + k0 * 64 + 16 * c);
      }
      if (!DEBUG) {
        const int ga = k0 / a.gs_tiles, ngr = (k1 - 1) / a.gs_tiles - ga + 1;
        for (int i = lane; i < ngr * 8; i += 32) {
          const int gi = i >> 3, c = i & 7;
          cp16(st + L::SW_OFF + gi * 128 + 16 * c,
               a.wsT + static_cast<size_t>(ga + gi) * a.Mp64 + blockIdx.x * 64 + 8 * c);
        }
        for (int i = lane; i < ngr * a.N; i += 32) {
          const int gi = i / a.N, n = i - gi * a.N;
          cp4(st + L::SX_OFF + gi * 128 + 4 * n, a.xs + static_cast<size_t>(n) * a.G + ga + gi);
        }
      }
    }
    cp_commit();
  };

  const int nst = (kend - kbeg + S - 1) / S;
  if (warp == 0) {
    off_cur = load_offsets(0);
    off_nxt = load_offsets(1);
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
  }

  // ---------------- consumer state ----------------
  int acc[NT][4];
  float yv[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) { acc[j][i] = 0; yv[j][i] = 0.f; }
  const int sh8 = 8 * (lane & 3);                        // my segment's bit offset in mask word lane / 4
  const uint32_t lomask = (1u << sh8) - 1u;
  int* myacc = accs + warp * 16 * L::NP;

  for (int it = 0; it < nst; ++it) {
    if (warp == 0) cp_wait<STAGES - 2>();
    __syncthreads();
    if (warp == 0) issue(it + STAGES - 1);
    if (!row_ok) continue;
    const uint8_t* st = ring + (it % STAGES) * L::STAGE;
    const uint32_t* vals = reinterpret_cast<const uint32_t*>(st + warp * L::VROW);
    const uint8_t* bms = st + L::BM_OFF + warp * S * 32;
    const uint8_t* xsm = st + L::X_OFF;
    const int k0 = kbeg + it * S, ns = min(S, kend - k0);
    const int g0 = k0 / a.gs_tiles;
    int vb = 0;
    for (int j = 0; j < ns; ++j) {
      // ---- LSPD: ranks from the union bitmap ----
      const uint32_t* bw = reinterpret_cast<const uint32_t*>(bms + 32 * j);
      const uint4 lo = *reinterpret_cast<const uint4*>(bw);
      const uint4 hi = *reinterpret_cast<const uint4*>(bw + 4);
      const int p0 = __popc(lo.x), p1 = __popc(lo.y), p2 = __popc(lo.z), p3 = __popc(lo.w);
      const int p4 = __popc(hi.x), p5 = __popc(hi.y), p6 = __popc(hi.z), p7 = __popc(hi.w);
      const int P = p0 + p1 + p2 + p3 + p4 + p5 + p6 + p7;
      const uint32_t myword = bw[lane >> 2];
      int base = (lane >= 4 ? p0 : 0) + (lane >= 8 ? p1 : 0) + (lane >= 12 ? p2 : 0) + (lane >= 16 ? p3 : 0) +
                 (lane >= 20 ? p4 : 0) + (lane >= 24 ? p5 : 0) + (lane >= 28 ? p6 : 0);
      const int pre = base + __popc(myword & lomask);
      const uint32_t seg = (myword >> sh8) & 0xffu;
      const int n = __popc(seg);
      const uint32_t nmask = BITS == 4 ? (n ? (0xffffffffu >> (32 - 4 * n)) : 0u) : ((1u << (2 * n)) - 1u);
      const uint32_t sel = tab[seg];
      uint32_t flo[4], fhi[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int v = vb + q * P + pre;
        const int w = BITS == 4 ? (v >> 3) : (v >> 4);
        const int sh = BITS == 4 ? ((v & 7) * 4) : ((v & 15) * 2);
        const uint32_t win = __funnelshift_r(vals[w], vals[w + 1], sh) & nmask;
        uint32_t e, o;
        if (BITS == 4) {
          e = (win << 4) & 0xf0f0f0f0u;
          o = win & 0xf0f0f0f0u;
        } else {
          e = ((win << 6) & 0xc0c0u) | ((win << 20) & 0xc0c00000u);
          o = ((win << 2) & 0xc0c0u) | ((win << 16) & 0xc0c00000u);
        }
        flo[q] = __byte_perm(e, o, sel & 0xffffu);
        fhi[q] = __byte_perm(e, o, sel >> 16);
      }
      vb += (4 * P + ALIGN - 1) / ALIGN * ALIGN;
      // ---- tensor cores: 2 k-steps (area columns) x NT n-tiles ----
      int c[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = PERM ? 0 : acc[nt][i];
#pragma unroll
      for (int cs = 0; cs < 2; ++cs) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2 b = *reinterpret_cast<const uint2*>(xsm + (nt * 8 + g) * L::XS + j * 64 + cs * 32 + 8 * t);
          mma_s8(c[nt], flo[cs], flo[2 + cs], fhi[cs], fhi[2 + cs], b.x, b.y);
        }
      }
      if (PERM) {
        const uint8_t* pm = st + L::PM_OFF + warp * S * 16 + 16 * j;
        const int r0 = pm[g] & 15, r1 = pm[g + 8] & 15;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          int2* d0 = reinterpret_cast<int2*>(myacc + r0 * L::NP + nt * 8 + 2 * t);
          int2* d1 = reinterpret_cast<int2*>(myacc + r1 * L::NP + nt * 8 + 2 * t);
          int2 v0 = *d0, v1 = *d1;
          v0.x += c[nt][0]; v0.y += c[nt][1]; v1.x += c[nt][2]; v1.y += c[nt][3];
          *d0 = v0; *d1 = v1;
        }
        __syncwarp();
      } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[nt][i] = c[nt][i];
      }
      // ---- end of a group (or of this CTA's K range): scale and accumulate ----
      const int k = k0 + j;
      if (k + 1 == kend || (k + 1) % a.gs_tiles == 0) {
        const int grp = k / a.gs_tiles, slot = grp - g0;
        const uint16_t* sws = reinterpret_cast<const uint16_t*>(st + L::SW_OFF + slot * 128);
        const float* sxs = reinterpret_cast<const float*>(st + L::SX_OFF + slot * 128);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int rl = g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
            int v;
            if (PERM) {
              v = myacc[rl * L::NP + col];
              myacc[rl * L::NP + col] = 0;
            } else {
              v = acc[nt][i];
              acc[nt][i] = 0;
            }
            v >>= SHIFT;
            if (DEBUG) {
              const int row = tr * 16 + rl;
              if (row < a.M && col < a.N) atomicAdd(a.partial + (static_cast<size_t>(col) * a.M + row) * a.G + grp, v);
            } else {
              const float s = __fmul_rn(h2f(sws[warp * 16 + rl]), sxs[col]);
              yv[nt][i] = __fadd_rn(yv[nt][i], __fmul_rn(s, static_cast<float>(v)));
            }
          }
        }
        if (PERM) __syncwarp();
      }
    }
  }
  cp_wait<0>();
  if (DEBUG) return;

  // ---------------- output ----------------
  if (gridDim.y == 1) {
    if (row_ok) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
          if (row < a.M && col < a.N) a.y[static_cast<size_t>(col) * a.M + row] = f2h(yv[nt][i]);
        }
    }
    return;
  }
  if (row_ok) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
        if (col < a.N) atomicAdd(a.ws_acc + static_cast<size_t>(col) * a.Mp64 + row, yv[nt][i]);
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) last = atomicAdd(a.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = tid; i < 64 * a.N; i += blockDim.x) {
    const int col = i / 64, row = blockIdx.x * 64 + (i & 63);
    float* p = a.ws_acc + static_cast<size_t>(col) * a.Mp64 + row;
    const float v = __ldcg(p);
    *p = 0.f;
    if (row < a.M) a.y[static_cast<size_t>(col) * a.M + row] = f2h(v);
  }
  if (tid == 0) a.counters[blockIdx.x] = 0;
}

}  // namespace iebme

// C entry points (one per variant, flat arguments) so CuPy can launch them by plain name.
#define IEBME_ENTRY(B, NT, P, D)                                                                          \
  extern "C" __global__ void __launch_bounds__(128) iebme_spmm_w##B##_nt##NT##_p##P##_d##D(              \
      const uint8_t* values, const uint8_t* bitmaps, const uint32_t* offsets, const uint8_t* perm,       \
      const uint16_t* wsT, const float* xs, const int8_t* x, float* ws_acc, int* counters, uint16_t* y,  \
      int* partial, int N, int M, int G, int Kp, int Mp64, int TR, int TC, int gs_tiles, int chunk) {    \
    const iebme::Args a{values, bitmaps, offsets, perm, wsT, xs, x, ws_acc, counters, y, partial,        \
                        N, M, G, Kp, Mp64, TR, TC, gs_tiles, chunk};                                     \
    iebme::spmm<B, NT, P, D>(a);                                                                          \
  }

// Instantiations are appended by iebme_spmm.py (one per compiled variant), e.g. IEBME_ENTRY(4, 1, 0, 0)
