// Producers that quantize for their consumer (docs/kernels.md, "Quantizing producers"): RMSNorm (residual add
// included), and SiLU(gate) * up, each writing its float16 output AND the IE-BME input of the linear that reads it
// (codes padded to Kp, float32 group scales, the outlier side's codes and scales) in one launch, instead of a
// producer launch plus act_quant.cu. Grid (blocks, token rows); a warp quantizes one group at a time, with
// act_quant.cu's rule:
//   scale = max(fp16(max(clip * absmax / grid_max, tiny)), tiny),  code = clamp(rint(x / scale), -2^(b-1), 2^(b-1)-1)
// over the permuted channels (perm: position p reads channel perm[p]; the last n_side positions are the outlier
// side: zero in the main input). A warp computes the producer's value of each channel its group gathers and writes
// it to the float16 output there (each channel belongs to one group), so a row is spread over as many SMs as it
// has groups / warps (one block a row, holding the row in shared memory, took 28 us for K = 11008 on an H100). The
// float16 values are glue.cu's, bit for bit: RMSNorm's sum of squares is row_sum_squares with the same block size.
#include "act_rule.cuh"

struct QuantArgs {  // the consumer's input rule and where its quantized input goes
    const int* perm;
    int K, Kp, n_side, gm, bits, gs, side_bits;
    float clip, grid, side_clip, side_grid, tiny;
    signed char* codes;
    float* scales;
    signed char* side_codes;
    float* side_scales;
};

// The producer's float16 value of one channel, written to the output (and the residual stream) when asked.
// `wt`: w[c] where the caller has it (the early copy, below), else nullptr.
struct NormValue {  // RMSNorm of x (+ delta): w * fp16(v * r)
    const u16 *xr, *dr, *w;
    float r;
    u16 *yr, *xo;
    __device__ __forceinline__ float operator()(int c, bool write, const u16* wt = nullptr) const {
        const float v = residual_at(xr, dr, c);
        const u16 o = norm_at(v, r, wt != nullptr ? *wt : w[c]);
        if (write) {
            yr[c] = o;
            if (xo != nullptr) xo[c] = f2h(v);
        }
        return h2f(o);
    }
};

struct SiluValue {  // fp16(fp16(silu(gate)) * up)
    const u16 *gr, *ur;
    u16* yr;
    __device__ __forceinline__ float operator()(int c, bool write, const u16* = nullptr) const {
        const float g = h2f(gr[c]);
        const u16 o = f2h(h2f(f2h(__fdiv_rn(g, 1.f + expf(-g)))) * h2f(ur[c]));
        if (write) yr[c] = o;
        return h2f(o);
    }
};

constexpr int CACHED = 8;  // values a lane keeps in registers between the absmax and the rounding pass
#if NORM_EARLY
constexpr int EARLY_WARPS = 4;  // norm_quant.py's NORM_THREADS / 32: the warps whose groups the early copy holds
#endif

// NORM_EARLY (pdl.cuh): the warp's group (norm_quant.py's grid gives a warp at most one) has its channel map and
// its norm weights in shared memory, copied before the wait: perm at its positions (16-byte copies), then, once
// those landed, the 4-byte word of w holding each channel's weight (a gather of 4-byte copies; the weight is its
// low or high half by the channel's parity). So the producer's first read after the wait is the row itself, not
// perm and then w from DRAM. Off (`on` false) where a group is longer than the lanes' CACHED values or unaligned.
struct EarlyGroup {
    const int* perm;       // perm at the group's positions, or nullptr (no permutation)
    const unsigned* word;  // the word of w holding each position's channel's weight, or nullptr (no weight)
    bool on;
    __device__ __forceinline__ const u16* weight(int i, int c) const {
        return word == nullptr ? nullptr : reinterpret_cast<const u16*>(word + i) + (c & 1);
    }
};

// Before the wait: the copies of EarlyGroup into perm_s and w_s (this warp's [32 * CACHED] slices); w: the norm's
// weight or nullptr. Returns what quantize_groups reads after early_copy_wait() and a __syncwarp().
__device__ EarlyGroup copy_group_early(const QuantArgs& a, const u16* __restrict__ w, int* perm_s, unsigned* w_s) {
    EarlyGroup e{nullptr, nullptr, false};
#if NORM_EARLY
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int G = (a.K + a.gm - 1) / a.gm, Gs = a.n_side ? (a.n_side + a.gs - 1) / a.gs : 0;
    const int g = blockIdx.x * warps + (threadIdx.x >> 5);
    if (warps > EARLY_WARPS || g >= G + Gs || gridDim.x * warps < G + Gs) return e;  // not one group a warp
    // group g's positions [base, base + len) as quantize_groups takes them; n of them read a channel
    const bool side = g >= G;
    const int start = side ? (g - G) * a.gs : g * a.gm, main_end = a.K - a.n_side;
    const int len = side ? min(a.gs, a.n_side - start) : min(a.gm, a.K - start);
    const int base = side ? main_end + start : start, n = side ? len : max(0, min(len, main_end - base));
    if (len > 32 * CACHED || a.K % 2 || (unsigned long long)w % 4 ||
        (a.perm != nullptr && (base % 4 || n % 4 || (unsigned long long)a.perm % 16)))
        return e;
    if (a.perm != nullptr) {
        for (int c = lane; 4 * c < n; c += 32) early_copy<16>(perm_s + 4 * c, a.perm + base + 4 * c);
        early_copy_wait();
        __syncwarp();
    }
    if (w != nullptr)
        for (int i = lane; i < n; i += 32) {
            const int c = a.perm != nullptr ? perm_s[i] : base + i;
            early_copy<4>(w_s + i, w + (c & ~1));
        }
    e = EarlyGroup{a.perm != nullptr ? perm_s : nullptr, w != nullptr ? w_s : nullptr, true};
#endif
    return e;
}

// Quantize the groups of row r that fall to this block (group g to warp g % (gridDim.x * warps)), the values
// from f (the warp's first group from e where e.on); block 0 also zeroes the padding codes [K, Kp).
template <class F>
__device__ void quantize_groups(const F& f, const QuantArgs& a, int r, const EarlyGroup& e) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int G = (a.K + a.gm - 1) / a.gm;
    const int Gs = a.n_side ? (a.n_side + a.gs - 1) / a.gs : 0;
    const int main_end = a.K - a.n_side;
#if NORM_EARLY
    bool early = e.on;  // the warp's first group
#endif
    for (int g = blockIdx.x * warps + (threadIdx.x >> 5); g < G + Gs; g += gridDim.x * warps) {
        const bool side = g >= G;
        const int grp = side ? g - G : g;
        const int start = side ? grp * a.gs : grp * a.gm;
        const int len = side ? min(a.gs, a.n_side - start) : min(a.gm, a.K - start);
        const int b = side ? a.side_bits : a.bits;
        const int base = side ? main_end + start : start;  // permuted position of the group's first element
        float cache[CACHED];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < CACHED; ++j) {
            const int i = lane + 32 * j, p = base + i;
            const bool real = i < len && (side || p < main_end);
#if NORM_EARLY
            if (early) {
                const int c = e.perm != nullptr ? e.perm[i] : p;
                cache[j] = real ? f(c, true, e.weight(i, c)) : 0.f;
            } else
#endif
                cache[j] = real ? f(a.perm ? a.perm[p] : p, true) : 0.f;
            amax = fmaxf(amax, fabsf(cache[j]));
        }
#if NORM_EARLY
        early = false;
#endif
        for (int i = lane + 32 * CACHED; i < len; i += 32) {
            const int p = base + i;
            if (side || p < main_end) amax = fmaxf(amax, fabsf(f(a.perm ? a.perm[p] : p, true)));
        }
        amax = warp_max(amax);
        const float s = act_scale(amax, side ? a.side_clip : a.clip, side ? a.side_grid : a.grid, a.tiny);
        const int lo = act_code_lo(b), hi = act_code_hi(b);
        signed char* out = side ? a.side_codes + (long long)r * a.n_side + start : a.codes + (long long)r * a.Kp + start;
#pragma unroll
        for (int j = 0; j < CACHED; ++j) {
            const int i = lane + 32 * j;
            if (i < len) out[i] = act_code(cache[j], s, lo, hi);
        }
        for (int i = lane + 32 * CACHED; i < len; i += 32) {
            const int p = base + i;
            const float x = (side || p < main_end) ? f(a.perm ? a.perm[p] : p, false) : 0.f;
            out[i] = act_code(x, s, lo, hi);
        }
        if (lane == 0) {
            if (side) a.side_scales[(long long)r * Gs + grp] = s;
            else a.scales[(long long)r * G + grp] = s;
        }
    }
    if (blockIdx.x == 0)
        for (int p = a.K + threadIdx.x; p < a.Kp; p += blockDim.x) a.codes[(long long)r * a.Kp + p] = 0;
}

// y[r, :] = w * fp16(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) (glue.cu's rms_norm, residual add included: x_out), then
// its quantized input. Every block of a row computes the row's sum of squares.
extern "C" __global__ void rms_norm_quant(const u16* __restrict__ x, long long ld_x, const u16* __restrict__ delta,
                                          long long ld_d, u16* __restrict__ x_out, const u16* __restrict__ w,
                                          u16* __restrict__ y, float eps, const int* __restrict__ perm, int K,
                                          int Kp, int n_side, int gm, int bits,
                                          float clip, float grid, int gs, int side_bits, float side_clip,
                                          float side_grid, float tiny, signed char* __restrict__ codes,
                                          float* __restrict__ scales, signed char* __restrict__ side_codes,
                                          float* __restrict__ side_scales) {
    const QuantArgs a{perm, K, Kp, n_side, gm, bits, gs, side_bits, clip, grid, side_clip, side_grid, tiny, codes,
                      scales, side_codes, side_scales};
#if NORM_EARLY
    __shared__ __align__(16) int perm_s[EARLY_WARPS][32 * CACHED];
    __shared__ unsigned w_s[EARLY_WARPS][32 * CACHED];
    allow_dependents();
    const EarlyGroup e = copy_group_early(a, w, perm_s[(threadIdx.x >> 5) % EARLY_WARPS],
                                          w_s[(threadIdx.x >> 5) % EARLY_WARPS]);
    wait_for_producer();
#else
    pdl_enter();
    const EarlyGroup e{nullptr, nullptr, false};
#endif
    const int r = blockIdx.y;
    const u16* xr = x + (long long)r * ld_x;
    const u16* dr = delta == nullptr ? nullptr : delta + (long long)r * ld_d;
    const NormValue f{xr, dr, w, row_rsqrt(xr, dr, K, eps), y + (long long)r * K,
                      dr == nullptr ? nullptr : x_out + (long long)r * K};
#if NORM_EARLY
    early_copy_wait();
    __syncwarp();
#endif
    quantize_groups(f, a, r, e);
}

// y[r, i] = fp16(fp16(silu(gate[r, i])) * up[r, i]) (glue.cu's silu_mul), then its quantized input (K = I).
extern "C" __global__ void silu_mul_quant(const u16* __restrict__ gate, long long ld_g, const u16* __restrict__ up,
                                          long long ld_u, u16* __restrict__ y, const int* __restrict__ perm,
                                          int K, int Kp, int n_side, int gm, int bits,
                                          float clip, float grid, int gs, int side_bits, float side_clip,
                                          float side_grid, float tiny, signed char* __restrict__ codes,
                                          float* __restrict__ scales, signed char* __restrict__ side_codes,
                                          float* __restrict__ side_scales) {
    const QuantArgs a{perm, K, Kp, n_side, gm, bits, gs, side_bits, clip, grid, side_clip, side_grid, tiny, codes,
                      scales, side_codes, side_scales};
#if NORM_EARLY
    __shared__ __align__(16) int perm_s[EARLY_WARPS][32 * CACHED];
    allow_dependents();
    const EarlyGroup e = perm == nullptr ? EarlyGroup{nullptr, nullptr, false}
                                         : copy_group_early(a, nullptr, perm_s[(threadIdx.x >> 5) % EARLY_WARPS], nullptr);
    wait_for_producer();
#else
    pdl_enter();
    const EarlyGroup e{nullptr, nullptr, false};
#endif
    const int r = blockIdx.y;
    const SiluValue f{gate + (long long)r * ld_g, up + (long long)r * ld_u, y + (long long)r * K};
#if NORM_EARLY
    early_copy_wait();
    __syncwarp();
#endif
    quantize_groups(f, a, r, e);
}
