"""The compressed op of the ``cuda`` and ``reference`` backends: one stored layer through the artifact's kernels.

The op decides which kernel runs, on which layout, with which threshold and outlier columns; the kernels come
from a :class:`~unionsparse.kernels.runtime_ops.RuntimeKernels` implementation: the CuPy kernels on a GPU
(``backend="cuda"``), or their CPU references (``backend="reference"``), which compute the same function, so
this logic is tested without a GPU (docs/runtime.md, "Kernels"). Per layer, at load, the stored arrays are made
ready once (uploaded as they are on a GPU). Per call:

* quantized activations (IE-BME W4A4 / W2A4 / W4A8 / W2A8): the activation rule of ``formats.arithmetic`` (outlier
  gather, quantization and padding; or the quantized input the producing op handed over, ``QuantizingOp``), then the
  IE-BME product with the 8-bit outlier side product added in float32 in its epilogue before the one float16
  rounding, as the ``cpu`` backend does (side widths the epilogue does not take, and ``side_kernel`` "kernel" or
  "torch": the product rounded, then the side product added by a second launch and rounded again); with
  ``IEBME_DENSE`` a prompt of ``iebme_decode.DENSE_INT_FROM_N`` rows or more decodes the layer once to a dense weight
  and takes the product as two GEMMs of exact halves into float32, the side product added before the one rounding;
* activation-sparse layers (Tiled-CBC): decode steps (``steps``, any batch) apply the stored threshold to every
  row; a prompt of several tokens runs every input active. Up to ``SPMSPV_ROWS`` rows (a decode step of up to
  8 sequences) are the spMspV, whose several-row kernel reads a weight column once for all the rows it is
  active in; more rows are the SpMM (of the rows' active inputs under a threshold): for fp16 values its
  tensor-core kernels (decode once + cuBLAS from ``DENSE_FROM_N`` rows); for int codes the spMspV in launches
  of 8 rows below ``DENSE_FROM_N`` rows and decode once + cuBLAS from there (a prompt);
* IE-BME W4A16 / W2A16 (float16 activations): the float16-activation IE-BME kernel on the stored arrays, where it
  takes the geometry (``IEBME16``, or ``kernels.iebme_spmm.FLOAT16_ACTIVATIONS``, on by default), and with
  ``IEBME_DENSE`` (``kernels.iebme_decode.DENSE_PREFILL``, on by default) a prompt of
  ``iebme_decode.DENSE_FROM_N`` rows or more decoded once to a dense weight for one GEMM; otherwise the decoded
  weight in fp16, kept, and one dense product (cuBLAS on a GPU).

``act_quant`` ("kernel" or "torch") and ``side_kernel`` ("fused", "kernel" or "torch") choose the one-launch
kernels or the formats' torch functions for those two steps ("torch" launches about ten and five kernels on a
GPU; "kernel" and "torch" give the same values).
"""

from __future__ import annotations

import numpy as np
import torch

from ...formats.arithmetic.grouped import grouped_int_matmul
from ...formats.arithmetic.sparse_inputs import sparsify_input
from ...formats.arithmetic.weights import n_groups
from ...kernels import iebme_decode
from ...kernels.tiled_cbc_spmm import DENSE_FROM_N
from ..artifact.store import LayerRecord
from ..errors import UserError
from ..model.rebuild import layer_weight
from .plan import LayerPlan, QuantizingOp


class KernelOp(QuantizingOp):
    """``x2 [N, K] -> float16 [N, M]`` of one stored layer through ``kernels`` (see the module docstring)."""

    act_quant = "kernel"    # IE-BME inputs: "kernel" (one launch) or "torch" (the formats' torch functions)
    SPMSPV_ROWS = 8         # Tiled-CBC fp16 values: the spMspV up to this many rows (one launch), the SpMM above
    IEBME16 = None          # IE-BME W4A16 / W2A16 through the kernel: True, False (the decoded weight and cuBLAS),
    #                         None: kernels.iebme_spmm.FLOAT16_ACTIVATIONS (on by default)
    IEBME_DENSE = None      # ...and from iebme_decode.DENSE_FROM_N rows decoded once to a dense weight + one GEMM:
    #                         True, False, None: kernels.iebme_decode.DENSE_PREFILL (on by default)
    side_kernel = "fused"  # the 8-bit outlier side product: "fused" (in the IE-BME kernel's epilogue, one rounding),
    #                        "kernel" (a second launch) or "torch" (grouped products); both of these round twice

    def __init__(self, rec: LayerRecord, plan: LayerPlan, kernels, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.kernels = kernels
        self.device = torch.device(device or "cpu")
        self.kind = "dense"
        gs = rec.attrs.get("group_size")
        if plan.act_bits != 16:
            self._init_iebme(rec, int(gs))
        elif plan.sparse_inputs:
            try:
                self.layer = kernels.tcbc_layer(rec.encoding, rec.scales, gs)
            except ValueError as e:
                raise UserError(f"layer {rec.name}: {e}") from None
            self.kind = "spmspv"
            # the threshold as a device tensor made once: a Python float would be copied to the GPU inside the
            # step, which a CUDA-graph capture refuses
            tau = None if plan.tau is None else torch.tensor(float(plan.tau), dtype=torch.float32)
            self.register_buffer("tau_t", None if tau is None else tau.to(self.device))
        elif self._iebme16_takes(rec):  # IE-BME W4A16 / W2A16: the kernel on float16 activations
            self.layer = kernels.iebme_layer(rec.encoding, rec.scales, int(gs))
            self.kind = "iebme16"
        else:  # no kernel for this layer: the decoded weight in fp16, one dense product
            self.register_buffer("weight", torch.from_numpy(layer_weight(rec)).half().to(self.device))

    def _dense_prefill(self) -> bool:
        return iebme_decode.DENSE_PREFILL if self.IEBME_DENSE is None else self.IEBME_DENSE

    def _iebme16_takes(self, rec: LayerRecord) -> bool:
        """Whether the float16-activation IE-BME kernel computes this stored layer (both backends decide alike)."""
        from ...formats import registry
        from ...kernels import iebme_spmm

        on = iebme_spmm.FLOAT16_ACTIVATIONS if self.IEBME16 is None else self.IEBME16
        gs, k = rec.attrs.get("group_size"), int(rec.encoding.shape[1])
        unsupported = iebme_spmm.unsupported
        return (on and "iebme_spmm" in registry.get(rec.format).kernel_ops and rec.scales is not None
                and gs is not None and (int(gs) >= k or int(gs) % 64 == 0) and unsupported(rec.encoding) is None)

    def _init_iebme(self, rec: LayerRecord, group_size: int) -> None:
        from ...formats import registry

        if not registry.get(rec.format).takes_quantized_activations:
            raise UserError(f"layer {rec.name}: no kernel computes {rec.format} with quantized activations; "
                            "use --device cpu")
        try:
            self.layer = self.kernels.iebme_layer(rec.encoding, rec.scales, group_size)
        except ValueError as e:
            raise UserError(f"layer {rec.name}: {e}") from None
        self.kind = "iebme"
        act = dict(rec.attrs["activations"])
        self.act = act
        k = self.plan.shape[1]
        side = rec.outliers
        self.n_side = 0 if side is None else int(side.channels.size)
        self.side_group = int(act.get("outlier_group_size") or min(group_size, self.n_side)) if side else None
        if side is not None:
            self.register_buffer("perm32", torch.from_numpy(side.perm.astype(np.int32)).to(self.device))
            self.register_buffer("side_codes", torch.from_numpy(side.codes).to(torch.int8).contiguous().to(self.device))
            s = torch.from_numpy(side.scales.astype(np.float32)).expand(-1, n_groups(self.n_side, self.side_group))
            self.register_buffer("side_scales", s.contiguous().to(self.device))
        else:
            self.perm32 = None
        from ...kernels.norm_quant import InputRule

        self.rule = InputRule(self.plan.act_bits, min(int(act["group_size"]), k), float(act.get("clip", 1.0)),
                              self.layer.kp, self.perm32, self.n_side, int(act.get("outlier_bits", 8)),
                              self.side_group, float(act.get("outlier_clip", 1.0)))

    def input_rule(self):
        return self.rule if self.kind == "iebme" else None

    def forward(self, x2: torch.Tensor, steps: bool | None = None) -> torch.Tensor:
        """float16 [N, M]; ``steps``: every row is a decode step (None: only when N == 1)."""
        if self.kind == "dense":
            return self.kernels.dense(x2, self.weight)
        if self.kind == "iebme16":
            if x2.shape[0] >= iebme_decode.DENSE_FROM_N and self._dense_prefill():  # a prompt: decode once
                return self.kernels.iebme_dense16(self.layer, x2)
            return self.kernels.iebme_spmm16(self.layer, x2)
        if self.kind == "iebme":
            return self._iebme(x2 if x2.dtype in (torch.float16, torch.float32) else x2.float())
        return self._tiled_cbc(x2.half().contiguous(), self.plan.prunes(x2, steps))

    def _quantize(self, x: torch.Tensor) -> tuple:
        offered = self.take(x)
        if offered is not None:  # quantized by the op that produced x (kernels/norm_quant.cu)
            return offered
        if self.act_quant == "kernel":  # one launch: gather, quantize, pad (kernels/act_quant.cu)
            return self.kernels.act_quant(x, self.rule)
        return self.rule.reference(x)  # the formats' torch functions: about ten launches on a GPU

    def _iebme(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx, oq, osx = self._quantize(x)
        if xq.shape[0] >= iebme_decode.DENSE_INT_FROM_N and self._dense_prefill():  # a prompt: decode once
            side = None if not self.n_side else (oq.contiguous(), osx.float().contiguous(), self.side_codes,
                                                 self.side_scales, self.side_group)
            return self.kernels.iebme_dense(self.layer, xq, sx, side)
        if not self.n_side:
            return self.kernels.iebme_spmm(self.layer, xq, sx)
        oq, osx = oq.contiguous(), osx.float().contiguous()
        if self.side_kernel == "fused" and self.kernels.side_fusable(oq, self.side_codes, self.side_group):
            side = (oq, osx, self.side_codes, self.side_scales, self.side_group)
            return self.kernels.iebme_spmm(self.layer, xq, sx, side)
        y = self.kernels.iebme_spmm(self.layer, xq, sx)
        if self.side_kernel != "torch":  # one launch (kernels/outlier_side.cu), the same arithmetic as torch's
            return self.kernels.side_product(y, oq, osx, self.side_codes, self.side_scales, self.side_group)
        return grouped_int_matmul(oq, osx, self.side_codes.float(), self.side_scales, self.side_group,
                                  out=y.float()).half()

    def _tiled_cbc(self, xh: torch.Tensor, prune: bool) -> torch.Tensor:
        tau = self.plan.tau if prune else None  # prune: decode steps (or every row, eval); else every input active
        if xh.shape[0] == 1:
            return self.kernels.spmspv(self.layer, xh[0], tau)[None]
        if xh.shape[0] <= self.SPMSPV_ROWS or (self.layer.bits is not None and xh.shape[0] < DENSE_FROM_N):
            return self.kernels.spmspv(self.layer, xh, tau)
        # the SpMM; with a threshold, of the rows' active inputs
        return self.kernels.tcbc_spmm(self.layer, xh if tau is None else sparsify_input(xh, self.tau_t).half())
