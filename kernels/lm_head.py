"""The decode step's last launch (``lm_head.cu``): the lm_head product of the final norm's rows and, when asked,
each row's greedy token, so that the final norm, lm_head and the greedy choice are two launches.

``lm_head_greedy_reference`` is what the decoder did before (the float16 product, ``.float()``, ``torch.argmax``),
on any device; ``lm_head_greedy`` is the kernel on torch float16 CUDA tensors and torch's current stream. Both
return float32 logits [B, V] and write the tokens in place; the kernel's logits differ from the reference's only
by the float32 summation order, and its tokens are always ``torch.argmax`` of the logits it returns.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from .cluster_launch import launch
from .errors import KernelError

WARPS = 8  # lm_head.cu's HEAD_WARPS
XPAD = 32  # lm_head.cu's HEAD_XPAD
MAX_ROWS = 8  # the mma's batch columns
MAX_SMEM = 160 * 1024  # the shared x rows a block may take (sm_80+: up to 227 KiB a block)
BLOCKS_PER_SM = 2


def lm_head_greedy_reference(x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """float32 logits [B, V] of ``x`` [B, K] by ``weight`` [V, K] (the product in their dtype, as ``nn.Linear``);
    with ``tokens`` [B] (int64) each row's argmax written into it (the first of equal logits)."""
    logits = torch.nn.functional.linear(x, weight).float()
    if tokens is not None:
        tokens.copy_(torch.argmax(logits, dim=-1))
    return logits


def shape_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [B, K] with B <= 8, K a multiple of 8 whose B shared rows fit a block; the same answer on every
    backend, so the reference backend takes the CUDA path's decisions."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        return False
    b, k = x.shape
    return 1 <= b <= MAX_ROWS and k % 8 == 0 and b * (k + XPAD) * 2 <= MAX_SMEM


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this case: float16 CUDA tensors of a shape it takes, on sm_80 or newer (mma)."""
    return (x.is_cuda and x.dtype == torch.float16 and weight.dtype == torch.float16
            and torch.cuda.get_device_capability(x.device)[0] >= 8 and shape_supported(x, weight))


@cache
def _function():
    from .loader import load_module

    return load_module("lm_head").get_function("lm_head_greedy")


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(part_v, part_i, ticket): the blocks' best of each row and the zeroed ticket (the last block resets it), one
    set per device and grid so that every call and graph replay shares it. Made outside a graph capture; one first
    needed inside a capture is made by the graph itself and not kept."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), blocks)
    ws = _workspaces.get(key)
    if ws is None:
        ws = (torch.empty(MAX_ROWS * blocks, dtype=torch.float32, device=device),
              torch.empty(MAX_ROWS * blocks, dtype=torch.int32, device=device),
              torch.zeros(1, dtype=torch.int32, device=device))
        if not torch.cuda.is_current_stream_capturing():
            _workspaces[key] = ws
    return ws


def grid_blocks(vocab: int, sms: int) -> int:
    """Blocks of the launch: enough for every 16-row group a warp, at most BLOCKS_PER_SM a multiprocessor."""
    return max(1, min(-(-vocab // (16 * WARPS)), BLOCKS_PER_SM * sms))


def lm_head_greedy(x: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """:func:`lm_head_greedy_reference` in one launch (:func:`supports` must hold)."""
    import cupy as cp

    if not supports(x, weight):
        raise KernelError(f"lm_head_greedy takes float16 CUDA rows [B <= {MAX_ROWS}, K % 8 == 0] on sm_80+, got "
                          f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    if tokens is not None and (tokens.dtype != torch.int64 or tokens.shape != (x.shape[0],)
                               or not tokens.is_contiguous()):
        raise KernelError(f"lm_head_greedy: tokens must be a contiguous int64 [{x.shape[0]}], got "
                          f"{tuple(tokens.shape)} {tokens.dtype}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    weight = weight.contiguous()
    b, k = x.shape
    v = weight.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    blocks = grid_blocks(v, sms)
    logits = torch.empty(b, v, dtype=torch.float32, device=x.device)
    part_v, part_i, ticket = _workspace(x.device, blocks) if tokens is not None else (None, None, None)
    smem = b * (k + XPAD) * 2
    fn = _function()
    if smem > 48 * 1024 - 1024 and fn.max_dynamic_shared_size_bytes < smem:  # past the default opt-in
        fn.max_dynamic_shared_size_bytes = smem
    ptr = [np.uint64(0 if t is None else t.data_ptr()) for t in (x, weight, logits, tokens, part_v, part_i, ticket)]
    with cp.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
        launch(fn, (blocks,), (WARPS * 32,),
               (ptr[0], np.int64(x.stride(0) if b > 1 else k), ptr[1], np.int32(v), np.int32(k), np.int32(b),
                *ptr[2:]), shared_mem=smem)
    return logits
