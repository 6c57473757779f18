"""GPU IE-BME W4A4 / W2A4 SpMM (CuPy RawModule over ``iebme_spmm.cu``).

Usage::

    layer = prepare_layer(m, w_scales, group_size)       # upload once (arrays exactly as stored)
    y = spmm_iebme(layer, x_codes, x_scales)             # fp16 [N, M] on the GPU
    p = spmm_iebme(layer, x_codes, x_scales, debug_partials=True)   # int32 [N, M, G], exact

Only the default geometry (tile 16x64, areas 2x2) and 4- or 2-bit codes have a kernel. The weight
scales are transposed once to [G, Mp64] at upload so the producer warp can stage a group's 64 row
scales with two 16-byte copies; all IE-BME arrays are used as stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from ..formats.iebme import IEBMEMatrix
from .iebme_reference import check_group_size

SOURCE = Path(__file__).with_name("iebme_spmm.cu")
S = int(os.environ.get("UNIONSPARSE_IEBME_S", 4))  # tiles per row per stage (IEBME_S in the .cu)
STAGES = int(os.environ.get("UNIONSPARSE_IEBME_STAGES", 3))  # ring depth (IEBME_STAGES)
WARPS = 4
MAX_N = 32       # columns per launch; larger N is cut into launches of 32


def _cupy():
    import cupy

    return cupy


def smem_bytes(bits: int, nt: int, perm: bool) -> int:
    """Dynamic shared memory of one CTA; mirrors ``Layout`` in the .cu."""
    vb = 1024 * bits // 8
    vrow = S * vb + 16
    np_ = nt * 8
    xs = S * 64 + 32
    stage = WARPS * vrow + WARPS * S * 32 + (WARPS * S * 16 if perm else 0) + np_ * xs + 2 * S * 128
    acc = WARPS * 16 * np_ * 4 if perm else 0
    return 1024 + acc + STAGES * stage


def kernel_name(bits: int, nt: int, perm: bool, debug: bool) -> str:
    return f"iebme_spmm_w{bits}_nt{nt}_p{int(perm)}_d{int(debug)}"


@cache
def _kernel(bits: int, nt: int, perm: bool, debug: bool):
    cp = _cupy()
    name = kernel_name(bits, nt, perm, debug)
    cubin = os.environ.get("UNIONSPARSE_IEBME_CUBIN")
    mod = None
    if cubin and Path(cubin).is_file():
        try:
            mod = cp.RawModule(path=cubin)
            fn = mod.get_function(name)
        except Exception:  # fall back to a run-time compile
            mod = None
    if mod is None:
        code = SOURCE.read_text() + f"\nIEBME_ENTRY({bits}, {nt}, {int(perm)}, {int(debug)})\n"
        mod = cp.RawModule(code=code, options=("-std=c++17", f"-DIEBME_S={S}", f"-DIEBME_STAGES={STAGES}"))
        fn = mod.get_function(name)
    fn.max_dynamic_shared_size_bytes = smem_bytes(bits, nt, perm)
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
    perm: object | None
    wsT: object          # fp16 [G, Mp64]
    ws_acc: object       # fp32 [MAX_N, Mp64], zero between calls
    counters: object     # int32 [grid_x], zero between calls
    tr: int
    tc: int
    mp64: int
    dummy: object = None  # 16-byte buffer passed for unused pointers (no allocation inside graphs)

    @property
    def gs_tiles(self) -> int:
        k = self.shape[1]
        return self.group_size // 64 if self.group_size < k else self.tc

    def kernel_bytes(self, n: int) -> int:
        """Bytes one launch must move: every array read once, Y written once."""
        m, k = self.shape
        b = self.values.nbytes + self.bitmaps.nbytes + self.offsets.nbytes + self.wsT.nbytes
        if self.perm is not None:
            b += self.perm.nbytes
        return int(b + n * self.tc * 64 + n * self.n_groups * 4 + n * m * 2)


def prepare_layer(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int) -> DeviceLayer:
    """Upload an encoded layer (arrays as stored) and its fp16 weight scales [M, G]."""
    cp = _cupy()
    g = m.geometry
    if g.tile != (16, 64) or g.areas != (2, 2):
        raise ValueError(f"the GPU kernel supports tile 16x64 and areas 2x2, got {g.tile} and {g.areas}")
    if g.bits not in (2, 4):
        raise ValueError(f"the GPU kernel supports 4- and 2-bit codes, got {g.bits}")
    mm, k = g.shape
    n_groups = check_group_size(k, group_size)
    ws = np.asarray(w_scales)
    if ws.shape != (mm, n_groups):
        raise ValueError(f"w_scales must be [{mm}, {n_groups}], got {ws.shape}")
    tr, tc = g.grid
    grid_x = -(-tr // WARPS)
    mp64 = grid_x * 64
    wst = np.zeros((n_groups, mp64), dtype=np.float16)
    wst[:, :mm] = ws.astype(np.float16).T
    return DeviceLayer(
        shape=(mm, k), bits=g.bits, group_size=int(group_size), n_groups=n_groups,
        values=cp.asarray(np.concatenate([m.values, np.zeros(16, np.uint8)])),  # 16 B tail for windows
        bitmaps=cp.asarray(m.bitmaps.view(np.uint8)),
        offsets=cp.asarray(m.offsets.astype(np.uint32)),
        perm=None if m.perm is None else cp.asarray(np.ascontiguousarray(m.perm, dtype=np.uint8)),
        wsT=cp.asarray(wst), ws_acc=cp.zeros((MAX_N, mp64), dtype=cp.float32),
        counters=cp.zeros(grid_x, dtype=cp.int32), tr=tr, tc=tc, mp64=mp64,
        dummy=cp.zeros(16, dtype=cp.int32),
    )


CTAS_PER_SM = int(os.environ.get("UNIONSPARSE_IEBME_CTAS", 4))


def pick_splits(layer: DeviceLayer, sms: int = 132, ctas_per_sm: int | None = None,
                min_tiles: int = 16) -> int:
    """Split-K factor: enough CTAs to fill the GPU, each with at least ``min_tiles`` tiles per row."""
    ctas_per_sm = CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    grid_x = -(-layer.tr // WARPS)
    want = -(-sms * ctas_per_sm // grid_x)
    return int(max(1, min(want, layer.tc // min_tiles)))


def chunk_for(layer: DeviceLayer, splits: int) -> int:
    """Tiles per CTA: ceil(TC / splits), rounded up to whole groups when groups are shorter."""
    chunk = -(-layer.tc // max(1, splits))
    gt = layer.gs_tiles
    if gt < chunk:
        chunk = -(-chunk // gt) * gt
    return chunk


def prepare_x(layer: DeviceLayer, x_codes, x_scales):
    """(int8 [N, Kp] padded, fp32 [N, G]) on the GPU; no copy when already in that form."""
    cp = _cupy()
    kp = layer.tc * 64
    x = cp.asarray(x_codes)
    if x.dtype != cp.int8 or x.ndim != 2 or x.shape[1] not in (layer.shape[1], kp):
        raise ValueError(f"x_codes must be int8 [N, {layer.shape[1]}], got {x.dtype} {x.shape}")
    if x.shape[1] != kp:
        xp = cp.zeros((x.shape[0], kp), dtype=cp.int8)
        xp[:, : x.shape[1]] = x
        x = xp
    x = cp.ascontiguousarray(x)
    xs = cp.ascontiguousarray(cp.asarray(x_scales, dtype=cp.float32))
    if xs.shape != (x.shape[0], layer.n_groups):
        raise ValueError(f"x_scales must be [{x.shape[0]}, {layer.n_groups}], got {xs.shape}")
    return x, xs


def launch(layer: DeviceLayer, x, xs, y, *, splits: int | None = None, partial=None, stream=None) -> None:
    """Launch on prepared inputs (``prepare_x``); writes y fp16 [N, M] or, with ``partial``, int32 sums."""
    n = x.shape[0]
    m, _ = layer.shape
    splits = pick_splits(layer) if splits is None else splits
    chunk = chunk_for(layer, splits)
    grid = (-(-layer.tr // WARPS), -(-layer.tc // chunk))
    debug = partial is not None
    null = layer.dummy if layer.perm is None else layer.perm
    for n0 in range(0, n, MAX_N):
        nn = min(MAX_N, n - n0)
        nt = -(-nn // 8)
        fn = _kernel(layer.bits, nt, layer.perm is not None, debug)
        yp = y[n0:] if not debug else layer.dummy
        pp = partial[n0:] if debug else layer.dummy
        args = (layer.values, layer.bitmaps, layer.offsets, null, layer.wsT, xs[n0:], x[n0:], layer.ws_acc,
                layer.counters, yp, pp, np.int32(nn), np.int32(m), np.int32(layer.n_groups),
                np.int32(layer.tc * 64), np.int32(layer.mp64), np.int32(layer.tr), np.int32(layer.tc),
                np.int32(layer.gs_tiles), np.int32(chunk))
        smem = smem_bytes(layer.bits, nt, layer.perm is not None)
        if stream is None:
            fn(grid, (128,), args, shared_mem=smem)
        else:
            with stream:
                fn(grid, (128,), args, shared_mem=smem)


def spmm_iebme(layer: DeviceLayer, x_codes, x_scales, *, splits: int | None = None,
               debug_partials: bool = False):
    """fp16 Y [N, M] (CuPy) of the layer on activations (int8 codes [N, K], scales [N, G]).

    ``debug_partials=True`` returns the exact int32 group partial sums [N, M, G] instead.
    """
    cp = _cupy()
    x, xs = prepare_x(layer, x_codes, x_scales)
    n = x.shape[0]
    m, _ = layer.shape
    if debug_partials:
        partial = cp.zeros((n, m, layer.n_groups), dtype=cp.int32)
        launch(layer, x, xs, None, splits=splits, partial=partial)
        return partial
    y = cp.empty((n, m), dtype=cp.uint16)
    y.fill(0x7E00)  # poison (fp16 NaN): every element must be written
    launch(layer, x, xs, y, splits=splits)
    return y.view(cp.float16)
