"""Decode attention over the KV cache's valid length (``attention.cu``), for one query token per sequence.

``decode_attention_reference`` is what the decoder computed before the kernel existed (torch's SDPA over the
allocated cache with a visibility mask), on any device; ``decode_attention`` is the split-along-the-sequence
kernel (one launch), on torch float16 CUDA tensors and torch's current stream.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from .cluster_launch import launch
from .errors import KernelError

CHUNK = 32  # attention.cu's CHUNK: cache slots per split block
WARPS = 4  # attention.cu's WARPS: warps per block
MAX_G = 8  # query heads per KV head
MAX_D = 256  # head dimension


def visible(pos: torch.Tensor, offset: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, L] bool: slot j (of ``slots``, arange(L)) visible to the query at slot pos[t] of row b iff
    j <= pos[t] and j is not b's left padding (j >= offset[b]); a padding query sees itself."""
    j = slots[None, None, :]
    p = pos[None, :, None]
    return ((j <= p) & ((j >= offset[:, None, None]) | (j == p)))[:, None]


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                               offset: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, T, D] at slots ``pos`` [T], caches [B, Hkv, L, D], ``offset`` [B] left padding: [B, T, H * D]."""
    b, h, t, d = q.shape
    mask = visible(pos, offset, torch.arange(k_cache.shape[2], device=q.device))
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale,
                                       enable_gqa=k_cache.shape[1] != h)
    return o.transpose(1, 2).reshape(b, t, h * d)


@cache
def _function(per: int):
    from .loader import load_module

    return load_module("attention", ()).get_function(f"attention_decode_{per}")


_tickets: dict[tuple[int, int], torch.Tensor] = {}


def _ticket(device: torch.device, n: int) -> torch.Tensor:
    """attention.cu's per-(row, KV head) counters: zero between launches (the last block resets its own), so one
    buffer per device and size serves every call and every graph replay. Made outside a graph capture; one first
    needed inside a capture is made (and zeroed) by the graph itself and not kept."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), n)
    buf = _tickets.get(key)
    if buf is None:
        buf = torch.zeros(n, dtype=torch.int32, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _tickets[key] = buf
    return buf


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this case: one query token, float16 CUDA tensors, head dim a multiple of 32 up to
    256, at most 8 query heads per KV head."""
    b, h, t, d = q.shape
    hkv = k_cache.shape[1]
    return (t == 1 and q.is_cuda and q.dtype == torch.float16 and k_cache.dtype == torch.float16
            and d % 32 == 0 and d <= MAX_D and h % hkv == 0 and h // hkv <= MAX_G)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernel's vector loads)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     offset: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention_reference` for T = 1 in one launch, reading only the slots <= pos."""
    import cupy as cp

    if not supports(q, k_cache):
        raise KernelError(f"decode_attention: unsupported case q {tuple(q.shape)} {q.dtype}, caches "
                         f"{tuple(k_cache.shape)} (see attention.supports)")
    b, h, _, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0):
        raise KernelError("decode_attention: the caches must be contiguous and 16-byte aligned")
    q = _aligned(q)
    chunks = -(-length // CHUNK)
    part_o = torch.empty(b, h, chunks, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, h, chunks, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(b, 1, h * d, dtype=q.dtype, device=q.device)
    pos = pos.to(torch.int64).contiguous()
    offset = offset.to(torch.int64).contiguous()
    ticket = _ticket(q.device, b * hkv)
    ptr = [np.uint64(t.data_ptr()) for t in (q, k_cache, v_cache, pos, offset, part_o, part_ml, ticket, out)]
    with cp.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream):
        launch(_function(d // 32), (chunks, hkv, b), (WARPS * 32,),
               (*ptr[:5], np.int32(h), np.int32(hkv), np.int32(length), np.int32(d), np.float32(scale), *ptr[5:]),
               shared_mem=WARPS * (h // hkv) * d * 4)
    return out
