"""The 8-bit outlier side product added to the IE-BME kernel's output in one launch (``outlier_side.cu``); its
reference is ``formats.arithmetic.grouped.grouped_int_matmul(xq, sx, wq, sw, gs, out=y.float()).half()``,
which it equals bit for bit (same float32 operations in the same order, exact integer dot products). Side widths
that are a multiple of 16 (with one group, or groups of a multiple of 16) take the coalesced kernel
``side_product16``; others the one-thread-per-output kernel."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from .cluster_launch import launch
from .errors import KernelError
from .glue import _ptr, _rows, _stream

THREADS = 128
ROWS16 = 8  # token rows per block of side_product16 (SIDE16_ROWS)


@cache
def _function(name: str):
    from .loader import load_module

    return load_module("outlier_side", ()).get_function(name)


def coalesced(n: int, group_size: int, wq: torch.Tensor) -> bool:
    """Whether ``side_product16`` computes this side product (16-byte rows, groups of whole 16-byte chunks)."""
    groups = -(-n // group_size)
    return n % 16 == 0 and (groups == 1 or group_size % 16 == 0) and wq.data_ptr() % 16 == 0


def side_product(y: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """float16 [N, M]: ``y`` (float16 [N, M], the main product) plus the side product of codes ``xq`` (int8
    [N, n]) with scales ``sx`` (float32 [N, G]) and weight codes ``wq`` (int8 [M, n]) with scales ``sw`` (float32
    [M, G]), groups of ``group_size`` side channels (CUDA tensors)."""
    y2, ld = _rows(y)
    n_rows, m = y2.shape
    n = xq.shape[1]
    for t, dt in ((xq, torch.int8), (wq, torch.int8), (sx, torch.float32), (sw, torch.float32)):
        if t.dtype != dt or not t.is_contiguous() or t.device.type != "cuda":
            raise KernelError(f"side_product: expected contiguous {dt} CUDA tensors, got {t.dtype} on {t.device}")
    out = torch.empty((n_rows, m), dtype=torch.float16, device=y.device)
    args = (_ptr(y2), np.int64(ld), _ptr(xq), _ptr(sx), _ptr(wq), _ptr(sw), _ptr(out), np.int32(m), np.int32(n),
            np.int32(group_size))
    with _stream(y.device):
        if coalesced(n, group_size, wq):
            launch(_function("side_product16"), (-(-m // (THREADS // 8)), -(-n_rows // ROWS16)), (THREADS,),
                   args + (np.int32(n_rows),), shared_mem=ROWS16 * n)
        else:
            launch(_function("side_product"), (-(-m // THREADS), n_rows), (THREADS,), args, shared_mem=4 * n)
    return out
