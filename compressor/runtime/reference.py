"""The runtime's reference backend: the kernels' numba CPU references on the stored arrays (slow, exact).

Nothing goes through ``decode()``: the IE-BME product reads bitmap ranks, value streams and row permutations
(``kernels.iebme_reference``), the Tiled-CBC products read ColInfo and bitmap popcounts
(``kernels.tiled_cbc_reference``), as the GPU kernels do. Inputs are quantized by the one activation rule
(``formats.arithmetic``); the outlier side product and the order of the float32 sums are those of
``kernels.outlier_check.combine``. Layers with no kernel of their own (IE-BME W4A16, Tiled-CBC with
quantized activations) run the CPU backend's arithmetic. Used by tests to check the CPU and GPU backends.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...formats import iebme
from ...formats.arithmetic.activations import quantize_activations
from ...formats.arithmetic.outlier_side import quantize_inputs
from ..artifact.store import LayerRecord
from .linear import LayerPlan


class ReferenceOp(nn.Module):
    """``x2 [N, K] -> float16 [N, M]`` of one stored layer through the kernels' CPU references."""

    def __init__(self, rec: LayerRecord, plan: LayerPlan) -> None:
        super().__init__()
        self.plan = plan
        self.rec = rec
        self.fallback: nn.Module | None = None
        if not plan.sparse_inputs and not (rec.format == iebme.NAME and plan.act_bits != 16):
            from .cpu import CpuOp

            self.fallback = CpuOp(rec, plan)  # no kernel computes this layer: the decoded arithmetic

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback(x2)
        x = x2.detach().float().cpu().numpy()
        y = self._spmspv_or_spmm(x) if self.plan.sparse_inputs else self._iebme(x)
        return torch.from_numpy(np.ascontiguousarray(y, dtype=np.float16)).to(x2.device)

    def _iebme(self, x: np.ndarray) -> np.ndarray:
        from ...kernels.iebme_check import dense_partials
        from ...kernels.iebme_reference import iebme_partial_sums, iebme_spmm_reference
        from ...kernels.outlier_check import combine

        rec = self.rec
        act = rec.attrs["activations"]
        k = self.plan.shape[1]
        gs = min(int(rec.attrs["group_size"]), k)
        if rec.outliers is None:
            xq, sx = quantize_activations(x, self.plan.act_bits, min(int(act["group_size"]), k),
                                          float(act.get("clip", 1.0)))
            return iebme_spmm_reference(rec.encoding, rec.scales, xq, sx, gs)[0]
        side = rec.outliers
        og = int(act.get("outlier_group_size") or min(gs, side.channels.size))
        xq, sx, oq, osx = quantize_inputs(x, side, act)
        return combine(iebme_partial_sums(rec.encoding, xq, gs), rec.scales, sx,
                       dense_partials(side.codes, oq, og), side.scales, osx)

    def _spmspv_or_spmm(self, x: np.ndarray) -> np.ndarray:
        from ...kernels.tiled_cbc_reference import spmm_reference, spmspv_reference

        rec = self.rec
        gs = rec.attrs.get("group_size") if rec.scales is not None else None
        if x.shape[0] == 1:  # decode: one spMspV call with the stored threshold
            return spmspv_reference(rec.encoding, x[0], self.plan.tau, rec.scales, gs, out_dtype=np.float16)[None]
        return spmm_reference(rec.encoding, x, rec.scales, gs)
