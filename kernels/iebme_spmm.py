"""GPU IE-BME W4A4 / W2A4 SpMM (CuPy RawModule over ``iebme_spmm.cu``).

Usage::

    layer = prepare_layer(m, w_scales, group_size)       # upload once (arrays exactly as stored)
    y = spmm_iebme(layer, x_codes, x_scales)             # fp16 [N, M] on the GPU
    p = spmm_iebme(layer, x_codes, x_scales, debug_partials=True)   # int32 [N, M, G], exact
    y = spmm_iebme16(layer, x_fp16)                      # W4A16 / W2A16: float16 activations, no quantization

Only the default geometry (tile 16x64, areas 2x2) and 4- or 2-bit codes have a kernel. Two derived
arrays are made once at upload: the weight scales transposed to [G, Mp] (a group's 16 row scales of a
tile row are one 32-byte copy) and the inverse of each tile's row permutation (the kernel asks "which
reordered row is output row r"); the IE-BME bitmaps, offsets and values are used as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from ..formats.iebme import IEBMEMatrix
from . import sm_count, study
from .cluster_launch import launch_ex, programmatic_enabled
from .errors import KernelError
from .iebme_reference import check_group_size
from .loader import compile_source, require_cupy

SOURCE = Path(__file__).with_name("iebme_spmm.cu")
KERNEL = SOURCE.stem                                         # its name for kernels/study.py
BT = 4                                                       # tiles per batch (fixed in the .cu)
WARP_CHOICES = (4, 5, 6, 7, 8, 16)                           # warps (tile rows) per CTA a launch may use


@dataclass(frozen=True)
class LaunchSettings:
    """What the product tunes in a launch. The defaults are the measured ones (H200, docs/kernels.md, "Tuning");
    a field left None follows the launch rule. Only benchmarks and tests change them (``use_settings``); the
    product reads no environment variable. Study builds of the kernel (another .cu revision, cp.async rings on
    sm_90, per-CTA timestamps) are not settings: ``kernels/study.py``.

    ``nstage`` ring depth in batches; ``warps`` warps per CTA (None: 8, or 16 where ``plan`` finds fewer
    waves; set, it wins); ``ilp`` tiles decoded back to back (None: 2 for N <= 16, 4 above); ``minb`` min
    CTAs per SM for the register allocator (0: none); ``x_bytes`` shared bytes for a chunk's X codes (None:
    ``X_BUDGET`` per 8 warps); ``cluster`` largest split-K run as one thread-block cluster (None:
    ``CLUSTER_UP_TO``; 0 never); ``pdl`` programmatic dependent launch on sm_90 (the prologue's weight loads
    overlap the kernel before; None: on where the GPU has it); ``max_splits`` the most K chunks the chunk rule
    takes (None: no bound; a bound means fewer, longer CTAs: fewer prologues and split-K exits, fewer warps in
    flight; the X budget's least chunk still holds)."""

    nstage: int = 2
    warps: int | None = None
    ilp: int | None = None
    minb: int = 0
    x_bytes: int | None = None
    cluster: int | None = None
    pdl: bool | None = None
    max_splits: int | None = None

    def __post_init__(self) -> None:
        if self.warps is not None and self.warps not in WARP_CHOICES:
            raise KernelError(f"warps per CTA must be one of {WARP_CHOICES}, got {self.warps}")
        if self.max_splits is not None and self.max_splits < 1:
            raise KernelError(f"max_splits must be at least 1, got {self.max_splits}")


_settings = LaunchSettings()


def settings() -> LaunchSettings:
    """The launch settings in force."""
    return _settings


def use_settings(new: LaunchSettings) -> LaunchSettings:
    """Put ``new`` in force (benchmarks and studies); returns the settings it replaced."""
    global _settings
    old, _settings = _settings, new
    return old


def config(n: int, warps: int | None = None) -> tuple[int, int, int, int]:
    """(ring depth in batches, warps per CTA, tiles decoded back to back, min CTAs per SM for the register
    allocator, 0 = none) for a launch of ``n`` columns under the settings in force; ``warps`` is the launch
    rule's choice, which ``LaunchSettings.warps`` overrides."""
    st = settings()
    warps = st.warps or warps or 8
    if warps not in WARP_CHOICES:
        raise KernelError(f"warps per CTA must be one of {WARP_CHOICES}, got {warps}")
    return st.nstage, warps, st.ilp or (2 if n <= 16 else 4), st.minb


#: The float16-activation variant (W4A16 / W2A16, ``spmm_iebme16``) in the runtime and in ``verify --backend cupy``.
#: On since its GPU tests passed (H100, 2026-12-07, ``bash benchmarks/w4a16_h200.sh``: 22 tests, LLaMA-2-7B step
#: 1.15x dense W4A16 at batch 1, 1.50x at batch 8). False: such layers are decoded to float16 for cuBLAS.
FLOAT16_ACTIVATIONS = True

MAX_N = 32            # columns per launch; larger N is cut into launches of 32
MAX_BATCHES = 31      # per chunk: batch boundaries live in one register per lane
X_BUDGET = 16 * 1024  # shared bytes for a chunk's X codes per 8 warps (LaunchSettings.x_bytes overrides)...
MIN_CHUNK = 32        # ...but never fewer tiles than this per chunk (large N: more X, fewer CTA start-ups)
WIDE_WARPS = 16       # CTAs of 16 tile rows (X staged once for twice the rows, with twice the X budget)...
WIDE_N = (4, 16)      # ...are considered for these N and taken when they need fewer waves (docs/kernels.md)
SMEM_SM = 228 * 1024    # shared memory per SM (sm_90), 1 KiB of it reserved per resident CTA
SMEM_CTA = 227 * 1024   # opt-in limit per CTA, static + dynamic


def static_smem(nstage: int, warps: int) -> int:
    """Static shared bytes of the kernel: the 256 x 16 B decode table, one mbarrier per ring slot and one
    for X, a flag."""
    return 256 * 16 + 8 * (warps * nstage + 1) + 16


def ring_bytes(bits: int, perm: bool, nstage: int, warps: int) -> int:
    """Dynamic shared bytes before the X chunk: every warp's ring; mirrors ``Ring`` in the .cu. A slot holds
    only value bytes (bitmaps and inverse perms go to registers), so ``perm`` does not change it."""
    slot = BT * 128 * bits + 16
    return warps * nstage * slot


def x_stride(nk: int, xb: int = 1) -> int:
    """Row stride (bytes) of a chunk's X in shared memory, ``xb`` bytes an activation (1: int8 codes, 2: float16):
    whole batches of tiles (the kernel zeroes the last batch's missing columns), and 32·xb mod 128 so the
    8-byte (16-byte) fragment loads are conflict-free."""
    return (-(-nk // BT) * BT * 64 + 32) * xb


def smem_bytes(bits: int, perm: bool, n: int, chunk: int, n_groups_chunk: int, warps: int | None = None,
               xb: int = 1, side: int = 0) -> int:
    """Dynamic shared memory of one CTA for ``n`` activation rows and a chunk of ``chunk`` tiles (``xb``: bytes an
    activation; float16 activations have no activation scales), with ``side`` outlier channels staged for the
    epilogue (one side group: their codes and one scale a row; mirrors ``ssx`` in the .cu)."""
    ring = ring_bytes(bits, perm, *config(n, warps)[:2])
    scales = 4 * 8 * -(-n // 8) * n_groups_chunk if xb == 1 else 0
    staged = n * side + 4 * n if side and xb == 1 else 0
    return ring + n * x_stride(chunk, xb) + scales + staged


def kernel_name(bits: int, nt: int, perm: bool, debug: bool, af16: bool = False) -> str:
    if af16:
        return f"iebme_spmm_w{bits}_nt{nt}_p{int(perm)}_a16"
    return f"iebme_spmm_w{bits}_nt{nt}_p{int(perm)}_d{int(debug)}"


def _kernel(bits: int, nt: int, perm: bool, debug: bool, nstage: int, warps: int, ilp: int, minb: int = 0,
            af16: bool = False):
    """The compiled kernel of one variant, of the build in force (``study.build``: the shipped one unless a study
    set another); ``af16``: float16 activations (W4A16 / W2A16)."""
    return _compiled(bits, nt, perm, debug, nstage, warps, ilp, minb, study.build(KERNEL), programmatic(), af16)


def programmatic() -> bool:
    """Whether launches are programmatic dependent launches (``LaunchSettings.pdl``; sm_90 with bulk-copy rings,
    which a study build with ``IEBME_TMA=0`` replaces)."""
    st = settings()
    able = programmatic_enabled() and study.build(KERNEL).define("IEBME_TMA", 1) != 0
    return able if st.pdl is None else bool(st.pdl) and able


@cache
def _compiled(bits: int, nt: int, perm: bool, debug: bool, nstage: int, warps: int, ilp: int, minb: int,
              build: study.Build = study.SHIPPED, pdl: bool = False, af16: bool = False):
    name = kernel_name(bits, nt, perm, debug, af16)
    entry = f"IEBME_ENTRY_A16({bits}, {nt}, {int(perm)})" if af16 else \
        f"IEBME_ENTRY({bits}, {nt}, {int(perm)}, {int(debug)})"
    code = Path(build.source or SOURCE).read_text() + f"\n{entry}\n"
    opts = (f"-DIEBME_NSTAGE={nstage}", f"-DIEBME_WARPS={warps}", f"-DIEBME_ILP={ilp}",
            f"-DIEBME_MINB={minb}", f"-DIEBME_PDL={int(pdl)}") + build.options()
    fn = compile_source(code, opts).get_function(name)
    fn.max_dynamic_shared_size_bytes = SMEM_CTA - static_smem(nstage, warps)
    fn.preferred_shared_memory_carveout = 100  # all of L1 as shared memory: the most CTAs per SM
    return fn


@dataclass
class DeviceLayer:
    """One IE-BME layer resident on the GPU, plus its split-K workspace."""

    shape: tuple[int, int]
    bits: int
    group_size: int
    n_groups: int
    values: object
    bitmaps: object
    offsets: object
    pinv: object | None   # uint8 [T, 16] inverse row permutations, or None
    wsT: object           # fp16 [G, Mp]
    ws_acc: object        # fp32 [MAX_N, Mp], zero between calls
    counters: object      # int32 [grid_x], zero between calls
    tr: int
    tc: int
    mp: int
    dummy: object = None  # 16-byte buffer passed for unused pointers (no allocation inside graphs)

    @property
    def gs_tiles(self) -> int:
        k = self.shape[1]
        return self.group_size // 64 if self.group_size < k else self.tc

    @property
    def perm(self):
        return self.pinv

    def kernel_bytes(self, n: int) -> int:
        """Bytes one launch must move: every array read once, Y written once."""
        m, k = self.shape
        b = self.values.nbytes + self.bitmaps.nbytes + self.offsets.nbytes + self.wsT.nbytes
        if self.pinv is not None:
            b += self.pinv.nbytes
        return int(b + n * self.tc * 64 + n * self.n_groups * 4 + n * m * 2)


def device_layer(shape: tuple[int, int], bits: int, group_size: int, values, bitmaps, offsets, pinv,
                 w_scales_t) -> DeviceLayer:
    """Wrap CuPy arrays (values with a 16-byte tail, bitmaps as bytes, offsets uint32, pinv uint8 [T, 16]
    or None, weight scales fp16 [G, Mp]) and allocate the split-K workspace."""
    cp = require_cupy()
    m, k = shape
    tr, tc = -(-m // 16), -(-k // 64)
    grid_x = -(-tr // 4)                   # the most CTAs along M (4 warps per CTA)
    mp = padded_rows(m)
    if tuple(w_scales_t.shape) != (-(-k // min(group_size, k)), mp):
        raise KernelError(f"transposed scales must be [G, {mp}], got {tuple(w_scales_t.shape)}")
    return DeviceLayer(shape=(m, k), bits=bits, group_size=int(group_size), n_groups=int(w_scales_t.shape[0]),
                       values=values, bitmaps=bitmaps, offsets=offsets, pinv=pinv, wsT=w_scales_t,
                       ws_acc=cp.zeros((MAX_N, mp), dtype=cp.float32), counters=cp.zeros(grid_x, dtype=cp.int32),
                       tr=tr, tc=tc, mp=mp, dummy=cp.zeros(16, dtype=cp.int32))


def padded_rows(m: int) -> int:
    """Rows of the transposed scale array and the workspace: whole CTAs for every warp count in
    ``WARP_CHOICES`` (the split-K reduction walks all of a CTA's rows)."""
    tr = -(-m // 16)
    return max(-(-tr // w) * w for w in WARP_CHOICES) * 16


def unsupported(m: IEBMEMatrix) -> str | None:
    """Why the GPU kernel does not take this layer's geometry (one line), or None: tile 16x64, areas 2x2, 4- or
    2-bit codes only. No GPU needed (the runtime's reference backend asks it too)."""
    g = m.geometry
    if tuple(g.tile) != (16, 64) or tuple(g.areas) != (2, 2):
        return f"the GPU kernel supports tile 16x64 and areas 2x2, got {g.tile} and {g.areas}"
    if g.bits not in (2, 4):
        return f"the GPU kernel supports 4- and 2-bit codes, got {g.bits}"
    return None


def prepare_layer(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int) -> DeviceLayer:
    """Upload an encoded layer (arrays as stored) and its fp16 weight scales [M, G]."""
    cp = require_cupy()
    g = m.geometry
    why = unsupported(m)
    if why is not None:
        raise KernelError(why)
    mm, k = g.shape
    n_groups = check_group_size(k, group_size)
    ws = np.asarray(w_scales)
    if ws.shape != (mm, n_groups):
        raise KernelError(f"w_scales must be [{mm}, {n_groups}], got {ws.shape}")
    wst = np.zeros((n_groups, padded_rows(mm)), dtype=np.float16)
    wst[:, :mm] = ws.astype(np.float16).T
    pinv = None
    if m.perm is not None:
        perm = np.asarray(m.perm, dtype=np.int64).reshape(-1, 16)
        inv = np.empty_like(perm)
        np.put_along_axis(inv, perm, np.broadcast_to(np.arange(16), perm.shape), axis=1)
        pinv = cp.asarray(inv.astype(np.uint8))
    return device_layer((mm, k), g.bits, group_size,
                        cp.asarray(np.concatenate([m.values, np.zeros(16, np.uint8)])),  # 16 B tail for windows
                        cp.asarray(m.bitmaps.view(np.uint8)), cp.asarray(m.offsets.astype(np.uint32)), pinv,
                        cp.asarray(wst))


def x_budget(warps: int = 8) -> int:
    """Shared bytes a chunk's X codes may take in a CTA of ``warps`` warps: ``X_BUDGET`` per 8 warps, or the
    settings' ``x_bytes``."""
    return settings().x_bytes or X_BUDGET * warps // 8


def max_chunk(layer: DeviceLayer, n: int, warps: int | None = None, xb: int = 1) -> int:
    """Largest chunk (tiles) allowed: batch boundaries in one register, the chunk's X (``xb`` bytes an activation)
    within the X budget (at least ``MIN_CHUNK`` tiles)."""
    cap = min(MAX_BATCHES * BT, max(MIN_CHUNK, x_budget(config(n, warps)[1]) // (64 * xb * max(n, 1))))
    gt = layer.gs_tiles
    if gt <= cap:
        cap = cap // gt * gt
    return max(1, cap)


def ctas_per_sm(layer: DeviceLayer, n: int, chunk: int, warps: int | None = None, xb: int = 1, side: int = 0) -> int:
    """CTAs of an ``n``-column launch with this chunk that fit on one SM: shared memory, warps, registers."""
    cfg = config(n, warps)
    ngc = -(-chunk // layer.gs_tiles) + 1
    smem = smem_bytes(layer.bits, layer.pinv is not None, n, chunk, ngc, warps, xb, side) + static_smem(*cfg[:2])
    warps = cfg[1]
    regs = _kernel(layer.bits, -(-n // 8), layer.pinv is not None, False, *cfg, af16=xb == 2).num_regs
    return max(1, min(SMEM_SM // (smem + 1024), 2048 // (warps * 32), 65536 // (-(-regs // 8) * 8 * 32 * warps)))


def chunk_for(layer: DeviceLayer, n: int, splits: int | None = None, warps: int | None = None, xb: int = 1,
              side: int = 0) -> int:
    """Tiles per CTA along K. With ``splits`` given: ceil(TC / splits) (whole groups, capped); otherwise
    the chunk that minimises (waves of CTAs) x (tiles per CTA), i.e. fills the GPU with the fewest
    partial waves."""
    cap = max_chunk(layer, n, warps, xb)
    gt = layer.gs_tiles

    def rounded(c: int) -> int:
        c = max(1, min(c, cap))
        if gt < c:
            c = -(-c // gt) * gt
            if c > cap:
                c -= gt
        return max(1, c)

    if splits is not None:
        return rounded(-(-layer.tc // max(1, splits)))
    grid_x = -(-layer.tr // config(n, warps)[1])
    slots = sm_count() * ctas_per_sm(layer, n, cap, warps, xb, side)
    best, best_cost = cap, None
    least = -(-layer.tc // cap)  # splits: at least what the cap needs...
    most = 4 * least + 7
    if settings().max_splits:  # ...and at most the bound, where the cap allows it
        most = max(least, min(most, settings().max_splits))
    for s in range(least, most + 1):
        c = rounded(-(-layer.tc // s))
        ctas = grid_x * -(-layer.tc // c)
        cost = -(-ctas // slots) * (c + 4)  # + 4: a CTA's fixed start-up, in tiles
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


def waves(layer: DeviceLayer, n: int, chunk: int, warps: int, xb: int = 1, side: int = 0) -> int:
    """Waves of CTAs a launch of this chunk and CTA size needs on this GPU."""
    ctas = -(-layer.tr // warps) * -(-layer.tc // chunk)
    return -(-ctas // (sm_count() * ctas_per_sm(layer, n, chunk, warps, xb, side)))


@dataclass(frozen=True)
class Plan:
    """One launch: its kernel configuration, chunk along K, grid and dynamic shared memory."""

    nstage: int
    warps: int
    ilp: int
    minb: int
    chunk: int
    grid: tuple[int, int]
    smem: int


def plan(layer: DeviceLayer, n: int, splits: int | None = None, xb: int = 1, side: int = 0) -> Plan:
    """The launch of ``n`` (<= ``MAX_N``) columns. Warps per CTA: the default (8), or ``WIDE_WARPS`` for
    ``WIDE_N`` widths when CTAs of that many tile rows, each staging X once for all of them (so a larger
    chunk fits the same X budget per warp), need fewer waves (H200, N = 8: 1.03-1.30x on the shapes where
    the waves drop, slower where they do not); then the chunk for them."""
    base = config(n)[1]
    choices = [base]
    if not settings().warps and WIDE_N[0] <= n <= WIDE_N[1]:
        choices.append(WIDE_WARPS)
    best = None
    for w in choices:  # the wide CTA only when strictly fewer waves
        c = chunk_for(layer, n, splits, w, xb, side)
        wv = waves(layer, n, c, w, xb, side)
        if best is None or wv < best[0]:
            best = (wv, w, c)
    _, warps, chunk = best
    nstage, warps, ilp, minb = config(n, warps)
    ngc = -(-chunk // layer.gs_tiles) + 1
    return Plan(nstage, warps, ilp, minb, chunk, (-(-layer.tr // warps), -(-layer.tc // chunk)),
                smem_bytes(layer.bits, layer.pinv is not None, n, chunk, ngc, warps, xb, side))


def single_chunk(layer: DeviceLayer, n: int, splits: int | None = None, xb: int = 1, side: int = 0) -> bool:
    """True when every launch of an ``n``-column product covers the whole K in one CTA (no split-K), so the
    output is bit-identical to the CPU reference (split-K only changes the fp32 summation order)."""
    return all(plan(layer, min(MAX_N, n - n0), splits, xb, side).grid[1] == 1 for n0 in range(0, n, MAX_N))


def _padded(layer: DeviceLayer, x, dtype, what: str):
    """``x`` [N, K or Kp] of ``dtype`` as a contiguous, 16-byte aligned [N, Kp] on the GPU, zero past K (the kernel
    reads whole tiles); no copy when already so."""
    cp = require_cupy()
    kp = layer.tc * 64
    x = cp.asarray(x)
    if x.dtype != dtype or x.ndim != 2 or x.shape[1] not in (layer.shape[1], kp):
        raise KernelError(f"{what} must be {cp.dtype(dtype).name} [N, {layer.shape[1]}], got {x.dtype} {x.shape}")
    if x.shape[1] != kp:
        xp = cp.zeros((x.shape[0], kp), dtype=dtype)
        xp[:, : x.shape[1]] = x
        x = xp
    x = cp.ascontiguousarray(x)
    return x if x.data.ptr % 16 == 0 else x.copy()


def prepare_x(layer: DeviceLayer, x_codes, x_scales):
    """(int8 [N, Kp] padded, fp32 [N, G]) on the GPU; no copy when already in that form."""
    cp = require_cupy()
    x = _padded(layer, x_codes, cp.int8, "x_codes")
    xs = cp.ascontiguousarray(cp.asarray(x_scales, dtype=cp.float32))
    if xs.shape != (x.shape[0], layer.n_groups):
        raise KernelError(f"x_scales must be [{x.shape[0]}, {layer.n_groups}], got {xs.shape}")
    return x, xs


def prepare_x16(layer: DeviceLayer, x):
    """float16 [N, Kp] on the GPU, zero past K; no copy when already so."""
    return _padded(layer, x, require_cupy().float16, "x")


@cache
def _cc() -> int:
    cp = require_cupy()
    return int(cp.cuda.Device().compute_capability)


CLUSTER_UP_TO = 2   # split counts run as one cluster per row block (H200: 2 splits 1.08x faster, 3-8 slower)


def cluster_split(splits: int) -> bool:
    """True when a launch with ``splits`` CTAs along K runs them as one thread-block cluster per row block
    (sm_90+, 2 <= splits <= ``CLUSTER_UP_TO``), so the split-K sum goes through distributed shared memory
    instead of global atomics (docs/kernels.md, "v5"). The settings' ``cluster`` moves the bound (0: never;
    up to 8 portable, 16 with the non-portable opt-in) for timings and tests."""
    largest = settings().cluster
    largest = CLUSTER_UP_TO if largest is None else largest
    return 1 < splits <= largest and _cc() >= 90


@dataclass(frozen=True)
class Side:
    """The 8-bit outlier side product the kernel adds in its epilogue (docs/kernels.md, "Outlier side product"):
    activation codes int8 [N, n] and scales float32 [N, SG], weight codes int8 [M, n] and scales float32 [M, SG],
    side groups of ``group`` channels (CuPy arrays, or anything with ``data.ptr``, C-contiguous)."""

    x_codes: object
    x_scales: object
    w_codes: object
    w_scales: object
    group: int


def side_fusable(n: int, group: int, *pointers: int) -> bool:
    """Whether the kernel's epilogue computes a side product of ``n`` channels in groups of ``group``: 16-byte
    rows (n a multiple of 16, code arrays at ``pointers`` 16-byte aligned) and one group or groups of whole
    16-byte chunks; otherwise the separate ``outlier_side`` launch does."""
    one_group = -(-n // group) == 1
    return n > 0 and n % 16 == 0 and (one_group or group % 16 == 0) and all(p % 16 == 0 for p in pointers)


def staged_side(side: Side | None) -> int:
    """Outlier channels the kernel stages in shared memory with X for its epilogue: all of them for one side group
    (the default), none for several groups (read per output from global memory) or no side."""
    if side is None:
        return 0
    n = int(side.w_codes.shape[1])
    return n if -(-n // side.group) == 1 else 0


def _side_args(layer: DeviceLayer, side: Side | None, n0: int) -> tuple:
    if side is None:
        d = layer.dummy
        return (d, d, d, d), (np.int32(0), np.int32(1))
    n = int(side.w_codes.shape[1])
    if not side_fusable(n, side.group, side.x_codes.data.ptr, side.w_codes.data.ptr):
        raise KernelError(f"side product of {n} channels in groups of {side.group}: not fusable")
    return ((side.x_codes[n0:], side.x_scales[n0:], side.w_codes, side.w_scales),
            (np.int32(n), np.int32(side.group)))


def launch(layer: DeviceLayer, x, xs, y, *, splits: int | None = None, partial=None, stream=None,
           side: Side | None = None) -> None:
    """Launch on prepared inputs (``prepare_x``); writes y fp16 [N, M] or, with ``partial``, int32 sums.
    ``side``: the outlier side product added before the rounding. (A study build with ``IEBME_TRACE=1``,
    ``kernels/study.py``, writes per-CTA timestamps to the ``partial`` slot, which holds ``layer.dummy`` when
    ``partial`` is None: ``benchmarks/trace_iebme.py`` puts its buffer there.)"""
    n = x.shape[0]
    m, _ = layer.shape
    debug = partial is not None
    af16 = x.dtype.itemsize == 2  # float16 activations (prepare_x16): no scales, no side, no partial sums
    if af16 and (debug or side is not None):
        raise KernelError("float16 activations take no outlier side product and no integer partial sums")
    null = layer.dummy if layer.pinv is None else layer.pinv
    for n0 in range(0, n, MAX_N):
        nn = min(MAX_N, n - n0)
        nt = -(-nn // 8)
        p = plan(layer, nn, splits, 2 if af16 else 1, 0 if debug else staged_side(side))
        grid = p.grid
        fn = _kernel(layer.bits, nt, layer.pinv is not None, debug, p.nstage, p.warps, p.ilp, p.minb, af16)
        yp = y[n0:] if not debug else layer.dummy
        pp = partial[n0:] if debug else layer.dummy
        side_ptrs, side_sizes = _side_args(layer, None if debug else side, n0)
        xsp = layer.dummy if af16 else xs[n0:]
        args = (layer.values, layer.bitmaps, layer.offsets, null, layer.wsT, xsp, x[n0:], layer.ws_acc,
                layer.counters, yp, pp, *side_ptrs, np.int32(nn), np.int32(m), np.int32(layer.n_groups),
                np.int32(layer.tc * 64), np.int32(layer.mp), np.int32(layer.tr), np.int32(layer.tc),
                np.int32(layer.gs_tiles), np.int32(p.chunk), *side_sizes)
        block = (p.warps * 32,)
        cluster = (1, grid[1], 1) if not debug and cluster_split(grid[1]) else None
        if cluster is not None or programmatic():
            launch_ex(fn, grid, block, p.smem, args, cluster, programmatic(), stream)
        elif stream is None:
            fn(grid, block, args, shared_mem=p.smem)
        else:
            with stream:
                fn(grid, block, args, shared_mem=p.smem)


def spmm_iebme(layer: DeviceLayer, x_codes, x_scales, *, splits: int | None = None,
               debug_partials: bool = False, poison: bool = True, side: Side | None = None):
    """fp16 Y [N, M] (CuPy) of the layer on activations (int8 codes [N, K], scales [N, G]).

    ``side`` adds the 8-bit outlier side product in float32 before the one rounding (``side_fusable`` must
    hold). ``debug_partials=True`` returns the exact int32 group partial sums [N, M, G] instead. ``poison``
    fills Y with NaN first, so that an element the kernel fails to write shows (checks); the runtime skips
    that launch.
    """
    cp = require_cupy()
    x, xs = prepare_x(layer, x_codes, x_scales)
    n = x.shape[0]
    m, _ = layer.shape
    if debug_partials:
        partial = cp.zeros((n, m, layer.n_groups), dtype=cp.int32)
        launch(layer, x, xs, None, splits=splits, partial=partial)
        return partial
    y = cp.empty((n, m), dtype=cp.uint16)
    if poison:
        y.fill(0x7E00)  # fp16 NaN: every element must be written
    launch(layer, x, xs, y, splits=splits, side=side)
    return y.view(cp.float16)


def spmm_iebme16(layer: DeviceLayer, x, *, splits: int | None = None, poison: bool = True):
    """fp16 Y [N, M] (CuPy) of the layer on float16 activations [N, K] (W4A16 / W2A16): per group the float32 sum
    of code times activation (tensor cores), times the weight scale, float32 over groups, one float16 rounding."""
    cp = require_cupy()
    x = prepare_x16(layer, x)
    y = cp.empty((x.shape[0], layer.shape[0]), dtype=cp.uint16)
    if poison:
        y.fill(0x7E00)
    launch(layer, x, None, y, splits=splits)
    return y.view(cp.float16)
