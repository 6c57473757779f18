// IE-BME W4A4 / W2A4 SpMM for decode widths N <= 32 (docs/kernels.md), tensor cores, sm_80+.
//
// Y[n, m] = sum_g s_w[m, g] * s_x[n, g] * sum_{k in g} q_w[m, k] * q_x[n, k]
//
// Geometry fixed to the default IE-BME layout: local tile 16 x 64, areas 2 x 2 (h = 8, w = 32, Q = 4),
// so the union mask of a tile is 8 x 32 bits = 32 segments of 8 bits. Lane L = 4 g + t of a warp owns
// segment L (mask row g, bits 8t..8t+7): one masked popcount gives its rank, which indexes all four area
// streams (LSPD). K order inside the tile: fragment column p of k-step c is tile column c*32 + sigma(p),
// sigma(4t + i) = 8t + i, sigma(16 + 4t + i) = 8t + 4 + i, so a segment's 8 positions are exactly one
// lane's 8 A-fragment bytes of m16n8k32, and the same order read from X is one 8-byte load per lane.
//
// Schedule (v5; earlier versions in docs/kernels.md): a CTA of WARPS warps owns WARPS tile rows x one K chunk. The CTA
// stages the chunk's X codes (sm_90: one bulk copy per row on an mbarrier) and activation scales in shared memory once;
// its one barrier waits on no memory access (the loads the first batch needs are issued before any ring copy). After
// that every warp runs alone: it is its own producer, streaming its tile row's contiguous value bytes through a private
// NSTAGE-deep ring of BT-tile batches (sm_90: one cp.async.bulk per batch by an elect.sync lane, one mbarrier per slot;
// older GPUs or IEBME_TMA=0: cp.async by every lane, wait_group + __syncwarp), and its own consumer; no CTA barrier.
// Batch boundaries come from one register of byte offsets per lane, loaded once, so copies never wait on metadata. A
// batch's bitmap words (and inverse perms) are not copied through the ring: each lane loads its word straight into a
// register, two batches ahead, with lane 4w + j holding mask row w of tile j, so the per-tile metadata shuffles have
// constant sources (width 4) and the batch's ranks, stream lengths and tile starts take 3 + 1 + 2 shuffles (scans with
// the shuffle's own in-range predicate). The last batch is padded to BT tiles: missing tiles get zero words (so decode
// zeros) and zeroed X columns, so the tile loop has no per-tile bounds test. Per mask byte, one 16-byte table entry
// (LDS.128) holds both byte-permute selectors and both code masks of the decode.
//
// Per-tile row permutations are applied on the A side: fragment row r of the mma is output row r; lane
// (g, t) fetches, with one shuffle per row, the (word, rank) of the mask row that holds reordered row
// pinv[r] and decodes that row's two area streams. C stays in registers in original row order for the
// whole group, so a permutation costs two byte loads per batch, three shuffles and a second table lookup
// per tile.
//
// int4/int2 codes are unpacked to int8 with the code in the high bits of each byte (products are
// 16x / 64x the true ones; the factor 2^-SHIFT is folded into the staged activation scales, exactly):
// on sm_90 the s4 mma is emulated and ~20x slower than s8. Scaling at the end of every group (and of the
// chunk): acc += (s_w * s_x) * float(partial) with round-to-nearest multiplies and add (no FMA), matching
// the CPU reference bit for bit without split-K. Split-K: the CTAs of a row block add their fp32 partial
// outputs in a global workspace (atomics, the last CTA writes Y), or, when they form one thread-block
// cluster (a launch attribute, sm_90), through distributed shared memory in split order. DEBUG writes the
// exact int32 group partial sums instead (atomicAdd, exact).
// AF16 (W4A16 / W2A16: float16 activations, no activation quantization): X is staged as float16 [N, Kp], a lane's
// 8 decoded int8 codes become four exact half2 (offset binary into the low byte of 1024 + u, one sub.f16x2), and
// each 32-column half of a tile is two m16n8k16 f16 mma (float32 accumulators) instead of one s8 mma, with the
// same segment order (code i of a lane's segment in k-slots 2t, 2t+1, 2t+8, 2t+9 of steps 0 and 1, as X is read);
// a group's float32 sum is scaled by the weight scale times 2^-SHIFT (exact) alone. No outlier side, no DEBUG.
// NVRTC (CuPy's run-time compiler) ships no C library headers: fixed-width types by hand
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef signed char int8_t;
typedef int int32_t;
typedef unsigned long long uint64_t;

#define DEVI __device__ __forceinline__

#include "pdl.cuh"
#include "cluster.cuh"

#ifndef IEBME_NSTAGE
#define IEBME_NSTAGE 3   // batches in each warp's ring
#endif
#ifndef IEBME_WARPS
#define IEBME_WARPS 8    // tile rows (warps) per CTA
#endif
#ifndef IEBME_ILP
#define IEBME_ILP 2      // tiles decoded back to back before their mma
#endif
#ifndef IEBME_MINB
#define IEBME_MINB 0     // min CTAs per SM asked of the register allocator (0: no bound)
#endif
#ifndef IEBME_TRACE      // 1: thread 0 of each CTA writes %globaltimer at entry, after the prologue, after its
#define IEBME_TRACE 0    // warp's loop and at exit, and %smid, to u64 [CTA][5] passed as `partial` (timing study)
#endif
#ifndef IEBME_PDL        // 1: built for programmatic dependent launch (see PDL below)
#define IEBME_PDL 0
#endif
#ifndef IEBME_SIDE_LAST  // 1: the last K chunk's CTA adds the outlier side product (often the shortest chunk, so the
#define IEBME_SIDE_LAST 0 // side hides behind its partners' longer loops); 0: the first K chunk's CTA
#endif
#if IEBME_SIDE_LAST       // whether this CTA adds the side (evaluated where used: special registers, no live value)
#define IEBME_SIDE_CTA (blockIdx.y == gridDim.y - 1)
#else
#define IEBME_SIDE_CTA (blockIdx.y == 0)
#endif
#ifndef IEBME_TRIGGER    // 1: with PDL, let the next kernel be scheduled once every CTA's weight stream has landed
#define IEBME_TRIGGER 1  // (its epilogue and tail overlap the next one's start; docs/kernels.md); 0: at completion
#endif
#ifndef IEBME_TMA        // ring copies by cp.async.bulk (one lane, mbarrier) on sm_90; cp.async below
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define IEBME_TMA 1
#else
#define IEBME_TMA 0
#endif
#endif

namespace iebme {

constexpr int BT = 4;             // tiles per batch: their 4 x 8 bitmap words are one word per lane
constexpr int NSTAGE = IEBME_NSTAGE;
constexpr int WARPS = IEBME_WARPS;
constexpr int ILP = IEBME_ILP;
constexpr int MAX_BATCHES = 31;  // batch boundaries live in one register per lane (boundary j in lane j)
static_assert(MAX_BATCHES < 32, "boundary MAX_BATCHES (the chunk's end) must fit in lane MAX_BATCHES");
constexpr bool TMA = IEBME_TMA;
// Programmatic dependent launch (sm_90, launched with the attribute by iebme_spmm.py): the prologue's weight-only
// loads and first ring copies run while the kernel before it (the producer of X) still runs; the wait comes
// before the first read of anything that kernel writes (X, its scales, the side codes). Needs the bulk-copy ring.
constexpr bool PDL = IEBME_PDL && IEBME_TMA;


// Loads of what the producer writes (X's scales, the side codes and scales): after the wait with PDL
// (pdl.cuh: __ldg there was hoisted above it), read-only loads without.
template <class T>
DEVI T ld_produced(const T* p) {
  if constexpr (PDL) return ld_after_wait(p);
  else return __ldg(p);
}

// A warp's ring holds value bytes only (bitmaps and inverse perms go to registers); mirrors ring_bytes() in
// iebme_spmm.py, which sizes the dynamic shared memory.
template <int BITS>
struct Ring {
  static constexpr int VB = 1024 * BITS / 8;         // max value bytes of one tile
  static constexpr int SLOT = BT * VB + 16;           // + 16: a window reads one word past the end
  static constexpr int WARP_BYTES = NSTAGE * SLOT;
  static constexpr int BYTES = WARPS * WARP_BYTES;    // X and its scales follow
};

DEVI uint32_t sptr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
DEVI void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sptr(dst)), "l"(src));
}
DEVI void cp16s(uint32_t dst, const void* src) {  // dst: shared-window address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
DEVI void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
DEVI uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {  // selector bits 15..0 only, no masking
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
DEVI void mbar_init(uint32_t bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar)); }
DEVI void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Metadata shuffles. Lane 4w + j holds mask row w of tile j (see spmm); shfl_tile reads lane (lane & ~3) | j.
DEVI uint32_t shfl_tile(uint32_t v, int j) { return __shfl_sync(0xffffffffu, v, j, 4); }
// One step of an inclusive warp scan: shuffle-up by D with its in-range predicate (c operand C: 0 = the
// whole warp, 0x1c00 = 4-lane segments), so the add needs no lane test.
template <int D, int C>
DEVI void scan_up(uint32_t& v) {
  asm volatile("{\n .reg .u32 u;\n .reg .pred p;\n shfl.sync.up.b32 u|p, %0, %1, %2, 0xffffffff;\n"
               " @p add.u32 %0, %0, u;\n}\n" : "+r"(v) : "n"(D), "n"(C));
}
// Inclusive sum over lanes w' <= w of the same tile (lanes lane, lane - 4, ...).
DEVI int scan_rows(int v) {
  uint32_t u = static_cast<uint32_t>(v);
  scan_up<4, 0>(u);
  scan_up<8, 0>(u);
  scan_up<16, 0>(u);
  return static_cast<int>(u);
}
// Inclusive sum over tiles j' <= j of the same row (lanes of one 4-lane segment).
DEVI uint32_t scan_tiles(uint32_t v) {
  scan_up<1, 0x1c00>(v);
  scan_up<2, 0x1c00>(v);
  return v;
}
// The value of lane 28 | (lane & 3): mask row 7 of this lane's tile (segmask 0x03, source lane 28).
DEVI int last_row(int v) {
  int r;
  asm volatile("shfl.sync.idx.b32 %0, %1, 28, 0x31f, 0xffffffff;\n" : "=r"(r) : "r"(v));
  return r;
}
template <int NT>
DEVI void zero_acc(int (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0;
}
DEVI uint4 lds128(uint32_t addr) {  // shared::cta address; the table is written before the CTA barrier
  uint4 v;
  asm("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
DEVI uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
DEVI float h2f(uint16_t h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
DEVI uint16_t f2h(float f) { uint16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

DEVI void mma_f16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four signed bytes v_i (a code times 2^SHIFT) as two half2 (v0, v1) and (v2, v3), exactly: the offset-binary byte
// u = v + 128 in the low byte of the half 1024 + u (0x64 in the high byte), minus 1152.
DEVI void to_half2(uint32_t w, uint32_t& h01, uint32_t& h23) {
  const uint32_t u = w ^ 0x80808080u;
  const uint32_t a = prmt(u, 0x64646464u, 0x4140u), b = prmt(u, 0x64646464u, 0x4342u);
  asm("sub.f16x2 %0, %1, %2;" : "=r"(h01) : "r"(a), "r"(0x64806480u));
  asm("sub.f16x2 %0, %1, %2;" : "=r"(h23) : "r"(b), "r"(0x64806480u));
}

DEVI void mma_s8(int c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Args {
  const uint8_t* values;     // packed b-bit codes (+16 B tail)
  const uint8_t* bitmaps;    // uint64 [T * 4] as bytes
  const uint32_t* offsets;   // [T + 1], in codes
  const uint8_t* pinv;       // [T, 16] inverse perms (pinv[perm[r]] = r) or null
  const uint16_t* wsT;       // fp16 weight scales, transposed [G, Mp]
  const float* xs;           // fp32 activation scales [N, G]
  const int8_t* x;           // int8 activation codes [N, Kp]
  float* ws_acc;             // fp32 [32, Mp] split-K workspace, zero between calls
  int* counters;             // [gridDim.x] split-K arrival counters, zero between calls
  uint16_t* y;               // fp16 [N, M]
  int* partial;              // int32 [N, M, G] (DEBUG), zeroed by the caller
  const int8_t* side_x;      // 8-bit outlier side (ns = 0: none): activation codes [N, ns]
  const float* side_xs;      //   their scales [N, SG]
  const int8_t* side_w;      //   weight codes [M, ns], rows 16-byte aligned
  const float* side_ws;      //   weight scales [M, SG]
  int N, M, G, Kp, Mp, TR, TC, gs_tiles, chunk, ns, sgs;
};

DEVI int dp4a(int a, int b, int c) {  // c + the dot product of a's and b's four signed bytes
  int d;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// v plus the 8-bit outlier side product of output (row, col), in float32, side groups in order:
// v = v + (s_x * s_w) * dot, each product and the add rounded once, the dot exact (16-byte chunks, dp4a).
// ns is a multiple of 16 and there is one side group or groups of whole chunks (iebme_spmm.side_fusable).
DEVI float add_side(const Args& a, int row, int col, float v) {
  const int4* w4 = reinterpret_cast<const int4*>(a.side_w + static_cast<size_t>(row) * a.ns);
  const int4* x4 = reinterpret_cast<const int4*>(a.side_x + static_cast<size_t>(col) * a.ns);
  const int nc = a.ns >> 4, sg = (a.ns + a.sgs - 1) / a.sgs, cg = sg == 1 ? nc : a.sgs >> 4;
  for (int j = 0; j < sg; ++j) {
    int dot = 0;
    for (int c = j * cg; c < min((j + 1) * cg, nc); ++c) {
      const int4 w = __ldg(w4 + c), x = ld_produced(x4 + c);
      dot = dp4a(w.w, x.w, dp4a(w.z, x.z, dp4a(w.y, x.y, dp4a(w.x, x.x, dot))));
    }
    const float s = __fmul_rn(ld_produced(a.side_xs + static_cast<size_t>(col) * sg + j),
                              __ldg(a.side_ws + static_cast<size_t>(row) * sg + j));
    v = __fadd_rn(v, __fmul_rn(s, static_cast<float>(dot)));
  }
  return v;
}

// One lane's 8 codes of one area stream, as two int8x4 fragment registers (code in the high bits),
// zeros at inactive positions. vbit: bit offset of the segment's first code inside the slot; e: the
// segment's table entry (x, y: byte-permute selectors of output codes 0-3 / 4-7; z, w: the even / odd
// code masks of count_masks, so masking costs no extra op).
template <int BITS>
DEVI void decode_window(const uint32_t* vals, uint32_t vbit, const uint4& e, uint32_t& lo, uint32_t& hi) {
  const uint32_t* p = vals + (vbit >> 5);
  // funnel shifts take the shift amount mod 32
  const uint32_t win = __funnelshift_r(p[0], p[1], vbit);
  uint32_t ev, od;
  if (BITS == 4) {
    ev = (win << 4) & e.z;
    od = win & e.w;
  } else {
    ev = (((win << 6) & 0xc0c0u) | ((win << 20) & 0xc0c00000u)) & e.z;
    od = (((win << 2) & 0xc0c0u) | ((win << 16) & 0xc0c00000u)) & e.w;
  }
  lo = prmt(ev, od, e.x);
  hi = prmt(ev, od, e.y);
}

// Masks keeping the first n codes of a window, split into the even / odd codes as unpacked to the high
// bits of bytes (int4: even code c -> bits 8(c/2)+4..; int2: even code -> bits 8(c/2)+6..).
template <int BITS>
DEVI void count_masks(int n, uint32_t& me, uint32_t& mo) {
  if (BITS == 4) {
    const uint32_t m = n ? (0xffffffffu >> (32 - 4 * n)) : 0u;  // n nibbles
    me = (m << 4) & 0xf0f0f0f0u;
    mo = m & 0xf0f0f0f0u;
  } else {
    const uint32_t m = (1u << (2 * n)) - 1u;                      // n 2-bit codes (n <= 8: 16 bits)
    me = ((m << 6) & 0xc0c0u) | ((m << 20) & 0xc0c00000u);
    mo = ((m << 2) & 0xc0c0u) | ((m << 16) & 0xc0c00000u);
  }
}

template <int BITS, int NT, bool PERM, bool DEBUG, bool AF16 = false>
DEVI void spmm(const Args& a) {
  static_assert(!(AF16 && DEBUG), "float16 activations have no integer partial sums");
  using R = Ring<BITS>;
  constexpr int SHIFT = 8 - BITS;           // codes sit in the high bits of each int8
  constexpr int XB = AF16 ? 2 : 1;          // bytes of one activation in X
  extern __shared__ __align__(16) uint8_t smem[];
  // per mask byte: byte-permute selectors of output codes 0-3 and 4-7, even / odd code masks (count_masks)
  __shared__ uint4 tab[256];
  __shared__ __align__(8) uint64_t bars[TMA ? WARPS * NSTAGE + 1 : 1];  // one per ring slot, one for X

  constexpr bool TRACE = IEBME_TRACE && !DEBUG;
  uint64_t tt[3] = {0, 0, 0};
  if (TRACE) tt[0] = gtimer();
  // No allow_dependents() here: the next IE-BME launch (two launches later) would then be scheduled while this one
  // still streams, and the whole-step A/B lost 2.5% with it; it comes once the CTA's weights have landed
  // (IEBME_TRIGGER, after the main loop; docs/kernels.md, programmatic dependent launch).
  // trace: thread 0 records its exit (every return below goes through here)
  auto trace_exit = [&]() {
    if (TRACE && threadIdx.x == 0) {
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      uint64_t* o = reinterpret_cast<uint64_t*>(a.partial) + 5 * (blockIdx.y * gridDim.x + blockIdx.x);
      o[0] = tt[0]; o[1] = tt[1]; o[2] = tt[2]; o[3] = gtimer(); o[4] = sm;
    }
  };
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;   // mma fragment position; in the metadata layout: mask row, tile
  const int tr = blockIdx.x * WARPS + warp;
  const bool active = tr < a.TR;
  const int k0 = blockIdx.y * a.chunk;
  const int k1 = min(k0 + a.chunk, a.TC);
  const int nk = k1 - k0;
  const int nb = (nk + BT - 1) / BT;
  const int ga0 = k0 / a.gs_tiles;                       // first group of the chunk
  const int ngc = (k1 - 1) / a.gs_tiles - ga0 + 1;       // groups touched by the chunk
  // X row stride: whole batches (the last batch's padding columns are zeroed), and = 32 mod 128 bytes so
  // the 8-byte fragment loads are conflict-free; the same formula as x_stride() in iebme_spmm.py
  const int xs_stride = (nb * BT * 64 + 32) * XB;  // x_stride() in iebme_spmm.py
  int8_t* xsm = reinterpret_cast<int8_t*>(smem + R::BYTES);
  float* sxs = reinterpret_cast<float*>(smem + R::BYTES + a.N * xs_stride);  // 8-byte aligned
  const int nxs = DEBUG || AF16 ? 0 : ngc * NT * 8;
  // The outlier side's activation codes [N, ns] and scales [N] (one side group), staged with X by the CTAs that
  // add the side (IEBME_SIDE_CTA), so the epilogue reads them from shared memory: 16-byte aligned after the
  // scales; mirrors smem_bytes(side=) in iebme_spmm.py
  const bool side_staged = !DEBUG && !AF16 && a.ns > 0 && a.sgs >= a.ns && IEBME_SIDE_CTA;
  int8_t* ssx = reinterpret_cast<int8_t*>(smem + ((R::BYTES + a.N * xs_stride + 4 * nxs + 15) & ~15));
  float* ssxs = reinterpret_cast<float*>(ssx + a.N * a.ns);
  const uint32_t* smw = reinterpret_cast<const uint32_t*>(smem);               // the ring, as words
  uint32_t ring_off = warp * R::WARP_BYTES;                              // this warp's ring in smem
  uint32_t ring_s = sptr(smem) + ring_off;
  uint32_t bar_s = sptr(bars + (TMA ? warp * NSTAGE : 0));
  const uint32_t xbar_s = sptr(bars + (TMA ? WARPS * NSTAGE : 0));
  const size_t row_t0 = static_cast<size_t>(tr) * a.TC;

  // ---------------- prologue ----------------
  // The loads the first batch needs and that depend on nothing are issued first, before any ring copy
  // (which waits for the offsets): once the ring copies flood the memory system, a load queues behind
  // them (measured with benchmarks/trace_iebme.py). The CTA barrier then waits on no memory
  // access: X arrives on an mbarrier (sm_90) that each warp waits on just before its loop.
  // activation scales [group][NT * 8] times 2^-SHIFT (see the group end), zero past N: XS_REG per thread
  // into registers now, stored to shared memory after the table (the rest, rare, synchronously there)
  constexpr int XS_REG = 4, NTHR = WARPS * 32;
  float xsv[XS_REG];
  auto load_xs = [&]() {
#pragma unroll
    for (int q = 0; q < XS_REG; ++q) {
      const int i = tid + q * NTHR, j = i / (NT * 8), n = i - j * (NT * 8);
      xsv[q] = i < nxs && n < a.N ? ld_produced(a.xs + static_cast<size_t>(n) * a.G + ga0 + j) : 0.f;
    }
  };
  float ssxv = 0.f;  // the side's activation scale of row tid (staged with the X scales)
  auto load_side_xs = [&]() {
    if (side_staged && tid < a.N) ssxv = ld_produced(a.side_xs + tid);
  };
  if (!PDL) { load_xs(); load_side_xs(); }
  // batch boundaries: lane j holds the value byte offset of batch j's first tile (<= MAX_BATCHES batches);
  // offsets are segment starts (16-byte aligned, so multiples of 8 codes): (o >> 3) * BITS is exact
  uint32_t boff = 0;
  if (active && lane <= nb) boff = (__ldg(a.offsets + row_t0 + min(k0 + BT * lane, k1)) >> 3) * BITS;
  // Metadata layout: lane 4w + j (w = lane >> 2 = g, j = lane & 3 = t) holds bitmap word w (mask row w) of
  // tile j of a batch, so the lane (g, t) that decodes mask row g of tile j reads lane (lane & ~3) | j:
  // a width-4 shuffle with a constant source. Bitmap words (and inverse perms) come straight from global
  // memory into registers, two batches ahead (w0: the next batch, w1: the one after); tiles past the
  // chunk's end get zero words.
  const uint32_t* bmp = reinterpret_cast<const uint32_t*>(a.bitmaps) + (row_t0 + k0 + t) * 8 + g;
  const uint8_t* pmp = PERM ? a.pinv + (row_t0 + k0 + t) * 16 + g : nullptr;
  int tl = nk - t;                             // tiles from this lane's tile of the current batch on
  uint32_t w0 = 0, w1 = 0, r0 = 0, r1 = 0;
  if (active && tl > 0) {
    w0 = __ldg(bmp);
    if (PERM) r0 = __ldg(pmp) | (static_cast<uint32_t>(__ldg(pmp + 8)) << 8);
  }
  if (active && tl > BT) {
    w1 = __ldg(bmp + BT * 8);
    if (PERM) r1 = __ldg(pmp + BT * 16) | (static_cast<uint32_t>(__ldg(pmp + BT * 16 + 8)) << 8);
  }
  // this group's weight scales for output rows g and g + 8, loaded one group ahead
  int grp = ga0;                               // group of the next tile
  const uint16_t* wsp = a.wsT + static_cast<size_t>(grp) * a.Mp + tr * 16 + g;
  uint16_t sw0 = 0, sw1 = 0;
  if (!DEBUG && active) { sw0 = __ldg(wsp); sw1 = __ldg(wsp + 8); }
  // the outlier side's weight codes of this warp's 16 rows, to L2 for the epilogue (lines of 128 bytes)
  if (!DEBUG && !AF16 && a.ns > 0 && IEBME_SIDE_CTA && active)
    for (int l = lane; l < 16 * ((a.ns + 127) >> 7); l += 32) {
      const int row = min(tr * 16 + (l & 15), a.M - 1);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(a.side_w + static_cast<size_t>(row) * a.ns + (l >> 4) * 128));
    }
  // X chunk: sm_90, one bulk copy per row (lanes n < N of warp 0) on the X mbarrier; else cp.async
  if (TMA) {
    if (lane == 0) {
      if (warp == 0) mbar_init(xbar_s);
      for (int s = 0; s < NSTAGE; ++s) mbar_init(bar_s + 8 * s);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
  }
  auto copy_x = [&]() {
  if (TMA) {
    if (warp == 0) {
      const uint32_t rowb = static_cast<uint32_t>(nk) * 64 * XB, sideb = side_staged ? a.ns : 0;
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                     ::"r"(xbar_s), "r"((rowb + sideb) * static_cast<uint32_t>(a.N)) : "memory");
      __syncwarp();
      if (lane < a.N) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(sptr(xsm + lane * xs_stride)), "l"(a.x + (static_cast<size_t>(lane) * a.Kp + k0 * 64) * XB),
                     "r"(rowb), "r"(xbar_s) : "memory");
        if (side_staged)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                       ::"r"(sptr(ssx + lane * a.ns)), "l"(a.side_x + static_cast<size_t>(lane) * a.ns), "r"(sideb),
                       "r"(xbar_s) : "memory");
      }
    }
  } else {
    for (int n = 0; n < a.N; ++n)
      for (int c = tid; c < nk * 4 * XB; c += NTHR)
        cp16(xsm + n * xs_stride + 16 * c, a.x + (static_cast<size_t>(n) * a.Kp + k0 * 64) * XB + 16 * c);
    if (side_staged)
      for (int c = tid; c < a.N * (a.ns >> 4); c += NTHR) cp16(ssx + 16 * c, a.side_x + 16 * c);
    cp_commit();
  }
  };
  if (!PDL) copy_x();

  // copy batch bi's value bytes (BT tiles, or fewer at the chunk's end) into ring slot si = bi % NSTAGE,
  // if bi < nbi (nbi: the warp's batch count, 0 for an inactive warp). Branch-free: every lane shuffles.
  auto issue = [&](int bi, int si, int nbi) {
    const uint32_t o0 = __shfl_sync(0xffffffffu, boff, bi);       // lanes bi, bi + 1: the batch's bounds
    const uint32_t o1 = __shfl_sync(0xffffffffu, boff, bi + 1);
    const uint32_t slot = ring_s + si * R::SLOT, vbytes = o1 - o0;
    const uint8_t* src = a.values + o0;
    if (TMA) {
      // one elected lane: expect the bytes on the slot's mbarrier, then one bulk copy (none if empty)
      asm volatile(
          "{\n .reg .pred e, z;\n elect.sync _|e, 0xffffffff;\n setp.lt.and.s32 e, %4, %5, e;\n"
          " @e mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n setp.ne.and.u32 z, %1, 0, e;\n"
          " @z cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %1, [%0];\n}\n"
          ::"r"(bar_s + 8 * si), "r"(vbytes), "r"(slot), "l"(src), "r"(bi), "r"(nbi) : "memory");
    } else {
      if (bi < nbi) {
        const int nch = static_cast<int>(vbytes / 16);
#pragma unroll
        for (int i = 0; i < BT * R::VB / 16 / 32; ++i) {  // fixed count, predicated: no loop to branch on
          const int c = lane + 32 * i;
          if (c < nch) cp16s(slot + 16 * c, src + 16 * c);
        }
      }
      cp_commit();
    }
  };

  // the ring's first NSTAGE - 1 batches. (Filling all NSTAGE slots here and refilling each slot before the
  // wait for the next batch, so that the whole ring is in flight while a warp waits, measured 2-4% slower.)
  const int nbl = active ? nb : 0;        // batches of this warp
  for (int s = 0; s < NSTAGE - 1; ++s) issue(s, s, nbl);
  if (PDL) {  // everything above read only the weights; X, its scales and the side codes come from the producer
    wait_for_producer();
    load_xs();
    load_side_xs();
    copy_x();
  }
  {  // zero the X columns of the last batch's missing tiles: their mma (A decoded as zeros) adds exact zeros
    const int pad = (nb * BT - nk) * 4 * XB;  // 16-byte chunks per row
    for (int i = tid; i < a.N * pad; i += NTHR) {
      const int n = i / pad, c = nk * 4 * XB + (i - n * pad);
      *reinterpret_cast<uint4*>(xsm + n * xs_stride + 16 * c) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int q = 0; q < XS_REG; ++q)
    if (tid + q * NTHR < nxs) sxs[tid + q * NTHR] = xsv[q] * (1.f / (1 << SHIFT));
  if (side_staged && tid < a.N) ssxs[tid] = ssxv;
  for (int i = tid + XS_REG * NTHR; i < nxs; i += NTHR) {
    const int j = i / (NT * 8), n = i - j * (NT * 8);
    sxs[i] = n < a.N ? ld_produced(a.xs + static_cast<size_t>(n) * a.G + ga0 + j) * (1.f / (1 << SHIFT)) : 0.f;
  }
  for (int s = tid; s < 256; s += NTHR) {
    // byte-permute selectors: output byte b of a segment = rank of bit b, or a zero byte when inactive
    const int n = __popc(s);
    uint32_t sel = 0;
    int r = 0;
    for (int b = 0; b < 8; ++b) {
      const int idx = ((s >> b) & 1) ? r++ : n;
      const int byte = BITS == 4 ? ((idx & 1) * 4 + (idx >> 1)) : (2 * (idx & 3) + (idx >> 2));
      sel |= static_cast<uint32_t>(byte) << (4 * (b & 3) + 16 * (b >> 2));
    }
    uint32_t me, mo;
    count_masks<BITS>(n, me, mo);
    tab[s] = make_uint4(sel & 0xffffu, sel >> 16, me, mo);
  }
  if (!TMA) cp_wait<0>();  // X landed (and the first batches)
  __syncthreads();         // the table, the X padding and scales, mbarrier inits: the kernel's one CTA barrier
  if (TMA) mbar_wait(xbar_s, 0);  // this warp's X chunk
  if (TRACE) tt[1] = gtimer();

  // ---------------- main loop: every warp streams its own tile row ----------------
  int acc[NT][4];
  float facc[NT][4];  // AF16: the group's float32 sums
  float yv[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) { acc[j][i] = 0; facc[j][i] = 0.f; yv[j][i] = 0.f; }
  uint32_t himask = ~((1u << (8 * t)) - 1u);  // bits of the mask word from this lane's segment on
  uint32_t tab_s = sptr(tab);                // the selector table's shared address
  uint32_t bytesel = 0x4440u | t;            // prmt selector: byte t of a word, zero-extended
  // B fragments: row n = nt * 8 + g of the X chunk, clamped to N - 1 (columns past N are never written);
  // advanced by one batch of columns per batch
  const int8_t* xl[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xl[nt] = xsm + min(nt * 8 + g, a.N - 1) * xs_stride + 8 * t * XB;
  const float* sxp = sxs + 2 * t;             // this group's activation scales (times 2^-SHIFT)
  // tile indices relative to the current batch's first tile: the chunk's last tile, and the next tile that
  // ends a group or the chunk (never a padding tile past the chunk: gend <= jlast always)
  int jlast = nk - 1;
  int gend = min(a.gs_tiles - (k0 - ga0 * a.gs_tiles) - 1, jlast);

  // rounds of NSTAGE batches: batch b0 + si uses ring slot si, whose mbarrier phase flips once per round
  // (not unrolled: unrolling saved ~1 instruction per tile for 8 more registers)
  uint32_t phase = 0;
  for (int b0 = 0; b0 < nbl; b0 += NSTAGE, phase ^= 1u) {
#pragma unroll 1
  for (int si = 0; si < NSTAGE; ++si) {
    const int b = b0 + si;
    if (b >= nbl) break;
    asm volatile("" : "+r"(himask), "+r"(bytesel), "+r"(ring_s), "+r"(bar_s), "+r"(ring_off), "+r"(tab_s));
    if (TMA) {
      mbar_wait(bar_s + 8 * si, phase);
    } else {
      cp_wait<NSTAGE - 2>();
    }
    __syncwarp();        // the slot's copies are visible to every lane; every lane is done with the next slot
    issue(b + NSTAGE - 1, (si + NSTAGE - 1) % NSTAGE, nbl);
    const uint32_t wl = w0;
    // inverse perms of this lane's (row w, tile j): ra = pinv[j][w], rb = pinv[j][w + 8] packed for the
    // decoding lanes: byte 0 / 1 = source lane 4 (ra & 7) + j / 4 (rb & 7) + j, byte 2 / 3 = 2 * area row
    const uint32_t pk = PERM ? (((r0 << 2) & 0x1c1cu) | (0x0101u * t) | ((r0 << 14) & 0x02020000u)) : 0u;
    // shift the register queue and load the words of batch b + 2
    w0 = w1;
    r0 = r1;
    w1 = 0;
    r1 = 0;
    if (tl > 2 * BT) {
      w1 = __ldg(bmp + 2 * BT * 8);
      if (PERM) r1 = __ldg(pmp + 2 * BT * 16) | (static_cast<uint32_t>(__ldg(pmp + 2 * BT * 16 + 8)) << 8);
    }
    tl -= BT;
    bmp += BT * 8;
    if (PERM) pmp += BT * 16;
    // ---- batch metadata by warp scans (bit units) ----
    const int incl = scan_rows(__popc(wl));               // inclusive popcount scan over the tile's rows
    const uint32_t pb = static_cast<uint32_t>(last_row(incl)) * BITS;  // P * BITS: stream length of tile t
    const uint32_t seg = (4 * pb + 127) & ~127u;          // its value segment (16-byte aligned), in bits
    // in stream 0 of tile t: the bit after row w's last code = slot + tile start + rank of row w + 1's first bit
    const uint32_t mst = (ring_off + si * R::SLOT) * 8 + scan_tiles(seg) - seg + static_cast<uint32_t>(incl) * BITS;
#pragma unroll
    for (int j0 = 0; j0 < BT; j0 += ILP) {
      // ---- decode ILP tiles back to back (independent chains); a tile past the chunk decodes zeros ----
      uint32_t fr[ILP][2][4];
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int j = j0 + u;
        const uint32_t pbj = shfl_tile(pb, j);          // distance between the tile's area streams
        if (PERM) {
          // fragment rows g and g + 8 are output rows; they hold reordered rows ra and rb
          const uint32_t pkj = shfl_tile(pk, j);
          const uint32_t sa = pkj, sb = pkj >> 8;         // source lanes (shuffles use bits 4..0)
          const uint32_t wA = __shfl_sync(0xffffffffu, wl, sa), mA = __shfl_sync(0xffffffffu, mst, sa);
          const uint32_t wB = __shfl_sync(0xffffffffu, wl, sb), mB = __shfl_sync(0xffffffffu, mst, sb);
          const uint32_t vA = mA - __popc(wA & himask) * BITS + prmt(pkj, 0u, 0x4442u) * pbj;
          const uint32_t vB = mB - __popc(wB & himask) * BITS + prmt(pkj, 0u, 0x4443u) * pbj;
          const uint4 eA = lds128(tab_s + 16 * prmt(wA, 0u, bytesel));
          const uint4 eB = lds128(tab_s + 16 * prmt(wB, 0u, bytesel));
#pragma unroll
          for (int cs = 0; cs < 2; ++cs) {
            decode_window<BITS>(smw, vA + cs * pbj, eA, fr[u][cs][0], fr[u][cs][2]);
            decode_window<BITS>(smw, vB + cs * pbj, eB, fr[u][cs][1], fr[u][cs][3]);
          }
        } else {
          const uint32_t wA = shfl_tile(wl, j), mA = shfl_tile(mst, j);
          // first code of the segment in area stream (row half 0, column half 0); row half 1 is 2 streams on
          const uint32_t vA = mA - __popc(wA & himask) * BITS;
          const uint4 eA = lds128(tab_s + 16 * prmt(wA, 0u, bytesel));
#pragma unroll
          for (int cs = 0; cs < 2; ++cs) {
            decode_window<BITS>(smw, vA + cs * pbj, eA, fr[u][cs][0], fr[u][cs][2]);
            decode_window<BITS>(smw, vA + (2 + cs) * pbj, eA, fr[u][cs][1], fr[u][cs][3]);
          }
        }
      }
      // ---- tensor cores, then the end of a group (or of this chunk): scale and accumulate ----
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int j = j0 + u;
#pragma unroll
        for (int cs = 0; cs < 2; ++cs) {
          if constexpr (AF16) {
            // rows g (fr 0, 2) and g + 8 (fr 1, 3): codes 0-3 and 4-7 of the lane's segment as half2 pairs
            uint32_t hg[4], hh[4];
            to_half2(fr[u][cs][0], hg[0], hg[1]);
            to_half2(fr[u][cs][2], hg[2], hg[3]);
            to_half2(fr[u][cs][1], hh[0], hh[1]);
            to_half2(fr[u][cs][3], hh[2], hh[3]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint4 bx = *reinterpret_cast<const uint4*>(xl[nt] + j * 128 + cs * 64);  // columns 8t..8t+7
              mma_f16(facc[nt], hg[0], hh[0], hg[1], hh[1], bx.x, bx.y);
              mma_f16(facc[nt], hg[2], hh[2], hg[3], hh[3], bx.z, bx.w);
            }
          } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint2 bx = *reinterpret_cast<const uint2*>(xl[nt] + j * 64 + cs * 32);
              mma_s8(acc[nt], fr[u][cs][0], fr[u][cs][1], fr[u][cs][2], fr[u][cs][3], bx.x, bx.y);
            }
          }
        }
        if (gend == j) {
          gend = min(j + a.gs_tiles, jlast);
          if (!DEBUG) {
            // 2^-SHIFT is folded into the staged activation scale: rn(w * x 2^-s) * float(2^s p) ==
            // rn(w * x) * float(p) exactly (power-of-two scaling of normal numbers), so the sums need no shift
            const float w0 = h2f(sw0), w1 = h2f(sw1);
            wsp += a.Mp;
            if (j != jlast) { sw0 = __ldg(wsp); sw1 = __ldg(wsp + 8); }  // a next group in this chunk
            if constexpr (AF16) {  // the float32 group sums of codes times 2^SHIFT: the scale times 2^-SHIFT, exact
#pragma unroll
              for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const float s = __fmul_rn(i >> 1 ? w1 : w0, 1.f / (1 << SHIFT));
                  yv[nt][i] = __fadd_rn(yv[nt][i], __fmul_rn(s, facc[nt][i]));
                  facc[nt][i] = 0.f;
                }
            } else {
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                const float2 sx = *reinterpret_cast<const float2*>(sxp + nt * 8);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                  const float s = __fmul_rn(i >> 1 ? w1 : w0, i & 1 ? sx.y : sx.x);
                  yv[nt][i] = __fadd_rn(yv[nt][i], __fmul_rn(s, static_cast<float>(acc[nt][i])));
                }
              }
              sxp += NT * 8;
            }
          } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
                if (row < a.M && col < a.N)
                  atomicAdd(a.partial + (static_cast<size_t>(col) * a.M + row) * a.G + grp, acc[nt][i] >> SHIFT);
              }
          }
          zero_acc<NT>(acc);
          if (DEBUG) ++grp;
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xl[nt] += BT * 64 * XB;
    gend -= BT;
    jlast -= BT;
  }
  }
  cp_wait<0>();
  if (PDL && IEBME_TRIGGER) allow_dependents();
  if (DEBUG) return;
  if (TRACE) tt[2] = gtimer();
  // The outlier side product, added once (by the first K chunk's CTA; IEBME_SIDE_LAST: the last's) after the main
  // groups and before the one float16 rounding: without split-K the CPU reference's arithmetic bit for bit. One side
  // group (the default): the warp's 16 x N dots, two lanes a dot; a lane's half row of weight codes is loaded into
  // registers once (prefetched to L2 in the prologue), the activation codes and scales were staged with X, so the
  // side costs one L2 round trip whatever N (reading the codes per column from L2 cost about 2.5 us a column:
  // docs/kernels.md, "Outlier side product"); the dots reach the fragment owners through the warp's idle ring.
  // Several groups: per output.
  if (!AF16 && a.ns > 0 && IEBME_SIDE_CTA && active) {
    if (side_staged) {
      int* sd = reinterpret_cast<int*>(smem + ring_off);  // [16][NT * 8]; every copy into the ring has landed
      const int r = lane & 15, h = lane >> 4, row = min(tr * 16 + r, a.M - 1);  // lanes r, r + 16: a dot's halves
      const int4* w4 = reinterpret_cast<const int4*>(a.side_w + static_cast<size_t>(row) * a.ns);
      const int nc = a.ns >> 4;
      float swv[2] = {0.f, 0.f};  // weight scales of the owner rows g, g + 8
#pragma unroll
      for (int i = 0; i < 2; ++i) swv[i] = __ldg(a.side_ws + min(tr * 16 + g + 8 * i, a.M - 1));
      // passes of 8 chunks (128 channels): half h takes chunks h, h + 2, h + 4, h + 6 of the pass
      for (int c0 = 0; c0 < nc; c0 += 8) {
        int4 wv[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int c = c0 + h + 2 * q;
          wv[q] = c < nc ? __ldg(w4 + c) : make_int4(0, 0, 0, 0);
        }
#pragma unroll 2
        for (int col = 0; col < a.N; ++col) {
          const int4* x4 = reinterpret_cast<const int4*>(ssx + col * a.ns);
          int d0 = 0, d1 = 0;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int c = c0 + h + 2 * q;
            const int4 xv = c < nc ? x4[c] : make_int4(0, 0, 0, 0);
            int& d = q & 1 ? d1 : d0;
            d = dp4a(wv[q].w, xv.w, dp4a(wv[q].z, xv.z, dp4a(wv[q].y, xv.y, dp4a(wv[q].x, xv.x, d))));
          }
          int dot = d0 + d1;
          dot += __shfl_xor_sync(0xffffffffu, dot, 16);
          if (lane < 16) sd[r * (NT * 8) + col] = (c0 == 0 ? 0 : sd[r * (NT * 8) + col]) + dot;
        }
      }
      __syncwarp();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = g + 8 * (i >> 1), row = tr * 16 + r, col = nt * 8 + 2 * t + (i & 1);
          if (row < a.M && col < a.N) {
            const float s = __fmul_rn(ssxs[col], swv[i >> 1]);
            yv[nt][i] = __fadd_rn(yv[nt][i], __fmul_rn(s, static_cast<float>(sd[r * (NT * 8) + col])));
          }
        }
      __syncwarp();  // the cluster path below reuses the ring
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
          if (row < a.M && col < a.N) yv[nt][i] = add_side(a, row, col, yv[nt][i]);
        }
    }
  }

  // ---------------- output ----------------
  if (gridDim.y == 1) {
    if (active) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
          if (row < a.M && col < a.N) a.y[static_cast<size_t>(col) * a.M + row] = f2h(yv[nt][i]);
        }
    }
    trace_exit();
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t ncl;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(ncl));
  if (ncl == gridDim.y) {
    // Split-K inside one thread-block cluster (the launch put the K chunks of a row block in one cluster):
    // each warp leaves its partial [16 rows][NT * 8 columns] in its own ring (idle: every copy it issued
    // has landed); after a cluster barrier, CTA rank r sums its share of the block's outputs over the
    // cluster's CTAs in split order, through distributed shared memory. No global atomics, fences or
    // workspace, and the same sums in the same order on every run.
    constexpr int COLS = NT * 8, ROWS = WARPS * 16;
    static_assert(16 * COLS * 4 <= R::WARP_BYTES, "a warp's partial must fit in its ring");
    float* red = reinterpret_cast<float*>(smem + ring_off);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(g + 8 * (i >> 1)) * COLS + nt * 8 + 2 * t + (i & 1)] = yv[nt][i];
    cluster_sync();
    uint32_t rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const uint32_t base = sptr(smem);
    for (int e = rank * (WARPS * 32) + tid; e < ROWS * a.N; e += ncl * (WARPS * 32)) {
      const int col = e / ROWS, rb = e - col * ROWS;   // consecutive threads: consecutive rows of y
      const uint32_t off = base + (rb >> 4) * R::WARP_BYTES + ((rb & 15) * COLS + col) * 4;
      float v = 0.f;
      for (uint32_t q = 0; q < ncl; ++q) v = __fadd_rn(v, ld_cluster_f32(off, q));
      const int row = blockIdx.x * ROWS + rb;
      if (row < a.M) a.y[static_cast<size_t>(col) * a.M + row] = f2h(v);
    }
    cluster_sync();  // no CTA leaves while another still reads its shared memory
    trace_exit();
    return;
  }
#endif
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = tr * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * t + (i & 1);
        if (col < a.N) atomicAdd(a.ws_acc + static_cast<size_t>(col) * a.Mp + row, yv[nt][i]);
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) last = atomicAdd(a.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
  __syncthreads();
  if (!last) {
    trace_exit();
    return;
  }
  __threadfence();
  constexpr int ROWS = WARPS * 16;
  for (int i = tid; i < ROWS * a.N; i += blockDim.x) {
    const int col = i / ROWS, row = blockIdx.x * ROWS + (i - col * ROWS);
    float* p = a.ws_acc + static_cast<size_t>(col) * a.Mp + row;
    const float v = __ldcg(p);
    *p = 0.f;
    if (row < a.M) a.y[static_cast<size_t>(col) * a.M + row] = f2h(v);
  }
  if (tid == 0) a.counters[blockIdx.x] = 0;
  trace_exit();
}

}  // namespace iebme

// C entry points (one per variant, flat arguments) so CuPy can launch them by plain name.
#define IEBME_ENTRY_AS(NAME, B, NT, P, D, A)                                                                \
  extern "C" __global__ void __launch_bounds__(IEBME_WARPS * 32, IEBME_MINB) NAME(                         \
      const uint8_t* values, const uint8_t* bitmaps, const uint32_t* offsets, const uint8_t* pinv,       \
      const uint16_t* wsT, const float* xs, const int8_t* x, float* ws_acc, int* counters, uint16_t* y,  \
      int* partial, const int8_t* side_x, const float* side_xs, const int8_t* side_w, const float* side_ws, \
      int N, int M, int G, int Kp, int Mp, int TR, int TC, int gs_tiles, int chunk, int ns, int sgs) {     \
    const iebme::Args a{values, bitmaps, offsets, pinv, wsT, xs, x, ws_acc, counters, y, partial,        \
                        side_x, side_xs, side_w, side_ws, N, M, G, Kp, Mp, TR, TC, gs_tiles, chunk, ns, sgs}; \
    iebme::spmm<B, NT, P, D, A>(a);                                                                       \
  }
#define IEBME_ENTRY(B, NT, P, D) IEBME_ENTRY_AS(iebme_spmm_w##B##_nt##NT##_p##P##_d##D, B, NT, P, D, false)
// float16 activations (x: float16 [N, Kp] passed as bytes; xs and the side unused)
#define IEBME_ENTRY_A16(B, NT, P) IEBME_ENTRY_AS(iebme_spmm_w##B##_nt##NT##_p##P##_a16, B, NT, P, false, true)

// Instantiations are appended by iebme_spmm.py (one per compiled variant), e.g. IEBME_ENTRY(4, 1, 0, 0) or
// IEBME_ENTRY_A16(4, 1, 0)
