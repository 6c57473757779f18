"""The runtime's compressed linear layer: one stored layer computing what the artifact's kernel computes.

What a layer computes follows from how it was stored (:func:`layer_plan`):

* quantized activations (W4A4 / W2A4 / W4A8 / W2A8, the layer's ``activations`` record): every token row is
  quantized per token and per group (``formats.arithmetic.activations``), the product is the IE-BME SpMM's
  (exact integer group sums, float32 scaling in group order, one float16 rounding), plus the 8-bit outlier side product
  where the layer has one;
* fp16 activations on a format whose decode kernel skips inputs (Tiled-CBC, fp16 values or int codes): at a
  decode step (every sequence of the call brings one token: input ``[B, 1, K]``, or ``[1, K]``) each row is an
  spMspV with the stored threshold tau (input k active iff ``|fp16(x_k)| > tau``), at any batch size B; a
  prompt of several tokens (prefill) is the SpMM, every input active;
* fp16 activations otherwise (IE-BME W4A16 / W2A16): ``fp16(fp16(x) @ W^T)`` with float32 sums, W = code · scale
  (the decoded weight, or with ``kernels.iebme_spmm.FLOAT16_ACTIVATIONS`` the IE-BME kernel's float16-activation
  variant on the stored arrays).

Backends (``backend``): ``"cpu"`` runs that arithmetic in torch (:mod:`.cpu`, the modules ``eval`` uses);
``"cuda"`` runs the artifact's CuPy kernels on torch's stream (:mod:`.kernel_op` with ``kernels/cuda_ops.py``; it
needs CuPy and a GPU); ``"reference"`` runs the very same op logic with the kernels' CPU references in place of
the kernels (``kernels/reference_ops.py``; slow), so that the CUDA backend's Python path is tested without a GPU.
All return float16 ``[N, M]``; the bias is added afterwards in the model's dtype. The ``cuda`` and ``reference``
ops add an IE-BME layer's outlier side product in the kernel's epilogue before its one rounding, as the ``cpu``
op does, except for side widths that are not whole 16-byte rows, where they round the main product first: agreement
to fp16 rounding there (docs/runtime.md).
"""

from __future__ import annotations

import torch

from ...formats.arithmetic.linears import RowwiseLinear
from ..artifact.store import LayerRecord
from ..errors import UserError
from .plan import BACKENDS, LayerPlan, QuantizingOp, backend_kernels, layer_plan


def make_op(rec: LayerRecord, plan: LayerPlan, backend: str, device: torch.device | str | None = None):
    """The callable ``x2 [N, K] -> float16 [N, M]`` of ``backend`` for one layer."""
    if backend == "cpu":
        from .cpu import CpuOp

        return CpuOp(rec, plan)
    if backend not in BACKENDS:
        raise UserError(f"backend: unknown value {backend!r} (choose from {', '.join(BACKENDS)})")
    from .kernel_op import KernelOp

    if backend == "cuda":
        from .cuda import require_cuda

        require_cuda()
    return KernelOp(rec, plan, backend_kernels(backend), device or ("cuda" if backend == "cuda" else "cpu"))


def decode_rows(x: torch.Tensor) -> bool:
    """Whether the rows of a linear's input ``x`` are decode steps: one token per sequence (``[..., 1, K]``),
    which is when activation-sparsity thresholds apply (docs/runtime.md, "What a compressed linear computes")."""
    return x.ndim < 2 or x.shape[-2] == 1


class CompressedLinear(RowwiseLinear):
    """Drop-in for the ``nn.Linear`` a stored layer came from, running the layer's kernel arithmetic."""

    def __init__(self, rec: LayerRecord, bias: torch.Tensor | None = None, backend: str = "cpu",
                 dynamic_pruning: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.plan = layer_plan(rec, dynamic_pruning)
        self.out_features, self.in_features = self.plan.shape
        self.backend = backend
        self.op = make_op(rec, self.plan, backend, device)
        self.register_buffer("bias", None if bias is None else bias.detach().float().to(device or "cpu"))

    def matmul_2d(self, x: torch.Tensor, steps: bool | None = None) -> torch.Tensor:
        """float16 [N, M] of the token rows ``x`` [N, K]; ``steps``: every row is a sequence's decode step
        (None: only when N == 1)."""
        return self.op(x, steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., T, K] (or [N, K]: one sequence's tokens); T == 1 is a decode step of every sequence."""
        steps = decode_rows(x)
        y = self.matmul_2d(x.reshape(-1, self.in_features), steps).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def input_rule(self):
        """How this layer quantizes its input (None: it does not); see :class:`QuantizingOp`."""
        return self.op.input_rule() if isinstance(self.op, QuantizingOp) else None

    def offer(self, x: torch.Tensor, quantized: tuple) -> None:
        """Hand over the quantized input of ``x``, computed by the op that produced ``x``."""
        self.op.offer(x, quantized)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.plan.label}, backend={self.backend}"
