"""The decode step's glue in single launches (``glue.cu``): RMSNorm, SiLU(gate) * up, rotary embedding with the
KV-cache write, on torch float16 CUDA tensors and torch's current stream. Each ``*_reference`` is the same
computation in torch (any device), operation by operation what transformers' LLaMA modules do; the CUDA
kernels equal it bit for bit except RMSNorm's sum of squares (its summation order).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from .cluster_launch import launch
from .errors import KernelError

THREADS = 256
NORM_THREADS = 128  # rms_norm and the quantizing producers: one block size, so their sums of squares are equal
NORM_SLICE = 512  # elements of a row one rms_norm block writes (a row of 4096 over 8 SMs)


# ----------------------------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` with the sum in float32 and the product rounded to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm): the residual add in x's dtype, then :func:`rms_norm_reference`."""
    x = x + delta
    return x, rms_norm_reference(x, weight, eps)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the inputs' dtype."""
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cache_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], k and v [B, T, Hkv, D] of the tokens at cache slots ``pos`` [T] and rotary positions
    ``rpos`` [B, T]; ``cos`` / ``sin`` the [L, D] tables. Writes rotated k and v into the caches [B, Hkv, L, D]
    at ``pos``; returns rotated q [B, H, T, D]."""
    c, s = cos[rpos][:, None], sin[rpos][:, None]  # [B, 1, T, D]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache.index_copy_(2, pos, k.to(k_cache.dtype))
    v_cache.index_copy_(2, pos, v.to(v_cache.dtype))
    return q


# ---------------------------------------------------------------------------------------------------- kernels


def _functions():
    from . import study

    return _module_functions(study.build("glue"))


@cache
def _module_functions(build):
    """glue.cu's kernels as ``build`` has them (the shipped file unless a study set another: keyed by it)."""
    from .loader import load_module

    mod = load_module("glue", ())
    return {name: mod.get_function(name) for name in ("rms_norm", "silu_mul", "rotary_cache")}


def _stream(device: torch.device):
    import cupy as cp

    return cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as rows [R, C] with a unit column stride (copied only if it has none), and the row stride."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, (t2.stride(0) if t2.shape[0] > 1 else t2.shape[1])


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float16 or t.device.type != "cuda":
            raise KernelError(f"glue kernels take float16 CUDA tensors, got {t.dtype} on {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_reference` in one launch (float16 CUDA tensors)."""
    return _rms_norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_reference` in one launch: the residual add and the norm (float16 CUDA tensors)."""
    return _rms_norm(x, delta, weight, eps)


def residual_args(x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """(x as rows, the new residual rows or None, the kernels' (x, ld_x, delta, ld_d, x_out) arguments)."""
    x2, ld = _rows(x)
    if delta is None:
        return x2, None, (_ptr(x2), np.int64(ld), np.uint64(0), np.int64(0), np.uint64(0))
    _check(delta)
    d2, ld_d = _rows(delta)
    xo = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    return x2, xo, (_ptr(x2), np.int64(ld), _ptr(d2), np.int64(ld_d), _ptr(xo))


def _rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    _check(x, weight)
    x2, xo, res = residual_args(x, delta)
    k = x2.shape[1]
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    with _stream(x.device):
        launch(_functions()["rms_norm"], (min(-(-k // NORM_SLICE), 16), x2.shape[0]), (NORM_THREADS,),
               (*res, _ptr(weight.contiguous()), _ptr(y), np.int32(k), np.float32(eps)))
    return None if xo is None else xo.reshape(x.shape), y.reshape(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_reference` in one launch; ``gate`` and ``up`` may be row views of one stacked product."""
    _check(gate, up)
    g2, ld_g = _rows(gate)
    u2, ld_u = _rows(up)
    r, i = g2.shape
    y = torch.empty((r, i), dtype=gate.dtype, device=gate.device)
    with _stream(gate.device):
        launch(_functions()["silu_mul"], (min(-(-i // THREADS), 64), r), (THREADS,),
               (_ptr(g2), np.int64(ld_g), _ptr(u2), np.int64(ld_u), _ptr(y), np.int32(i)))
    return y.reshape(gate.shape)


def rotary_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """:func:`rotary_cache_reference` in one launch (q, k, v may be row views of one stacked product)."""
    _check(q, k, v, cos, sin, k_cache, v_cache)
    b, t, h, d = q.shape
    hkv = k.shape[2]
    length = k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise KernelError("rotary_cache: the caches and tables must be contiguous")
    q2, ld_q = _rows(q.reshape(b * t, h * d))
    k2, ld_k = _rows(k.reshape(b * t, hkv * d))
    v2, ld_v = _rows(v.reshape(b * t, hkv * d))
    out = torch.empty((b, h, t, d), dtype=q.dtype, device=q.device)
    n = (h + 2 * hkv) * d
    with _stream(q.device):
        launch(
            _functions()["rotary_cache"], (min(-(-n // THREADS), 64), b * t), (THREADS,),
            (_ptr(q2), np.int64(ld_q), _ptr(k2), np.int64(ld_k), _ptr(v2), np.int64(ld_v), _ptr(cos), _ptr(sin),
             _ptr(pos.to(torch.int64).contiguous()), _ptr(rpos.to(torch.int64).contiguous()),
             np.int32(t), np.int32(h), np.int32(hkv), np.int32(d),
             np.int32(length), _ptr(out), _ptr(k_cache), _ptr(v_cache)))
    return out
