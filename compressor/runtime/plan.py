"""What one stored layer computes at run time (:func:`layer_plan`, module docstring of :mod:`.linear`), the
backends that can run it, and the op base class every backend's op shares (:class:`QuantizingOp`). The ops
(:mod:`.cpu`, :mod:`.kernel_op`) and the layer that picks one (:mod:`.linear`) all import this module, and it
imports none of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...formats import registry
from ..artifact.store import LayerRecord
from ..errors import UserError

BACKENDS = ("cpu", "reference", "cuda")


@dataclass(frozen=True)
class LayerPlan:
    """What one stored layer computes at run time (the module docstring of :mod:`.linear`)."""

    name: str
    format: str
    shape: tuple[int, int]
    bits: int | None               # weight code bits, None for fp16 values
    act_bits: int                  # 16: fp16 activations
    sparse_inputs: bool            # the format's decode kernel skips inputs under tau (decode steps)
    tau: float | None              # the stored threshold (None: every input active)
    outliers: int                  # 8-bit outlier input channels (0: none)
    every_row: bool = False        # the threshold applies to every row (eval, as TEAL measures), not only decode

    def prunes(self, x2: torch.Tensor, steps: bool | None) -> bool:
        """Whether the stored threshold applies to the rows ``x2`` [N, K]: at decode steps (``steps``; None: N ==
        1), at any batch size, or on every row with ``every_row``; never at a prompt of several tokens."""
        if self.tau is None:
            return False
        return self.every_row or (x2.shape[0] == 1 if steps is None else bool(steps))

    @property
    def label(self) -> str:
        w = "fp16" if self.bits is None else f"W{self.bits}A{self.act_bits}"
        extra = f", {self.outliers} outliers" if self.outliers else ""
        extra += f", tau {self.tau:.4g} at decode" if self.tau is not None else ""
        return f"{self.format} {w}{extra}"


def layer_plan(rec: LayerRecord, dynamic_pruning: bool = True) -> LayerPlan:
    """The :class:`LayerPlan` of a stored layer; ``dynamic_pruning=False`` ignores stored thresholds."""
    act = rec.attrs.get("activations") or {}
    act_bits = int(act.get("bits") or 16)
    sparse = registry.get(rec.format).activation_sparsity and act_bits == 16
    tau = rec.attrs.get("dp_threshold") if sparse and dynamic_pruning else None
    if tau is not None and not (isinstance(tau, (int, float)) and tau >= 0):
        raise UserError(f"layer {rec.name}: stored dp_threshold {tau!r} is not a non-negative number")
    return LayerPlan(rec.name, rec.format, tuple(int(v) for v in rec.encoding.shape), rec.attrs.get("bits"),
                     act_bits, sparse, None if tau is None else float(tau),
                     0 if rec.outliers is None else int(rec.outliers.channels.size))


class QuantizingOp(nn.Module):
    """An op that quantizes its input, and can take that quantized input from the op that produced it instead
    (docs/runtime.md, "Quantizing producers"): :meth:`offer` hands over (input tensor, quantized input); the next
    call on that very tensor (same storage and size) uses it once. Any other call quantizes as usual."""

    def __init__(self) -> None:
        super().__init__()
        self._offered: tuple | None = None
        self.offers_used = 0  # calls that took a producer's quantized input (Python-side; at capture on a GPU)

    def input_rule(self):
        """The :class:`~unionsparse.kernels.norm_quant.InputRule` of this op's input, or None (not quantized)."""
        return None

    def offer(self, x: torch.Tensor, quantized: tuple) -> None:
        self._offered = (x.data_ptr(), x.numel(), quantized)

    def take(self, x2: torch.Tensor) -> tuple | None:
        """The quantized input offered for ``x2``, once; None when none was offered for it."""
        o, self._offered = self._offered, None
        if o is None or o[0] != x2.data_ptr() or o[1] != x2.numel():
            return None
        self.offers_used += 1
        return o[2]


def backend_kernels(backend: str):
    """The kernel implementation a backend's ops and decode step run (None for ``cpu``: torch arithmetic and
    transformers' own modules)."""
    if backend == "cpu":
        return None
    from ...kernels.runtime_ops import get

    return get(backend)
