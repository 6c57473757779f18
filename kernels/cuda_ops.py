"""The runtime's kernels on a GPU (``runtime_ops.RuntimeKernels``): the CuPy RawKernels on torch tensors.

Tensors cross between torch and CuPy through DLPack (no copies) and every launch goes to torch's current stream
(a CuPy ``ExternalStream`` over it), so nothing is copied to the host inside a decode step. CuPy allocates through
torch's caching allocator (:func:`share_torch_allocator`), so that a step captured as a CUDA graph keeps the
outputs and workspaces the launchers allocate. Each function equals its reference in ``reference_ops`` bit for
bit, except where the float32 summation order differs (split-K of the IE-BME product, the Tiled-CBC kernels,
RMSNorm's sum of squares).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import cache

import torch

from . import attention, glue, lm_head, norm_quant
from .norm_quant import InputRule, QuantizedInput

_SHARED_ALLOCATOR = False


def share_torch_allocator() -> None:
    """Route CuPy's device allocations through torch's caching allocator (once per process).

    Inside a CUDA-graph capture the launchers' allocations must come from the graph's private memory pool, which
    only torch's allocator knows about: CuPy's own pool would hand the captured addresses to later, unrelated
    arrays. Through torch, an allocation on the capturing stream lands in the graph's pool and stays reserved
    for its replays."""
    global _SHARED_ALLOCATOR
    if _SHARED_ALLOCATOR:
        return
    import cupy as cp

    # bound here: CuPy frees its last arrays at interpreter exit, after this module's globals (torch among them)
    # are gone, which printed a traceback per array
    alloc, delete, stream = (torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete,
                             torch.cuda.current_stream)
    finalizing = sys.is_finalizing

    def malloc(size: int, device: int) -> int:
        return alloc(size, device, stream(device))

    def free(ptr: int, _device: int) -> None:
        try:
            delete(ptr)
        except Exception:
            if not finalizing():  # at exit torch's allocator may be torn down first: nothing left to free into
                raise

    cp.cuda.set_allocator(cp.cuda.PythonFunctionAllocator(malloc, free).malloc)
    _SHARED_ALLOCATOR = True


@contextmanager
def _on(device: torch.device):
    """CuPy on ``device`` and torch's current stream there."""
    import cupy as cp

    with cp.cuda.Device(device.index or 0), cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        yield cp


class CudaKernels:
    """See the module docstring."""

    name = "cuda"

    def __init__(self) -> None:
        share_torch_allocator()

    def glue_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float16,)

    rms_norm = staticmethod(glue.rms_norm)
    add_rms_norm = staticmethod(glue.add_rms_norm)
    silu_mul = staticmethod(glue.silu_mul)
    rotary_cache = staticmethod(glue.rotary_cache)

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                         offset: torch.Tensor, scale: float) -> torch.Tensor:
        """attention.cu for the cases it takes (one query token, ...), torch's SDPA otherwise."""
        if attention.supports(q, k_cache):
            return attention.decode_attention(q, k_cache, v_cache, pos, offset, scale)
        return attention.decode_attention_reference(q, k_cache, v_cache, pos, offset, scale)
    decode_attention_quant = staticmethod(attention.decode_attention_quant)
    decode_attention_rope = staticmethod(attention.decode_attention_rope)
    rms_norm_quant = staticmethod(norm_quant.rms_norm_quant)
    add_rms_norm_quant = staticmethod(norm_quant.add_rms_norm_quant)
    silu_mul_quant = staticmethod(norm_quant.silu_mul_quant)

    @staticmethod
    def lm_head_greedy(x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """lm_head.cu for the cases it takes, the torch product and argmax otherwise."""
        if lm_head.supports(x, weight):
            return lm_head.lm_head_greedy(x, weight, tokens)
        return lm_head.lm_head_greedy_reference(x, weight, tokens)

    def act_quant(self, x: torch.Tensor, rule: InputRule) -> QuantizedInput:
        from .act_quant import quantize_inputs

        x = x if x.dtype in (torch.float16, torch.float32) else x.float()
        with _on(x.device) as cp:
            out = quantize_inputs(cp.from_dlpack(x.contiguous()), rule.bits, rule.group, rule.clip, rule.kp,
                                  None if rule.perm is None else cp.from_dlpack(rule.perm), rule.n_side,
                                  rule.side_bits, rule.side_group, rule.side_clip)
            # inside the stream's context: DLPack orders the hand-over on CuPy's current stream, which must be
            # torch's (the legacy default stream would break a graph capture)
            return tuple(None if a is None else torch.from_dlpack(a) for a in out)

    def iebme_layer(self, m, scales, group_size: int):
        from .iebme_spmm import prepare_layer

        layer = prepare_layer(m, scales, group_size)
        layer.kp = layer.tc * 64
        return layer

    def iebme_spmm(self, layer, xq: torch.Tensor, sx: torch.Tensor, side: tuple | None = None) -> torch.Tensor:
        from .iebme_spmm import Side, spmm_iebme

        with _on(xq.device) as cp:
            fused = None
            if side is not None:
                oq, osx, wq, sw, group = side
                fused = Side(cp.from_dlpack(oq), cp.from_dlpack(osx), cp.from_dlpack(wq), cp.from_dlpack(sw),
                             int(group))
            y = spmm_iebme(layer, cp.from_dlpack(xq), cp.from_dlpack(sx.float().contiguous()), poison=False,
                           side=fused)
            return torch.from_dlpack(y)  # inside the context (see act_quant)

    def iebme_dense(self, layer, xq: torch.Tensor, sx: torch.Tensor, side: tuple | None = None) -> torch.Tensor:
        from .iebme_decode import spmm_dense_int

        with _on(xq.device):
            return spmm_dense_int(layer, xq, sx, side)

    def iebme_spmm16(self, layer, x: torch.Tensor) -> torch.Tensor:
        from .iebme_spmm import spmm_iebme16

        with _on(x.device) as cp:
            return torch.from_dlpack(spmm_iebme16(layer, cp.from_dlpack(x.half().contiguous()), poison=False))

    def iebme_dense16(self, layer, x: torch.Tensor) -> torch.Tensor:
        from .iebme_decode import spmm_dense16

        with _on(x.device) as cp:
            return torch.from_dlpack(spmm_dense16(layer, cp.from_dlpack(x.half().contiguous())))

    @staticmethod
    def side_fusable(oq: torch.Tensor, wq: torch.Tensor, group: int) -> bool:
        from .iebme_spmm import side_fusable

        return side_fusable(int(wq.shape[1]), group, oq.data_ptr(), wq.data_ptr())

    def side_product(self, y: torch.Tensor, oq: torch.Tensor, osx: torch.Tensor, wq: torch.Tensor,
                     sw: torch.Tensor, group: int) -> torch.Tensor:
        from .outlier_side import side_product

        return side_product(y, oq.contiguous(), osx.float().contiguous(), wq, sw, group)

    def dense(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.half(), weight)

    def tcbc_layer(self, m, scales, group_size: int | None):
        from .tiled_cbc_device import DeviceTiledCBC

        return DeviceTiledCBC(m, scales, group_size)

    def spmspv(self, layer, x: torch.Tensor, tau: float | None) -> torch.Tensor:
        from .tiled_cbc_spmspv import spmspv

        with _on(x.device) as cp:
            return torch.from_dlpack(spmspv(layer, cp.from_dlpack(x.half().contiguous()), tau))

    def tcbc_spmm(self, layer, x: torch.Tensor) -> torch.Tensor:
        from .tiled_cbc_spmm import spmm

        with _on(x.device) as cp:
            return torch.from_dlpack(spmm(layer, cp.from_dlpack(x.half().contiguous())))


@cache
def cuda_kernels() -> CudaKernels:
    """The process's :class:`CudaKernels`."""
    return CudaKernels()
