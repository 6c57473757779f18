"""GPU Tiled-CBC SpMM (prefill) on tensor cores; see ``tiled_cbc_spmm.cu``.

``spmm(dev, X)`` computes ``Y[N, M] = X[N, K] @ W^T`` (fp16 in, fp32 mma accumulation, fp16 out)
from a :class:`DeviceTiledCBC`. b-bit layers (int codes) take the ``"dense"`` method only: the codes times their
scales decoded once, exactly, as two float16 halves, then cuBLAS (the runtime's path for them from ``DENSE_FROM_N``
rows).
Methods: ``"warp"`` (v3, the default up to ``WARP_UP_TO_N`` tokens): every warp streams a quarter of a GTile
row through its own cp.async ring and builds the mma fragments in registers, no block barrier in the loop;
``"fused"`` (v2): split-K with a deterministic one-launch ticket, NST-stage cp.async ring, decode of step
t+1 overlapped with the mma of step t; ``"wgmma"`` (v4, compute capability 9.0 only, the default there above
``WARP_UP_TO_N`` up to ``WGMMA_UP_TO_N`` tokens): the decode writes a 128-byte-swizzled W tile to shared
memory and Hopper's asynchronous warpgroup MMA multiplies it while the next step is decoded;
``"dense"``: decode once, then cuBLAS (the default from ``DENSE_FROM_N`` tokens, above ``WGMMA_UP_TO_N`` on
sm_90). Earlier generations (v1, the serial decode -> mma kernel; v5, warp-specialised with W decoded into
wgmma's A registers) were slower at every N and are gone (docs/kernels.md keeps their figures).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from . import sm_count
from .cublas_gemm import dense_halves, gemm_decoded
from .errors import KernelError
from .loader import load_module, require_cupy
from .tiled_cbc_device import TILE, DeviceTiledCBC

GK = 2
# v2: (BN, NST, MINB) as instantiated in the .cu file
V2_CONFIGS = ((32, 3, 2), (64, 3, 2), (64, 3, 1), (128, 3, 1), (128, 4, 1), (32, 5, 2), (64, 4, 2))
# v3: (NT, NST, MINB) as instantiated in the .cu file: n8 tiles (tokens / 8), ring slots per warp, blocks per SM
V3_CONFIGS = ((1, 4, 4), (1, 6, 3), (2, 4, 4), (2, 6, 3), (4, 4, 3), (4, 4, 4), (8, 4, 2), (8, 4, 3))
V3_W, V3_XS = 2560, 48  # ring slot: W bytes of a GTile quarter, then X rows of V3_XS bytes (as in the .cu)
V3_MAX_N = 64  # tokens per v3 launch (NT = 8); more tokens take several launches
_SMEM_SET: dict[str, int] = {}
_EXPR = (
    tuple(f"tcbc_spmm2<{bn}, {GK}, {nst}, {mb}>" for bn, nst, mb in V2_CONFIGS)
    + tuple(f"tcbc_spmm3<{nt}, {nst}, {mb}>" for nt, nst, mb in V3_CONFIGS)
)
# decode to dense (tiled_cbc_decode.cu, a module of its own: a prompt compiles these three kernels in 0.7 s, not the
# SpMM module's 12 s of tensor-core templates; nvcc for sm_90a on the development VM, 2026-12-07)
_EXPR_DECODE = ("tcbc_decode_dense2", "tcbc_decode_dense_int<4>", "tcbc_decode_dense_int<2>")
DD_G = 4  # GTiles side by side per decode_dense block (DD_G in tiled_cbc_decode.cu)
DENSE_FROM_N = 32  # method="auto": decode once + cuBLAS from this many tokens on (see docs/kernels.md)
WARP_UP_TO_N = 8  # method="auto": the warp-streamed kernel (v3) up to this many tokens (docs/kernels.md)
WGMMA_UP_TO_N = 32  # method="auto" on sm_90: the wgmma kernel (v4) above WARP_UP_TO_N up to here (docs/kernels.md)
_DENSE_WS: dict[tuple[int, int], object] = {}


# v4 (wgmma, sm_90a only): (BN, TPR, NST) as instantiated in the .cu file, in order of preference per BN: tokens
# per block, threads per row of the 256-row GTile row (1: 256 threads, 2: 512), ring stages (more prefetch
# further where shared memory allows). A step is always 4 GTiles (64 columns, one 128-byte swizzle row).
# 512-thread blocks up to BN = 64 (1.1x the 256-thread ones at N <= 32), 256 threads from BN = 128 (512 spill there)
V4_CONFIGS = ((16, 2, 6), (16, 2, 3), (32, 2, 6), (32, 2, 3), (64, 2, 5), (64, 2, 3), (128, 1, 4), (128, 1, 3),
              (192, 1, 3))
V4_GK = 4
_EXPR_V4 = tuple(f"tcbc_spmm4<{bn}, {tpr}, {nst}>" for bn, tpr, nst in V4_CONFIGS)


def wgmma_available() -> bool:
    """True on a compute-capability 9.0 GPU (H100 / H200), where the module is built for sm_90a and holds v4."""
    cp = require_cupy()
    return _is_sm90(cp.cuda.Device().id)


@cache
def _is_sm90(device: int) -> bool:  # one driver query per device: launches may be captured into graphs
    return require_cupy().cuda.Device(device).compute_capability == "90"


def auto_method(n: int, wgmma: bool) -> str:
    """The method ``method="auto"`` takes for n tokens; ``wgmma``: the device runs v4 (``wgmma_available``)."""
    if n <= WARP_UP_TO_N:
        return "warp"
    if wgmma and n <= WGMMA_UP_TO_N:
        return "wgmma"
    return "dense" if n >= DENSE_FROM_N else "fused"


def _module():
    if wgmma_available():  # CuPy appends its own -arch=sm_90; NVRTC keeps the arch-specific target
        return load_module("tiled_cbc_spmm", _EXPR + _EXPR_V4, options=("-arch=sm_90a",))
    return load_module("tiled_cbc_spmm", _EXPR)


def _decode_module():
    return load_module("tiled_cbc_decode", _EXPR_DECODE)


def default_config(n: int) -> tuple[int, int, int]:
    """(BN, NST, MINB) of the v2 kernel for N tokens."""
    if n <= 32:
        return (32, 5, 2)
    if n <= 256:
        return (64, 4, 2)
    return (128, 4, 1)


def decode_dense(dev: DeviceTiledCBC, out=None):
    """W as a dense CuPy fp16 array decoded on the GPU, Kp = K padded to 16 (columns >= K are zero): the float16
    values as [M, Kp]; 4-bit codes as [M, 2 Kp], each weight w = code x scale (exact in float32) as two float16
    halves, hi = fp16(w) in columns [0, Kp) and lo = fp16(w - hi) in [Kp, 2 Kp), so that hi + lo == w; 2-bit codes
    as [M, Kp] (``dense_halves``; ``tiled_cbc_reference.decoded_dense_reference``)."""
    cp = require_cupy()
    M, _ = dev.shape
    gr, gc = dev.grid
    kp = gc * TILE[1]
    width = dense_halves(dev.bits) * kp
    if out is None:
        out = cp.empty((M, width), dtype=cp.float16)
    if out.shape != (M, width) or out.dtype != cp.float16 or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 [{M}, {width}] array")
    grid, common = (-(-gc // DD_G), gr), (dev.bitmap, dev.colinfo, dev.tile_offset)
    if dev.bits is None:
        _decode_module().get_function("tcbc_decode_dense2")(
            grid, (256,), (*common, dev.values_u16, out, np.int32(gc), np.int32(M), np.int32(kp)))
    else:
        _decode_module().get_function(f"tcbc_decode_dense_int<{dev.bits}>")(
            grid, (256,), (*common, dev.values_u8, dev.scales_t, out, np.int32(gc), np.int32(M), np.int32(kp),
                           np.int32(dev.Mp), np.int32(dev.group_size)))
    return out


def spmm_dense(dev: DeviceTiledCBC, X, out=None):
    """Large-N prefill: decode W into a workspace (one per shape, reused), then one cuBLAS fp16 GEMM (fp32
    accumulation). Prefill at large N is compute-bound, so this trades one extra pass over W (~3 bytes per
    weight) for cuBLAS's wgmma kernels, which mma.sync cannot match on Hopper. 4-bit codes: the product of
    [X, X] with W's hi | lo halves (``decode_dense``), 2 Kp inner columns, so every product is exact and the sum is
    the CPU reference's up to float32 summation order. The GEMM goes through ``cublas_gemm`` (not CuPy's bindings),
    so the whole path captures into a CUDA graph. X: fp16 [N, Kx >= K] contiguous (columns past K are ignored)."""
    cp = require_cupy()
    M, K = dev.shape
    kp = dev.grid[1] * TILE[1]
    key = (M, dense_halves(dev.bits) * kp)
    ws = _DENSE_WS.get(key)
    if ws is None:  # one workspace per shape, shared by all layers of that shape
        ws = _DENSE_WS[key] = cp.empty(key, dtype=cp.float16)
    X = cp.ascontiguousarray(X)
    if X.dtype != cp.float16 or X.ndim != 2 or X.shape[1] < K:
        raise KernelError(f"X must be a float16 [N, >= {K}] array, got {X.dtype} {X.shape}")
    n = X.shape[0]
    if out is None:
        out = cp.empty((n, M), dtype=cp.float16)
    if out.shape != (n, M) or out.dtype != cp.float16 or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 [{n}, {M}] array")
    decode_dense(dev, ws)
    gemm_decoded(ws, X, K, kp, dense_halves(dev.bits), out)
    return out


def default_splits(dev: DeviceTiledCBC, n: int, bn: int, min_steps: int = 4) -> int:
    """Split K so that about two blocks per SM exist, keeping >= ``min_steps`` steps per block."""
    gr, gc = dev.grid
    nsteps = -(-gc // GK)
    blocks = gr * -(-n // bn)
    want = max(1, -(-2 * sm_count() // blocks))
    return int(max(1, min(want, nsteps // min_steps)))


def v3_config(n: int) -> tuple[int, int, int]:
    """(NT, NST, MINB) of the v3 kernel for a launch of n <= V3_MAX_N tokens."""
    nt = next(v for v in (1, 2, 4, 8) if 8 * v >= n)
    return next(c for c in V3_CONFIGS if c[0] == nt)


def v3_splits(dev: DeviceTiledCBC, minb: int, min_tiles: int = 16) -> int:
    """Split K so that every SM gets ``minb`` blocks (4 warps each), keeping >= min_tiles GTiles per warp."""
    gr, gc = dev.grid
    want = -(-sm_count() * minb // gr)
    return int(max(1, min(want, gc // min_tiles)))


def spmm_warp(dev: DeviceTiledCBC, X, out, config: tuple[int, int, int] | None = None, splits: int | None = None):
    """v3 launches (<= V3_MAX_N tokens each) into ``out`` [N, M]; X is fp16 [N, Kx] with Kx % 8 == 0."""
    N, Kx = X.shape
    M = dev.shape[0]
    gr, gc = dev.grid
    for n0 in range(0, N, V3_MAX_N):
        n = min(V3_MAX_N, N - n0)
        cfg = v3_config(n) if config is None else tuple(config)
        if cfg not in V3_CONFIGS:
            raise KernelError(f"config must be one of {V3_CONFIGS}")
        nt, nst, mb = cfg
        if 8 * nt < n:
            raise KernelError(f"config {cfg} covers {8 * nt} tokens, this launch has {n}")
        sp = v3_splits(dev, mb) if splits is None else max(1, min(int(splits), gc))
        cps = -(-gc // sp)
        sp = -(-gc // cps)
        smem = 4 * nst * (V3_W + 8 * nt * V3_XS)
        name = f"tcbc_spmm3<{nt}, {nst}, {mb}>"
        f = _module().get_function(name)
        _set_smem(f, name, smem)
        part = dev.partial(sp * n) if sp > 1 else dev.dummy
        f((gr, sp), (128,),
          (dev.bitmap, dev.colinfo, dev.tile_offset, dev.values_u16, X[n0:n0 + n], out[n0:n0 + n], np.int32(gc),
           np.int32(M), np.int32(Kx), np.int32(n), np.int32(dev.Mp), np.int32(cps), part, dev.spmm_tickets(gr)),
          shared_mem=smem)
    return out


def _split_plan(nsteps: int, splits: int) -> tuple[int, int]:
    """(blocks along K, steps per block) for ``splits`` requested (clamped to 1..nsteps, no empty block)."""
    sps = -(-nsteps // max(1, min(int(splits), nsteps)))
    return -(-nsteps // sps), sps


def v4_smem(dev: DeviceTiledCBC, config: tuple[int, int, int], sps: int) -> int:
    """Dynamic shared memory of one v4 block (layout in the .cu file; 1024 bytes of slack to align it)."""
    bn, _, nst = config
    gk = V4_GK
    bk = TILE[1] * gk
    raw = -(-dev.max_window_bytes(gk) // 16) * 16
    return 1024 + 2 * TILE[0] * bk * 2 + nst * (bn * bk * 2 + raw + bk * 36) + bk * 64 + (sps * gk + 1) * 4


def v4_config(dev: DeviceTiledCBC, n: int, limit: int) -> tuple[int, int, int]:
    """(BN, TPR, NST) of the v4 kernel for n tokens: the smallest BN covering n (at most 128), the first config
    of that BN in V4_CONFIGS whose shared memory fits ``limit`` bytes (one block per SM)."""
    bn = next((b for b in (16, 32, 64, 128) if b >= n), 128)
    nsteps = -(-dev.grid[1] // V4_GK)
    fits = [c for c in V4_CONFIGS if c[0] == bn and v4_smem(dev, c, nsteps) <= limit]
    if not fits:
        raise KernelError(f"no v4 configuration for {n} tokens fits {limit} bytes of shared memory")
    return fits[0]


def v4_splits(dev: DeviceTiledCBC, n: int, config: tuple[int, int, int], smem: int) -> int:
    """Split K to fill the GPU's resident block slots: the split count minimising waves x (steps per block +
    2 to fill the pipeline) plus the fp32 partial sums' traffic in step units (a step moves ~20 KB per SM)."""
    bn = config[0]
    gr, gc = dev.grid
    nsteps = -(-gc // V4_GK)
    sms = sm_count()
    slots = sms * max(1, 233472 // (smem + 1024))
    blocks = gr * -(-n // bn)
    best, best_cost = 1, float("inf")
    for sp in range(1, max(1, nsteps // 4) + 1):
        waves = -(-blocks * sp // slots)
        cost = waves * (-(-nsteps // sp) + 2) + (sp > 1) * sp * n * dev.Mp * 8 / (sms * 20480)
        if cost < best_cost:
            best, best_cost = sp, cost
    return best


def spmm_wgmma(dev: DeviceTiledCBC, X, out, config: tuple[int, int, int] | None = None, splits: int | None = None):
    """v4 launch (sm_90a: decode into shared memory, wgmma) into ``out`` [N, M]; X is fp16 [N, Kx], Kx % 8 == 0."""
    cp = require_cupy()
    if not wgmma_available():
        raise KernelError("method='wgmma' needs a compute-capability 9.0 GPU (sm_90a)")
    N, Kx = X.shape
    M = dev.shape[0]
    gr, gc = dev.grid
    limit = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    cfg = v4_config(dev, N, limit) if config is None else tuple(config)
    if cfg not in V4_CONFIGS:
        raise KernelError(f"config must be one of {V4_CONFIGS}")
    bn, tpr, nst = cfg
    gk = V4_GK
    nsteps = -(-gc // gk)
    sp, sps = _split_plan(nsteps, v4_splits(dev, N, cfg, v4_smem(dev, cfg, 1)) if splits is None else splits)
    smem = v4_smem(dev, cfg, sps)
    if smem > limit:
        raise KernelError(f"v4 config {cfg} needs {smem} bytes of shared memory, the device allows {limit}")
    raw = -(-dev.max_window_bytes(gk) // 16) * 16
    ntn = -(-N // bn)
    name = f"tcbc_spmm4<{bn}, {tpr}, {nst}>"
    f = _module().get_function(name)
    _set_smem(f, name, smem)
    part = dev.partial(sp * N) if sp > 1 else dev.dummy
    tickets = dev.spmm_tickets(gr * ntn) if sp > 1 else dev.tickets
    f((ntn, gr, sp), (256 * tpr,),
      (dev.bitmap, dev.colinfo, dev.tile_offset, dev.values_u16, X, out, np.int32(gc), np.int32(M), np.int32(Kx),
       np.int32(N), np.int32(dev.Mp), np.int32(raw), np.int32(sps), part, tickets), shared_mem=smem)
    return out


def _set_smem(f, name: str, smem: int) -> None:
    if _SMEM_SET.get(name, -1) < smem:  # once per size: no driver call while a graph is captured
        f.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[name] = smem


def spmm(dev: DeviceTiledCBC, X, out=None, bn: int | None = None, config: tuple[int, int, int] | None = None,
         splits: int | None = None, method: str = "auto"):
    """Launch on the current stream; returns ``out`` (CuPy fp16 [N, M]).

    method: "warp" (v3, ``spmm_warp``; ``config`` is then its (NT, NST, MINB)), "fused" (the v2 tensor-core
    kernel; ``config`` (BN, NST, MINB) or ``bn``), "wgmma" (v4, ``spmm_wgmma``; config (BN, TPR, NST)), "dense"
    (``spmm_dense``) or "auto" (``auto_method``)."""
    cp = require_cupy()
    if dev.bits is not None and method not in ("dense", "auto"):
        raise KernelError(f"b-bit Tiled-CBC values take method 'dense' (decode once, then cuBLAS), not {method!r}")
    M, K = dev.shape
    if X.ndim != 2 or X.shape[1] != K or X.dtype != cp.float16:
        raise KernelError(f"X must be a CuPy float16 array [N, {K}], got {X.dtype} {X.shape}")
    if K % 8:
        Xp = cp.zeros((X.shape[0], -(-K // 8) * 8), dtype=cp.float16)
        Xp[:, :K] = X
        X, Kx = Xp, Xp.shape[1]
    else:
        X, Kx = cp.ascontiguousarray(X), K
    N = X.shape[0]
    if method not in ("warp", "fused", "dense", "wgmma", "auto"):
        raise KernelError(f"method must be warp, fused, dense, wgmma or auto, got {method!r}")
    if method == "auto":
        method = "dense" if dev.bits is not None else auto_method(N, wgmma_available())
    if method == "dense":
        return spmm_dense(dev, X, out)
    if out is None:
        out = cp.empty((N, M), dtype=cp.float16)
    if out.shape != (N, M) or out.dtype != cp.float16 or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 [{N}, {M}] array")
    if method == "wgmma":
        return spmm_wgmma(dev, X, out, config, splits)
    if method == "warp":
        return spmm_warp(dev, X, out, config, splits)
    gr, gc = dev.grid
    if not hasattr(dev, "_spmm_raw"):
        dev._spmm_raw = -(-dev.max_window_bytes(GK) // 16) * 16
    raw = dev._spmm_raw
    bk = TILE[1] * GK
    if config is None:
        config = default_config(N) if bn is None else next(c for c in V2_CONFIGS if c[0] == bn)
    if tuple(config) not in V2_CONFIGS:
        raise KernelError(f"config must be one of {V2_CONFIGS}")
    bn2, nst, mb = config
    nsteps = -(-gc // GK)
    splits = default_splits(dev, N, bn2) if splits is None else max(1, min(int(splits), nsteps))
    sps = -(-nsteps // splits)
    splits = -(-nsteps // sps)
    ntn = -(-N // bn2)
    smem = (nst * raw + 2 * bk * (TILE[0] + 8) * 2 + nst * bn2 * (bk + 8) * 2 + nst * GK * TILE[1] * 36
            + (sps * GK + 1) * 4)
    smem = -(-smem // 16) * 16
    name = f"tcbc_spmm2<{bn2}, {GK}, {nst}, {mb}>"
    f = _module().get_function(name)
    _set_smem(f, name, smem)
    part = dev.partial(splits * N) if splits > 1 else dev.dummy
    tickets = dev.spmm_tickets(gr * ntn) if splits > 1 else dev.tickets
    f((ntn, gr, splits), (256,),
      (dev.bitmap, dev.colinfo, dev.tile_offset, dev.values_u16, X, out, np.int32(gc), np.int32(M),
       np.int32(Kx), np.int32(N), np.int32(dev.Mp), np.int32(raw), np.int32(sps), part, tickets),
      shared_mem=smem)
    return out
