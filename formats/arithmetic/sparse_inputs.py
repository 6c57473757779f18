"""A linear layer computing what the Tiled-CBC decode kernel computes, activation sparsity included.

For every token row x of the input (``eval`` feeds whole windows, but each row is treated as one decode
step of the spMspV kernel, as TEAL does when it evaluates perplexity):

    x' = float16(x);   active k  iff  |x'_k| > tau   (float32 compare, docs/format.md, "Tiled-CBC")
    y  = float16( sum over active k of W[:, k] * x'_k )   (float32 products and sums)

W holds the stored float16 values, or the b-bit codes times their float16 group scales formed in
float32 (exact). ``tau=None`` turns dynamic pruning off (every input active: the kernels' arithmetic
with DP off). Only the summation order differs from ``kernels.tiled_cbc_reference.spmspv_reference``,
so results agree to float32 rounding before the final float16 rounding (tested).
"""

from __future__ import annotations

import torch
from torch import nn

from .linears import RowwiseLinear


def sparsify_input(x: torch.Tensor, tau: float | torch.Tensor | None) -> torch.Tensor:
    """The decode kernel's view of an input: rounded to float16, and (tau given) zero where
    ``|x| > tau`` fails, the test done in float32 (docs/format.md, "Tiled-CBC"). Returned as float32."""
    xh = x.to(torch.float16).float()
    if tau is None:
        return xh
    t = tau if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float32, device=x.device)
    return torch.where(xh.abs() > t, xh, torch.zeros((), dtype=xh.dtype, device=xh.device))


class TiledCBCLinear(RowwiseLinear):
    """Tiled-CBC layer with fp16 activations (``--quant none`` or ``w4a16``) and optional threshold tau."""

    def __init__(self, weight: torch.Tensor, tau: float | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().float().contiguous())
        self.tau = None if tau is None else float(torch.tensor(float(tau), dtype=torch.float32))
        self.register_buffer("tau_t", torch.tensor(-1.0 if tau is None else float(tau), dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.skipped = torch.zeros((), dtype=torch.int64)  # inputs pruned so far (counted on the device)
        self.seen = 0  # inputs seen so far

    def matmul_2d(self, x2: torch.Tensor, prune: bool = True) -> torch.Tensor:
        """float16 [N, M] for input [N, K], every row one spMspV call; ``prune=False``: every input active
        (the SpMM's arithmetic, e.g. at prefill)."""
        prune = prune and self.tau is not None
        xa = sparsify_input(x2, self.tau_t if prune else None)
        if prune:
            if self.skipped.device != xa.device:
                self.skipped = self.skipped.to(xa.device)
            self.skipped += (xa == 0).sum()  # |x'| <= tau (tau >= 0), exact zeros included, as calibrated
            self.seen += xa.numel()
        return (xa @ self.weight.T).to(torch.float16)

    def measured_sparsity(self) -> float | None:
        """Fraction of the inputs seen that the kernel skips (``|x'| <= tau``, the calibration's measure)."""
        return None if self.tau is None or self.seen == 0 else int(self.skipped) / self.seen

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tau={self.tau}"


def activation_sparsity_summary(model: nn.Module) -> dict | None:
    """Dynamic pruning as applied during an evaluation: layers with a threshold and the fraction of weight
    reads the kernel skipped (each layer's measured input sparsity weighted by its M*K); None if none."""
    layers = [m for m in model.modules() if isinstance(m, TiledCBCLinear) and m.tau is not None]
    measured = [(m.measured_sparsity(), m.in_features * m.out_features) for m in layers]
    measured = [(s, w) for s, w in measured if s is not None]
    if not layers:
        return None
    total = sum(w for _, w in measured)
    return {"layers": len(layers),
            "measured_sparsity": sum(s * w for s, w in measured) / total if total else None}
