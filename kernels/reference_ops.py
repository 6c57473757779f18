"""The runtime's kernels computed by their CPU references (``runtime_ops.RuntimeKernels``), on torch tensors.

Every function returns exactly what its CUDA kernel returns (``cuda_ops``): the IE-BME product from the stored
bitmaps, value streams and row permutations (``iebme_reference``), the Tiled-CBC products from ColInfo and the
bitmaps (``tiled_cbc_reference``), the activation quantization, outlier side product and glue from the formats'
and the glue's torch definitions. Results are on the input's device (CPU in practice); slow, but exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..formats.arithmetic.grouped import grouped_int_matmul
from . import attention, glue, lm_head, norm_quant
from .norm_quant import InputRule, QuantizedInput


@dataclass(frozen=True)
class ReferenceLayer:
    """A stored layer for the references: the encoding, its scales and group size."""

    m: Any
    scales: Any
    group_size: int | None

    @property
    def kp(self) -> int:
        """K padded to whole 64-column tiles, as the IE-BME kernel reads its input codes."""
        return -(-int(self.m.shape[1]) // 64) * 64

    @property
    def bits(self) -> int | None:
        return self.m.geometry.bits


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


class ReferenceKernels:
    """See the module docstring."""

    name = "reference"

    def glue_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float16, torch.bfloat16, torch.float32)

    rms_norm = staticmethod(glue.rms_norm_reference)
    add_rms_norm = staticmethod(glue.add_rms_norm_reference)
    silu_mul = staticmethod(glue.silu_mul_reference)
    rotary_cache = staticmethod(glue.rotary_cache_reference)
    decode_attention = staticmethod(attention.decode_attention_reference)
    decode_attention_quant = staticmethod(attention.decode_attention_quant_reference)
    decode_attention_rope = staticmethod(attention.decode_attention_rope_reference)
    rms_norm_quant = staticmethod(norm_quant.rms_norm_quant_reference)
    add_rms_norm_quant = staticmethod(norm_quant.add_rms_norm_quant_reference)
    silu_mul_quant = staticmethod(norm_quant.silu_mul_quant_reference)
    lm_head_greedy = staticmethod(lm_head.lm_head_greedy_reference)

    def act_quant(self, x: torch.Tensor, rule: InputRule) -> QuantizedInput:
        return rule.reference(x)

    def iebme_layer(self, m: Any, scales: Any, group_size: int) -> ReferenceLayer:
        return ReferenceLayer(m, np.asarray(scales), int(group_size))

    def iebme_spmm16(self, layer: ReferenceLayer, x: torch.Tensor) -> torch.Tensor:
        from .iebme_reference import iebme_float_reference

        y = iebme_float_reference(layer.m, layer.scales, _numpy(x.half().float()), int(layer.group_size))
        return torch.from_numpy(y).to(x.device)

    def iebme_dense16(self, layer: ReferenceLayer, x: torch.Tensor) -> torch.Tensor:
        """The dense path's function is the kernel's (exact products, float32 sums): the same reference."""
        return self.iebme_spmm16(layer, x)

    def iebme_spmm(self, layer: ReferenceLayer, xq: torch.Tensor, sx: torch.Tensor,
                   side: tuple | None = None) -> torch.Tensor:
        from .iebme_reference import iebme_partial_sums, scale_partials

        k = int(layer.m.shape[1])
        gs = min(int(layer.group_size), k)
        partial = iebme_partial_sums(layer.m, _numpy(xq[:, :k]), gs)
        if side is None:
            y = scale_partials(partial, layer.scales, _numpy(sx))
            return torch.from_numpy(np.ascontiguousarray(y)).to(xq.device)
        y32 = torch.from_numpy(scale_partials(partial, layer.scales, _numpy(sx), dtype=np.float32))
        oq, osx, wq, sw, group = (t.cpu() if isinstance(t, torch.Tensor) else t for t in side)
        return grouped_int_matmul(oq, osx, wq, sw, group, out=y32).half().to(xq.device)

    def iebme_dense(self, layer: ReferenceLayer, xq: torch.Tensor, sx: torch.Tensor,
                    side: tuple | None = None) -> torch.Tensor:
        """The prompt path's function is the kernel's (up to float32 summation order): the same reference."""
        return self.iebme_spmm(layer, xq, sx, side)

    @staticmethod
    def side_fusable(oq: torch.Tensor, wq: torch.Tensor, group: int) -> bool:
        from .iebme_spmm import side_fusable

        return side_fusable(int(wq.shape[1]), group, oq.data_ptr(), wq.data_ptr())

    def side_product(self, y: torch.Tensor, oq: torch.Tensor, osx: torch.Tensor, wq: torch.Tensor,
                     sw: torch.Tensor, group: int) -> torch.Tensor:
        return grouped_int_matmul(oq, osx, wq, sw, group, out=y.float()).half()

    def dense(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x.half().float() @ weight.float().T).half()

    def tcbc_layer(self, m: Any, scales: Any, group_size: int | None) -> ReferenceLayer:
        return ReferenceLayer(m, None if scales is None else np.asarray(scales),
                              None if group_size is None else int(group_size))

    def spmspv(self, layer: ReferenceLayer, x: torch.Tensor, tau: float | None) -> torch.Tensor:
        from .tiled_cbc_reference import spmspv_reference, spmspv_rows_reference

        ref = spmspv_rows_reference if x.ndim == 2 else spmspv_reference
        y = ref(layer.m, _numpy(x.half().float()), tau, layer.scales, self._group(layer), out_dtype=np.float16)
        return torch.from_numpy(y).to(x.device)

    def tcbc_spmm(self, layer: ReferenceLayer, x: torch.Tensor) -> torch.Tensor:
        from .tiled_cbc_reference import spmm_reference

        y = spmm_reference(layer.m, _numpy(x.half().float()), layer.scales, self._group(layer), out_dtype=np.float16)
        return torch.from_numpy(y).to(x.device)

    @staticmethod
    def _group(layer: ReferenceLayer) -> int | None:
        return layer.group_size if layer.scales is not None else None


REFERENCE = ReferenceKernels()
