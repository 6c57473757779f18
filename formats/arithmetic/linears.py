"""Fake-quant linear layers that compute exactly what the kernels compute.

W4A4 / W2A4 (docs/kernels.md): every token row of the input is quantized by
:func:`~unionsparse.formats.arithmetic.activations.quantize_activations` (per token, per group of ``group_size``
channels, clip ratio from the layer's activation record), then

    Y[n, m] = sum over groups j, in increasing j, of  (s_w[m, j] * s_x[n, j]) * P[n, m, j],
    P[n, m, j] = sum_{k in group j} q_w[m, k] * q_x[n, k]          (an integer)

with the scale product and the accumulation in float32 and Y rounded once to float16. The integer
partial sums are computed as float32 matrix products of the codes, which is exact: every partial sum is
an integer of magnitude at most group_size * 2^(bw-1) * 2^(bx-1) (8192 for 4x4 bits and g = 128; the
8-bit outlier side stays below 2^21), far below 2^24, so no rounding happens in any summation order.
With outlier channels (``compressor/quantize/outliers.py``) the input is permuted, the main matrix sees the normal
channels and the 8-bit side matrix the outlier block, whose groups are added after the main ones.

W4A16 (weight only): Y = fp16( fp16(x) @ (q_w * s_w)^T ) with the dequantized weight and the product in
float32 (code * fp16 scale is exact in float32).

The bias, if any, is added in the model's dtype after the float16 rounding.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..errors import FormatError
from .activations import quantize_activations_torch
from .grouped import grouped_int_matmul
from .outlier_side import OutlierSide, quantize_inputs_torch
from .weights import QuantizedWeight, n_groups


def _exact_bound(group: int, bits_w: int, bits_x: int) -> None:
    if group * (1 << (bits_w - 1)) * (1 << (bits_x - 1)) >= 1 << 24:
        raise FormatError(f"group of {group} channels at {bits_w}x{bits_x} bits overflows exact float32 sums")


class RowwiseLinear(nn.Module):
    """A linear layer defined by ``matmul_2d`` on a [tokens, in_features] input: ``forward`` flattens the leading
    dimensions, adds the bias (``self.bias``, may be None) and restores them. The fake-quant, Tiled-CBC and
    runtime linears share it."""

    in_features: int
    out_features: int

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.matmul_2d(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)


class FakeQuantLinear(RowwiseLinear):
    """A linear layer holding integer weight codes and computing the kernels' arithmetic."""

    def __init__(
        self,
        codes: np.ndarray | torch.Tensor,
        scales: np.ndarray | torch.Tensor,
        bits: int,
        group_size: int,
        activations: dict,
        bias: torch.Tensor | None = None,
        outliers: OutlierSide | None = None,
    ) -> None:
        super().__init__()
        codes_t = torch.as_tensor(np.asarray(codes, dtype=np.int8))
        self.out_features, self.in_features = codes_t.shape
        self.bits = int(bits)
        self.group_size = min(int(group_size), self.in_features)
        self.act = dict(activations)
        self.act_bits = int(self.act["bits"])
        scales_t = torch.as_tensor(np.asarray(scales, dtype=np.float16)).float()
        if scales_t.shape != (self.out_features, n_groups(self.in_features, self.group_size)):
            raise FormatError(f"scales shape {tuple(scales_t.shape)} does not match codes "
                             f"{tuple(codes_t.shape)} with group size {self.group_size}")
        if self.act_bits == 16:
            if outliers is not None:
                raise FormatError("outlier channels only exist with quantized activations")
            s = scales_t.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
            self.register_buffer("w_deq", codes_t.float() * s)
        else:
            act_group = min(int(self.act["group_size"]), self.in_features)
            if act_group != self.group_size:
                raise FormatError(f"activation group {act_group} differs from weight group {self.group_size}")
            _exact_bound(self.group_size, self.bits, self.act_bits)
            self.register_buffer("w_codes", codes_t.float())
            self.register_buffer("w_scales", scales_t)
        self.outliers = outliers
        if outliers is not None:
            n = outliers.codes.shape[1]
            self.side_group = int(self.act.get("outlier_group_size") or min(self.group_size, n))
            if list(self.act.get("outlier_channels") or []) != outliers.channels.tolist():
                raise FormatError("the activation record's outlier_channels differ from the side matrix")
            _exact_bound(self.side_group, outliers.bits, outliers.bits)
            self.register_buffer("perm", torch.from_numpy(outliers.perm.astype(np.int64)))
            self.register_buffer("side_codes", torch.from_numpy(outliers.codes).float())
            # one weight scale per row, the same for every activation group of the side block
            side_s = torch.from_numpy(outliers.scales.astype(np.float32))
            self.register_buffer("side_scales", side_s.expand(-1, n_groups(n, self.side_group)).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_quantized(cls, q: QuantizedWeight, activations: dict, bias: torch.Tensor | None = None,
                       outliers: OutlierSide | None = None) -> FakeQuantLinear:
        return cls(q.codes, q.scales, q.bits, q.group_size, activations, bias, outliers)

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        """float16 [N, M] for float input [N, K]: the kernel's output."""
        x = x.float()
        if self.act_bits == 16:
            return (x.half().float() @ self.w_deq.T).half()
        return self.matmul_quantized(*self.quantize(x))

    def quantize(self, x: torch.Tensor) -> tuple:
        """This layer's kernel input for float input ``x`` [N, K]: (codes, scales, side codes, side scales), the
        side ones None without outlier channels."""
        x = x.float()
        if self.outliers is None:
            xq, sx = quantize_activations_torch(x, self.act_bits, self.group_size, float(self.act.get("clip", 1.0)))
            return xq, sx, None, None
        return quantize_inputs_torch(x, self.perm, self.side_codes.shape[1], self.act)

    def matmul_quantized(self, xq: torch.Tensor, sx: torch.Tensor, oq: torch.Tensor | None = None,
                         osx: torch.Tensor | None = None) -> torch.Tensor:
        """float16 [N, M] from inputs already quantized by this layer's rule (codes [N, >= K], padding columns
        beyond K ignored; the outlier side's codes and scales when the layer has one)."""
        k = self.in_features
        y = grouped_int_matmul(xq[:, :k], sx, self.w_codes, self.w_scales, self.group_size)
        if self.outliers is not None:
            y = grouped_int_matmul(oq, osx, self.side_codes, self.side_scales, self.side_group, out=y)
        return y.half()

    def extra_repr(self) -> str:
        o = 0 if self.outliers is None else self.side_codes.shape[1]
        return (f"in={self.in_features}, out={self.out_features}, W{self.bits}A{self.act_bits}, "
                f"group={self.group_size}, outliers={o}")

