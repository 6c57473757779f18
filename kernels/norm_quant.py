"""Producers that quantize for their consumer in one launch (``norm_quant.cu``): RMSNorm and SiLU(gate) * up,
each returning its float16 output and the IE-BME input of the linear that reads it. The ``*_reference``
functions are the same on any device: the glue's reference, then ``act_quant``'s reference; the CUDA kernels
equal them bit for bit except RMSNorm's sum of squares (its summation order).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from ..formats.arithmetic.weights import FP16_TINY, grid_max, n_groups
from .act_quant import quantize_inputs_reference
from .cluster_launch import launch
from .errors import KernelError
from .glue import NORM_THREADS, _check, _ptr, _rows, _stream, residual_args, rms_norm_reference, silu_mul_reference

QuantizedInput = tuple  # (codes int8 [N, kp], scales float32 [N, G], side codes int8 [N, n] | None, side scales | None)


@dataclass(frozen=True, eq=False)
class InputRule:
    """How a linear quantizes its input (``formats.arithmetic``): bits, group, clip; codes padded to ``kp``
    columns; with ``n_side`` outlier channels the permutation ``perm`` (int tensor [K], outliers last) and the
    side input's bits, group and clip."""

    bits: int
    group: int
    clip: float
    kp: int
    perm: torch.Tensor | None = None
    n_side: int = 0
    side_bits: int = 8
    side_group: int | None = None
    side_clip: float = 1.0

    def reference(self, y: torch.Tensor) -> QuantizedInput:
        """The quantized input of ``y`` [..., K] by the formats' torch functions."""
        y2 = y.reshape(-1, y.shape[-1])
        return quantize_inputs_reference(y2, self.bits, self.group, self.clip, self.kp,
                                         None if self.perm is None else self.perm.long(), self.n_side,
                                         self.side_bits, self.side_group, self.side_clip)


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                             rule: InputRule) -> tuple[torch.Tensor, QuantizedInput]:
    y = rms_norm_reference(x, weight, eps)
    return y, rule.reference(y)


def add_rms_norm_quant_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                                 rule: InputRule) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput]:
    x = x + delta
    y, q = rms_norm_quant_reference(x, weight, eps, rule)
    return x, y, q


def silu_mul_quant_reference(gate: torch.Tensor, up: torch.Tensor, rule: InputRule) -> tuple[torch.Tensor,
                                                                                          QuantizedInput]:
    y = silu_mul_reference(gate, up)
    return y, rule.reference(y)


def _launch(name: str, rows: int, k: int, rule: InputRule, args: tuple) -> None:
    """Launch ``name`` over (blocks, rows): enough blocks of ``NORM_THREADS`` for a warp per quantization group."""
    groups = n_groups(k, min(rule.group, k))
    if rule.n_side:
        groups += n_groups(rule.n_side, rule.side_group or min(rule.group, rule.n_side))
    warps = NORM_THREADS // 32
    launch(_functions()[name], (-(-groups // warps), rows), (NORM_THREADS,), args)


def _functions():
    from . import study

    return _module_functions(study.build("norm_quant"))


@cache
def _module_functions(build):
    """norm_quant.cu's kernels as ``build`` has them (the shipped file unless a study set another: keyed by it)."""
    from .loader import load_module

    mod = load_module("norm_quant", ())
    return {name: mod.get_function(name) for name in ("rms_norm_quant", "silu_mul_quant")}


def _outputs(rows: int, k: int, rule: InputRule, device) -> tuple:
    g = n_groups(k, min(rule.group, k))
    codes = torch.empty(rows, rule.kp, dtype=torch.int8, device=device)
    scales = torch.empty(rows, g, dtype=torch.float32, device=device)
    if not rule.n_side:
        return codes, scales, None, None
    gs = rule.side_group or min(rule.group, rule.n_side)
    return (codes, scales, torch.empty(rows, rule.n_side, dtype=torch.int8, device=device),
            torch.empty(rows, n_groups(rule.n_side, gs), dtype=torch.float32, device=device))


def _quant_args(k: int, rule: InputRule, out: tuple) -> tuple:
    null = np.uint64(0)
    perm = null if rule.perm is None else _ptr(rule.perm)
    if rule.perm is not None and (rule.perm.dtype != torch.int32 or not rule.perm.is_contiguous()):
        raise KernelError("InputRule.perm must be a contiguous int32 tensor for the kernels")
    gs = (rule.side_group or min(rule.group, rule.n_side)) if rule.n_side else 1
    codes, scales, side_codes, side_scales = out
    return (perm, np.int32(k), np.int32(rule.kp), np.int32(rule.n_side), np.int32(min(rule.group, k)),
            np.int32(rule.bits), np.float32(rule.clip), np.float32(grid_max(rule.bits)), np.int32(gs),
            np.int32(rule.side_bits), np.float32(rule.side_clip), np.float32(grid_max(rule.side_bits)),
            np.float32(FP16_TINY), _ptr(codes), _ptr(scales), null if side_codes is None else _ptr(side_codes),
            null if side_scales is None else _ptr(side_scales))


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   rule: InputRule) -> tuple[torch.Tensor, QuantizedInput]:
    """:func:`rms_norm_quant_reference` in one launch (float16 CUDA tensors)."""
    _, y, q = _rms_norm_quant(x, None, weight, eps, rule)
    return y, q


def add_rms_norm_quant(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                       rule: InputRule) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput]:
    """:func:`add_rms_norm_quant_reference` in one launch: residual add, norm and the consumer's input."""
    return _rms_norm_quant(x, delta, weight, eps, rule)


def _rms_norm_quant(x, delta, weight, eps, rule):
    _check(x, weight)
    x2, xo, res = residual_args(x, delta)
    rows, k = x2.shape
    y = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    out = _outputs(rows, k, rule, x.device)
    with _stream(x.device):
        _launch("rms_norm_quant", rows, k, rule, (*res, _ptr(weight.contiguous()), _ptr(y), np.float32(eps),
                                                   *_quant_args(k, rule, out)))
    return None if xo is None else xo.reshape(x.shape), y.reshape(x.shape), out


def silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, rule: InputRule) -> tuple[torch.Tensor, QuantizedInput]:
    """:func:`silu_mul_quant_reference` in one launch; ``gate`` and ``up`` may be row views of one product."""
    _check(gate, up)
    g2, ld_g = _rows(gate)
    u2, ld_u = _rows(up)
    rows, k = g2.shape
    y = torch.empty((rows, k), dtype=gate.dtype, device=gate.device)
    out = _outputs(rows, k, rule, gate.device)
    with _stream(gate.device):
        _launch("silu_mul_quant", rows, k, rule, (_ptr(g2), np.int64(ld_g), _ptr(u2), np.int64(ld_u), _ptr(y),
                                                   *_quant_args(k, rule, out)))
    return y.reshape(gate.shape), out
