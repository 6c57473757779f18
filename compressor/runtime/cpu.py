"""The runtime's CPU backend: the kernels' arithmetic in torch, through the modules ``eval`` rebuilds with.

Quantized activations: :class:`~unionsparse.formats.arithmetic.linears.FakeQuantLinear` (bit-identical to the IE-BME
reference, outlier side product included). Activation-sparse formats: :class:`~unionsparse.formats.arithmetic.
sparse_inputs.TiledCBCLinear` with the threshold applied to decode rows only (summation order is its only difference
from ``spmspv_reference`` / ``spmm_reference``). Other fp16-activation layers (IE-BME W4A16): ``FakeQuantLinear``
with fp16 activations.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...formats.arithmetic.linears import FakeQuantLinear
from ...formats.arithmetic.sparse_inputs import TiledCBCLinear
from ..artifact.store import LayerRecord
from ..model.rebuild import layer_weight
from .plan import LayerPlan, QuantizingOp

FP16_ACTIVATIONS = {"bits": 16, "scheme": "fp16"}


class CpuOp(QuantizingOp):
    """``x2 [N, K] -> float16 [N, M]`` of one stored layer on the CPU."""

    def __init__(self, rec: LayerRecord, plan: LayerPlan) -> None:
        super().__init__()
        self.plan = plan
        values = rec.encoding.decode()
        if plan.sparse_inputs:
            self.impl: nn.Module = TiledCBCLinear(torch.from_numpy(layer_weight(rec, values)), plan.tau)
        else:
            act = rec.attrs.get("activations") if plan.act_bits != 16 else FP16_ACTIVATIONS
            self.impl = FakeQuantLinear(np.asarray(values, dtype=np.int8), rec.scales, int(plan.bits),
                                        int(rec.attrs["group_size"]), act, None, rec.outliers)

    def input_rule(self):
        if self.plan.act_bits == 16:
            return None
        from ...kernels.norm_quant import InputRule

        f, act = self.impl, self.impl.act
        side = f.outliers is not None
        return InputRule(f.act_bits, f.group_size, float(act.get("clip", 1.0)), f.in_features,
                         f.perm if side else None, f.side_codes.shape[1] if side else 0,
                         int(act.get("outlier_bits", 8)), f.side_group if side else None,
                         float(act.get("outlier_clip", 1.0)))

    def forward(self, x2: torch.Tensor, steps: bool | None = None) -> torch.Tensor:
        """float16 [N, M]; ``steps``: every row is a decode step (None: only when N == 1)."""
        if isinstance(self.impl, TiledCBCLinear):  # spMspV with tau at decode steps, the SpMM at prefill
            return self.impl.matmul_2d(x2, prune=self.plan.prunes(x2, steps))
        if self.plan.act_bits != 16 and (q := self.take(x2)) is not None:
            return self.impl.matmul_quantized(*q)
        return self.impl.matmul_2d(x2)

    def decode_sparsity(self) -> tuple[int, int] | None:
        """(inputs skipped, inputs seen) over the decode calls so far; None without a threshold."""
        if not isinstance(self.impl, TiledCBCLinear) or self.impl.tau is None:
            return None
        return int(self.impl.skipped), int(self.impl.seen)
