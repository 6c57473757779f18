"""The kernels a compressed model runs, as one interface with two implementations (docs/runtime.md, "Kernels").

The runtime's compressed ops (``compressor/runtime/kernel_op.py``) and its decode step (``decoder.py``) call only
these functions, on torch tensors, so the same Python logic (which kernel, which layout, which threshold, which
outlier columns, which rows of a stacked product) runs with either implementation:

* :class:`~.cuda_ops.CudaKernels`: the CuPy RawKernels on torch's current CUDA stream (``backend="cuda"``);
* :class:`~.reference_ops.ReferenceKernels`: the kernels' CPU references, the same function of the same inputs
  (``backend="reference"``), so that the CUDA backend's logic is tested on any machine and only the kernels'
  arithmetic is left for the GPU tests.

Each function's result is defined by its reference; the CUDA kernel equals it bit for bit, or to the float32
summation order where the docstring says so.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .errors import KernelError
from .norm_quant import InputRule, QuantizedInput


class RuntimeKernels(Protocol):
    """What the runtime asks of a kernel implementation (see the module docstring)."""

    name: str

    def glue_dtypes(self) -> tuple[torch.dtype, ...]:
        """Model dtypes the glue functions take."""

    # ---- glue of the decode step
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def rotary_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> torch.Tensor: ...
    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                         offset: torch.Tensor, scale: float) -> torch.Tensor: ...
    def decode_attention_quant(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               pos: torch.Tensor, offset: torch.Tensor, scale: float,
                               rule: InputRule) -> tuple[torch.Tensor, QuantizedInput] | None:
        """(decode attention, o_proj's quantized input of it) from one launch, or None where it does not fuse
        (``attention.quant_fusable``, or no kernel for the case): then attention and the linear run as usual."""
    def decode_attention_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, offset: torch.Tensor, scale: float,
                              rule: InputRule | None) -> tuple[torch.Tensor, QuantizedInput | None] | None:
        """:meth:`rotary_cache` then decode attention (and, with ``rule`` where it fuses, o_proj's quantized
        input) from one launch on the raw Q/K/V rows of a decode step; None where no kernel takes the case."""
    def rms_norm_quant(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       rule: InputRule) -> tuple[torch.Tensor, QuantizedInput]: ...
    def add_rms_norm_quant(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                           rule: InputRule) -> tuple[torch.Tensor, torch.Tensor, QuantizedInput]: ...
    def silu_mul_quant(self, gate: torch.Tensor, up: torch.Tensor,
                       rule: InputRule) -> tuple[torch.Tensor, QuantizedInput]: ...
    def lm_head_greedy(self, x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """float32 logits [B, V] of the final norm's rows ``x`` [B, K] by the lm_head ``weight`` [V, K], and with
        ``tokens`` each row's argmax written into it (``lm_head.lm_head_greedy_reference``), in one launch where
        the kernel takes the case (``lm_head.shape_supported``)."""

    # ---- IE-BME with quantized activations
    def act_quant(self, x: torch.Tensor, rule: InputRule) -> QuantizedInput:
        """(codes int8 [N, rule.kp], scales float32 [N, G], side codes int8 [N, n] | None, side scales | None)."""

    def iebme_layer(self, m: Any, scales: Any, group_size: int) -> Any:
        """The layer made ready for :meth:`iebme_spmm` (its ``kp``: padded K of the input codes)."""

    def iebme_spmm(self, layer: Any, xq: torch.Tensor, sx: torch.Tensor, side: tuple | None = None) -> torch.Tensor:
        """float16 [N, M]: the exact group sums scaled in float32 in group order, plus (``side``: codes, scales,
        weight codes, weight scales, group) the 8-bit outlier side groups in order, rounded once."""

    def iebme_dense(self, layer: Any, xq: torch.Tensor, sx: torch.Tensor, side: tuple | None = None) -> torch.Tensor:
        """:meth:`iebme_spmm` for many rows (a prompt): the layer decoded once to a dense weight, the product as
        dense GEMMs of exact halves into float32 (``kernels.iebme_decode.spmm_dense_int``)."""

    def side_fusable(self, oq: torch.Tensor, wq: torch.Tensor, group: int) -> bool:
        """Whether :meth:`iebme_spmm` takes this side product (else :meth:`side_product` adds it)."""

    def side_product(self, y: torch.Tensor, oq: torch.Tensor, osx: torch.Tensor, wq: torch.Tensor,
                     sw: torch.Tensor, group: int) -> torch.Tensor:
        """float16 [N, M]: ``y`` plus the 8-bit outlier side product (``formats.arithmetic.grouped``), rounded."""

    # ---- fp16 activations
    def iebme_spmm16(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """float16 [N, M] of an IE-BME W4A16 / W2A16 layer (:meth:`iebme_layer`) on float16 activations: per group
        the float32 sum of code times input, times the weight scale, float32 over groups, rounded once."""

    def iebme_dense16(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The same product for many rows (a prompt): the layer decoded once to a dense float16 weight (4-bit: exact
        hi | lo halves) and one dense GEMM; float32 sums of exact products (``kernels.iebme_decode``)."""

    def dense(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float16 [N, M] = fp16(x) @ weight^T (weight float16 [M, K]) with float32 sums."""

    def tcbc_layer(self, m: Any, scales: Any, group_size: int | None) -> Any:
        """The Tiled-CBC layer made ready for :meth:`spmspv` and :meth:`tcbc_spmm` (its ``bits``)."""

    def spmspv(self, layer: Any, x: torch.Tensor, tau: float | None) -> torch.Tensor:
        """float16 [M]: the sum over inputs k with ``|fp16(x_k)| > tau`` (tau None: all) of W[:, k] x_k, float32;
        ``x`` [N, K] gives [N, M], each row its own (the several-row kernel on a GPU: a batched decode step)."""

    def tcbc_spmm(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """float16 [N, M] = fp16(x) @ W^T, every input active, float32 sums."""


def get(name: str) -> RuntimeKernels:
    """The kernel implementation ``"cuda"`` or ``"reference"`` (one instance per process)."""
    if name == "reference":
        from .reference_ops import REFERENCE

        return REFERENCE
    if name == "cuda":
        from .cuda_ops import cuda_kernels

        return cuda_kernels()
    raise KernelError(f"no runtime kernels named {name!r} (cuda or reference)")
