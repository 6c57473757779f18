"""GPU Tiled-CBC spMspV (decode) with dynamic pruning; see ``tiled_cbc_spmspv.cu``.

``spmspv(dev, x, tau)`` computes ``y[m] = sum over k with |x_k| > tau of W[m, k] x[k]`` (fp32 sums,
fp16 or fp32 out) from a :class:`DeviceTiledCBC`. ``tau=None`` (or negative) turns pruning off. ``x`` of shape
``[N, K]`` (a batched decode step) gives ``[N, M]``, each row its own spMspV: up to 8 rows a launch, which reads a
column once if it is active in any of them (docs/kernels.md, "Tiled-CBC spMspV of several rows").
The kernel (v2): a warp per GTile, one copy batch per GTile, ``stages`` GTiles in flight per warp. (The first
kernel, v1, a list of active columns with one cp.async + wait per column, is gone; docs/kernels.md keeps its
figures.)
"""

from __future__ import annotations

import numpy as np

from . import sm_count, study
from .errors import KernelError
from .loader import load_module, require_cupy
from .tiled_cbc_device import TILE, DeviceTiledCBC

BITS = (16, 4, 2)
# v2 instantiations (bits, warps, stages), as in the .cu file; the first of each bits is its default
V2_CONFIGS = ((16, 4, 2), (16, 4, 3), (16, 8, 2), (4, 4, 3), (2, 4, 3))
MODES = {16: (0, 3), 4: (0, 4), 2: (0,)}  # v2 value decodes built per value type (see DEFAULT_MODES)
_EXPR = (
    tuple(f"tcbc_spmspv2<{b}, {w}, {s}>" for b, w, s in V2_CONFIGS)
    + tuple(f"tcbc_spmspv2<{b}, {w}, {s}, {m}>" for b, w, s in V2_CONFIGS for m in MODES[b] if m)
)
# value decode of v2: 0 = a lane's 8 rows of each active column, one predicated 2-byte LDS (fp16) or code per
# set bit (b-bit codes: their decode); fp16 only: 3 = two columns per
# pass, a half-warp per column and 16 rows per lane (1.05-1.07x mode 0 on the H200); 4-bit codes only: 4 = mode 3's
# layout, each byte's codes scattered to its rows by byte permutes (no per-row predicate; its loop 110 SASS
# instructions per two columns against mode 0's 130, about 3% fewer a GTile in all; a study, not yet on a GPU)
DEFAULT_MODES = {16: 3, 4: 0, 2: 0}  # the launcher's decode per value type
ROWS = (2, 4, 8)  # input rows of the several-row instantiations (mode 0, each value type's default config)


def v2_default_config_bits(bits: int) -> tuple[int, int]:
    """(warps, stages) of the v2 kernel for ``bits``-bit values (16: fp16), the first of V2_CONFIGS."""
    return next((w, s) for b, w, s in V2_CONFIGS if b == bits)


_EXPR += tuple(f"tcbc_spmspv2<{b}, {w}, {s}, 0, {r}>" for b in BITS for r in ROWS
               for w, s in [v2_default_config_bits(b)])
_SMEM_SET: dict[tuple[study.Build, str], int] = {}
SMEM_PER_SM = 227 * 1024


KERNEL = "tiled_cbc_spmspv"  # the .cu file's stem; studies time other revisions of it through kernels/study.py


def _module(bits: int):
    """The module of ``bits``-bit values (16: fp16) alone (the .cu file's TCBC_BITS): a layer compiles its own."""
    return load_module(KERNEL, tuple(e for e in _EXPR if e.startswith(f"tcbc_spmspv2<{bits},")),
                       options=(f"-DTCBC_BITS={bits}",))


def v2_slot_bytes(dev: DeviceTiledCBC, rows: int = 1) -> int:
    """Bytes of one v2 ring slot: header (bitmaps, list, scales; with several input rows, each list entry's
    ``rows`` inputs: Hdr in the .cu file) + the layer's largest GTile + 32 B slack (the decode's widest read, two
    16-byte chunks from a lane's first value, may pass the last run's end)."""
    bits = 16 if dev.bits is None else int(dev.bits)
    hdr = (768 if bits == 16 else 1280) + (64 * rows if rows > 1 else 0)
    return -(-(hdr + dev.max_gtile_value_bytes() + 32) // 16) * 16


SEL_TABLE_BYTES = 1024  # mode 4's byte-permute selectors (the .cu file's scatter_selectors), after the ring


def v2_smem(dev: DeviceTiledCBC, warps: int, stages: int, rows: int = 1, mode: int = 0) -> int:
    """Dynamic shared memory of a launch: the ring (or the reduction's floats), and mode 4's selector table."""
    ring = max(warps * stages * v2_slot_bytes(dev, rows), rows * warps * TILE[0] * 4)
    return ring + (SEL_TABLE_BYTES if mode == 4 else 0)


def v2_default_config(dev: DeviceTiledCBC) -> tuple[int, int]:
    """(warps, stages) of the v2 kernel for this layer's value type."""
    return v2_default_config_bits(16 if dev.bits is None else int(dev.bits))


def _resident_blocks(dev: DeviceTiledCBC, warps: int, stages: int, sms: int | None, rows: int = 1,
                     mode: int = 0) -> int:
    """Blocks of the v2 kernel that fit on the GPU at once (shared memory and threads per SM; registers are not
    counted: mode 4's launch bounds hold it to mode 0's 72 for 4-bit codes)."""
    smem = v2_smem(dev, warps, stages, rows, mode)
    return (sm_count() if sms is None else sms) * max(1, min(SMEM_PER_SM // (smem + 1024), 2048 // (32 * warps)))


def v2_default_chunk(dev: DeviceTiledCBC, warps: int, stages: int, sms: int | None = None,
                     scale: float = 1.0, rows: int = 1, mode: int = 0) -> int:
    """GTiles per block: ``scale`` = 1 makes one resident wave (as many blocks as fit on the GPU at once,
    each warp streaming an equal share of its GTile row); ``scale`` < 1 makes 1/scale waves of smaller blocks."""
    gr, gc = dev.grid
    splits = max(1, min(gc, int(_resident_blocks(dev, warps, stages, sms, rows, mode) / scale) // gr))
    return int(min(gc, max(warps, -(-gc // splits))))


STREAMK_MAX_FILL = 0.9  # stream-K when a split-K launch would leave >= 10% of the resident block slots empty
STREAMK_MIN_SHARE = 32  # ...and each stream-K block gets at least this many GTiles (docs/kernels.md, H200 study)


def use_streamk(dev: DeviceTiledCBC, warps: int, stages: int, sms: int | None = None, rows: int = 1,
                mode: int = 0) -> bool:
    """The default launch: stream-K where split-K fills the GPU badly and the layer is large (below the
    share bound a block's second segment, a pipeline restart and one more reduction, costs more than it saves)."""
    gr, gc = dev.grid
    resident = _resident_blocks(dev, warps, stages, sms, rows, mode)
    fill = -(-gc // v2_default_chunk(dev, warps, stages, sms, rows=rows, mode=mode)) * gr / resident
    return fill < STREAMK_MAX_FILL and gr * gc >= STREAMK_MIN_SHARE * resident


def streamk_blocks(dev: DeviceTiledCBC, warps: int, stages: int, sms: int | None = None,
                   scale: float = 1.0, rows: int = 1, mode: int = 0) -> int:
    """Blocks of a stream-K launch: one resident wave (``scale`` < 1: 1/scale waves), at least ``warps`` GTiles
    each, so that every block's share of the T GTiles differs from the others' by at most one GTile."""
    gr, gc = dev.grid
    return int(max(1, min(int(_resident_blocks(dev, warps, stages, sms, rows, mode) / scale), gr * gc // warps)))


def streamk_parts(grid: tuple[int, int], blocks: int) -> int:
    """Most blocks whose stream-K share meets one GTile row (the partial rows a launch needs)."""
    gr, gc = grid
    t = gr * gc

    def owner(g):  # the block whose share holds GTile g (as in the .cu file)
        return ((g + 1) * blocks - 1) // t

    rows = np.arange(gr, dtype=np.int64)
    return int((owner((rows + 1) * gc - 1) - owner(rows * gc) + 1).max())


def spmspv(
    dev: DeviceTiledCBC,
    x,
    tau: float | None,
    out=None,
    out_dtype=np.float16,
    chunk: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
    mode: int | None = None,
    streamk: bool | None = None,
    scale: float = 1.0,
    blocks: int | None = None,
):
    """Launch the kernel on the current stream; returns ``out`` (CuPy [M], or [N, M] for ``x`` [N, K]; fp16 or
    fp32).

    ``x`` [K]: one row. ``x`` [N, K]: each row its own spMspV, up to 8 rows a launch (the several-row kernels:
    mode 0 and each value type's default warps and stages; ``mode``, ``warps`` and ``stages`` apply to N = 1).
    ``mode``: the value decode, one of ``MODES[bits]`` (see the .cu file; None: the default).

    ``streamk``: True launches one resident wave of blocks, each with an equal share of the layer's GTiles in
    row-major order (``chunk`` is then ignored; ``scale`` < 1 makes 1/scale waves; ``blocks`` sets the block count);
    False launches split-K chunks of one GTile row per block; None (default) picks stream-K by :func:`use_streamk`
    unless ``chunk`` is given."""
    cp = require_cupy()
    M, K = dev.shape
    if x.ndim not in (1, 2) or x.shape[-1] != K or x.dtype != cp.float16 or (x.ndim == 2 and x.shape[0] < 1):
        raise KernelError(f"x must be a CuPy float16 array of shape ({K},) or (N, {K}), got {x.dtype} {x.shape}")
    if x.data.ptr % 16 or not x.flags.c_contiguous:  # the kernels copy X in 16-byte pieces
        x = cp.ascontiguousarray(x).copy()
    if out is None:
        out = cp.empty(x.shape[:-1] + (M,), dtype=out_dtype)
    if out.dtype not in (cp.float32, cp.float16) or out.shape != x.shape[:-1] + (M,) or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 or float32 array of shape {x.shape[:-1] + (M,)}")
    launch = dict(tau=tau, chunk=chunk, streamk=streamk, scale=scale, blocks=blocks)
    if x.ndim == 1 or x.shape[0] == 1:
        _launch(dev, x, 1, out, rows=1, stages=stages, warps=warps, mode=mode, **launch)
        return out
    for r0 in range(0, x.shape[0], ROWS[-1]):
        n = min(ROWS[-1], x.shape[0] - r0)
        rows = next(r for r in ROWS if r >= n)
        _launch(dev, x[r0:], n, out[r0:], rows=rows, stages=None, warps=None, mode=0, **launch)
    return out


def _launch(dev: DeviceTiledCBC, x, nrows: int, out, tau, rows: int, chunk, stages, warps, mode, streamk, scale,
            blocks) -> None:
    """One launch over the first ``nrows`` rows of ``x`` (the ``rows``-row kernel; ``out`` [nrows, M] or [M])."""
    cp = require_cupy()
    M, K = dev.shape
    bits = 16 if dev.bits is None else int(dev.bits)
    out_f32 = out.dtype == cp.float32
    gr, gc = dev.grid
    t = np.float32(-1.0 if tau is None else tau)
    scales = dev.scales_t if dev.scales_t is not None else dev.dummy
    group = dev.group_size or 1
    if warps is None or stages is None:
        warps, stages = v2_default_config(dev)
    if (bits, warps, stages) not in V2_CONFIGS:
        raise KernelError(f"v2 (bits, warps, stages) must be one of {V2_CONFIGS}")
    if mode is None:
        mode = DEFAULT_MODES[bits]
    if mode not in MODES[bits]:
        raise KernelError(f"mode must be one of {MODES[bits]} for {bits}-bit values, got {mode}")
    slot = v2_slot_bytes(dev, rows)
    smem = v2_smem(dev, warps, stages, rows, mode)
    if streamk is None:
        streamk = chunk is None and use_streamk(dev, warps, stages, rows=rows, mode=mode)
    if streamk:
        if blocks is None:
            blocks = streamk_blocks(dev, warps, stages, scale=scale, rows=rows, mode=mode)
        blocks = int(blocks)
        if not 1 <= blocks <= gr * gc:
            raise KernelError(f"blocks must be in [1, {gr * gc}] (the layer's GTiles), got {blocks}")
        grid, nparts, chunk = (blocks, 1), streamk_parts(dev.grid, blocks), 0
    else:
        chunk = v2_default_chunk(dev, warps, stages, scale=scale, rows=rows, mode=mode) if chunk is None else int(chunk)
        grid = (-(-gc // chunk), gr)
        nparts = grid[0]
    name = f"tcbc_spmspv2<{bits}, {warps}, {stages}" + (f", 0, {rows}>" if rows > 1 else
                                                         ">" if mode == 0 else f", {mode}>")
    f = _module(bits).get_function(name)
    key = (study.build(KERNEL), name)
    if _SMEM_SET.get(key, -1) < smem:  # once per size: no driver call while a graph is captured
        f.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[key] = smem
    f(grid, (warps * 32,),
      (dev.bitmap, dev.colinfo, dev.tile_offset, dev.values_u8, x, t, scales, np.int32(group), np.int32(gc),
       np.int32(M), np.int32(K), np.int32(dev.Mp), np.int32(chunk), np.int32(slot), np.int32(streamk),
       dev.partial(nparts * rows), dev.tickets, out, np.int32(out_f32), np.int32(nrows), np.int32(K)),
      shared_mem=smem)


def bytes_read(dev: DeviceTiledCBC, x_host: np.ndarray, tau: float | None) -> int:
    """Bytes the kernel must read for this input ([K], or [N, K] in launches of up to 8 rows): ColInfo, TileOffset,
    X (and the scales of b-bit codes) always; bitmap and values of the columns active in any row of a launch
    only (the achieved-bandwidth denominator)."""
    x_host = np.asarray(x_host)
    if x_host.ndim == 2 and x_host.shape[0] > ROWS[-1]:
        return sum(bytes_read(dev, x_host[r0 : r0 + ROWS[-1]], tau) for r0 in range(0, x_host.shape[0], ROWS[-1]))
    x_host = x_host.reshape(-1, x_host.shape[-1])
    M, K = dev.shape
    gr, gc = dev.grid
    t = -1.0 if tau is None else float(tau)
    act = np.zeros(gc * TILE[1], dtype=bool)
    act[:K] = (np.abs(x_host.astype(np.float32)) > t).any(axis=0)
    ci = require_cupy().asnumpy(dev.colinfo).astype(np.int64).reshape(gr, gc * TILE[1])
    nnz = ci & 0xFFFF
    vbits = 16 if dev.bits is None else int(dev.bits)
    padded = -(-nnz * vbits // 128) * 16
    live = act[None, :] & (nnz > 0)
    scales = 0 if dev.scales_t is None else dev.scales_t.nbytes  # b-bit codes: every group scale, once
    return int((padded * live).sum() + 32 * live.sum() + dev.colinfo.nbytes + dev.tile_offset.nbytes + 2 * x_host.size
               + scales)
