"""Decode attention over the KV cache's valid length (``attention.cu``), for one query token per sequence.

``decode_attention_reference`` is what the decoder computed before the kernel existed (torch's SDPA over the
allocated cache with a visibility mask), on any device; ``decode_attention`` is the kernel (one launch), on
torch float16 CUDA tensors and torch's current stream, in one of two forms (:func:`cluster_form`): split along the
sequence with global partials and a ticketed combine, or (sm_90) a thread-block cluster a head that combines in
distributed shared memory. With an o_proj input rule it
may fuse (:func:`quant_fusable`) and also return o_proj's quantized input from the same launch
(``decode_attention_quant``; its reference: the attention reference, then the rule's quantization).
``decode_attention_rope`` is the same launch fed the raw Q/K/V rows: it also does ``glue.rotary_cache`` for the
token (rotation of q and k, the KV-cache write), so a decode layer runs one launch between its Q/K/V and o_proj
products instead of two (its reference: ``glue.rotary_cache_reference``, then the attention reference).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from ..formats.arithmetic.weights import FP16_TINY, grid_max
from .cluster_launch import launch
from .errors import KernelError

CHUNK = 32  # attention.cu's CHUNK: cache slots per split block
WARPS = 4  # attention.cu's WARPS: warps per block
CL, CL_WARPS = 8, 8  # attention.cu's cluster form: CTAs a (row, KV head), warps a CTA
CLUSTER: bool | None = None  # the cluster form (sm_90): True, False, or None: where it measured faster (cluster_form)
CLUSTER_FROM_LEN = 3072  # None: batch-1 MHA caches up to this many slots keep the split form (cluster_form)
# the cache's earlier slots, the position and the rotary tables loaded before the wait for the Q/K/V product
# (attention.cu, ATTN_EARLY; docs/kernels.md, "Decode attention"); False: wait first, every load after it
EARLY = True
CL_GM = (1, 4, 8)  # attention.cu's cluster kernels: bounds on the query heads a KV head (the last is MAX_G)
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
def quant_fusable(rule, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention launch can write o_proj's quantized input (``rule``, an ``InputRule``): no outlier
    side or channel permutation, and each KV head's ``heads / kv_heads * head_dim`` output channels whole
    quantization groups (LLaMA-2-7B: one group of 128 per head; Llama-3-8B: four heads, four groups). The same
    answer on every backend, so the reference backend takes the CUDA path's decisions."""
    if rule is None or rule.perm is not None or rule.n_side:
        return False
    hd = heads * head_dim
    gm = min(rule.group, hd)
    return heads % kv_heads == 0 and (heads // kv_heads * head_dim) % gm == 0 and rule.kp >= hd


def decode_attention_quant_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     pos: torch.Tensor, offset: torch.Tensor, scale: float, rule):
    """(:func:`decode_attention_reference`, o_proj's quantized input of it by the formats' functions), or None
    where the kernel would not fuse (:func:`shape_supported`, :func:`quant_fusable`): the CUDA path's decision."""
    if not (shape_supported(q, k_cache) and quant_fusable(rule, q.shape[1], k_cache.shape[1], q.shape[3])):
        return None
    o = decode_attention_reference(q, k_cache, v_cache, pos, offset, scale)
    return o, rule.reference(o.reshape(-1, o.shape[-1]))


def rope_fusable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention_rope` takes raw ``q`` [B, T, H, D] (before rotation): the shapes the
    attention kernel takes (:func:`shape_supported`). The same answer on every backend."""
    return shape_supported(q.transpose(1, 2), k_cache)


def decode_attention_rope_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor,
                                    v_cache: torch.Tensor, offset: torch.Tensor, scale: float, rule=None):
    """``glue.rotary_cache_reference`` of the raw q [B, 1, H, D], k and v [B, 1, Hkv, D] (the caches written at
    ``pos``), then :func:`decode_attention_reference`, and with ``rule`` where it fuses (:func:`quant_fusable`)
    o_proj's quantized input: (output [B, 1, H * D], quantized input or None); None where the kernel would not
    take the case (:func:`rope_fusable`): the CUDA path's decision."""
    from .glue import rotary_cache_reference

    if not rope_fusable(q, k_cache):
        return None
    qr = rotary_cache_reference(q, k, v, cos, sin, pos, rpos, k_cache, v_cache)
    if rule is not None and quant_fusable(rule, q.shape[2], k_cache.shape[1], q.shape[3]):
        return decode_attention_quant_reference(qr, k_cache, v_cache, pos, offset, scale, rule)
    return decode_attention_reference(qr, k_cache, v_cache, pos, offset, scale), None


def _function(per: int, cluster: bool = False, group: int = 1):
    from . import study

    return _kernel(per, cluster, next(g for g in CL_GM if g >= group), EARLY, study.build("attention"))


@cache
def _kernel(per: int, cluster: bool, gm: int, early: bool, build):
    name = f"attention_decode_cl_{per}_g{gm}" if cluster else f"attention_decode_{per}"
    return _build_function(per, gm, early, build).get_function(name)


@cache
def _build_function(per: int, gm: int, early: bool, build):
    """The module of this head dimension's split kernel and cluster kernel, both unrolled to up to ``gm`` query heads
    a KV head, with the cache loads before the wait or not (:data:`EARLY`), as ``build`` has it (the shipped file
    unless a study set another: keyed by it, kernels/study.py)."""
    from .loader import load_module

    # only a model's two kernels (attention.cu, ATTN_PER and ATTN_GM): about 2 s to compile instead of 15
    return load_module("attention", (), options=(f"-DATTN_PER={per}", f"-DATTN_GM={gm}", f"-DATTN_EARLY={int(early)}"))


def cluster_form(batch: int = 1, group: int = 1, length: int = 0) -> bool:
    """Whether a launch over ``[batch, Hkv, length, D]`` caches with ``group`` query heads a KV head takes the
    cluster form: never without thread-block clusters (before sm_90); else :data:`CLUSTER` where set; by default
    (None) where it measured faster, the step of both forms side by side (H100, 2026-12-07; docs/kernels.md,
    "Decode attention"): batch 1 with GQA (Llama-3-8B, 6.239 against 6.380 ms at context 512, 6.506 against 7.006
    at 2048) or caches longer than :data:`CLUSTER_FROM_LEN` (LLaMA-2-7B at 4096: 6.671 against 6.788 ms); the split
    form for batch-1 MHA on shorter caches (level at 2048, 5.884 against 5.935 ms at 1024) and for every batch above
    1 (LLaMA-2-7B batch 8, context 512: 6.572 against 7.741 ms; batch 4 and Llama-3-8B batch 4 and 8 alike). The
    shapes are fixed for a decoder, so a captured graph replays one form."""
    from .cluster_launch import compute_capability

    if compute_capability() < 90:
        return False
    if CLUSTER is not None:
        return CLUSTER
    return batch == 1 and (group > 1 or length > CLUSTER_FROM_LEN)


_tickets: dict[tuple[int, int], torch.Tensor] = {}
_NO_ROPE = (np.uint64(0), np.int64(0)) * 3 + (np.uint64(0),) * 3  # attention.cu's Rope arguments: none


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
    """Whether the kernel takes this case: float16 CUDA tensors of a shape it takes (:func:`shape_supported`)."""
    return (q.is_cuda and q.dtype == torch.float16 and k_cache.dtype == torch.float16
            and shape_supported(q, k_cache))


def shape_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """One query token, head dim a multiple of 32 up to 256, at most 8 query heads per KV head."""
    b, h, t, d = q.shape
    hkv = k_cache.shape[1]
    return t == 1 and d % 32 == 0 and d <= MAX_D and h % hkv == 0 and h // hkv <= MAX_G


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernel's vector loads)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     offset: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention_reference` for T = 1 in one launch, reading only the slots <= pos."""
    return _decode(q, k_cache, v_cache, pos, offset, scale, None)[0]


def decode_attention_quant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                           offset: torch.Tensor, scale: float, rule):
    """:func:`decode_attention_quant_reference` in one launch (None where the kernel or the rule does not fuse):
    the attention output and o_proj's quantized input, act_quant.cu's codes and scales bit for bit."""
    if not (supports(q, k_cache) and quant_fusable(rule, q.shape[1], k_cache.shape[1], q.shape[3])):
        return None
    return _decode(q, k_cache, v_cache, pos, offset, scale, rule)


def decode_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          pos: torch.Tensor, rpos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          offset: torch.Tensor, scale: float, rule=None):
    """:func:`decode_attention_rope_reference` in one launch (q, k, v may be row views of one stacked product);
    None where the kernel does not take the case."""
    qt = q.transpose(1, 2)
    if not (supports(qt, k_cache) and rope_fusable(q, k_cache)):
        return None
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise KernelError("decode_attention_rope: the rotary tables must be contiguous")
    rows = [_aligned_rows(t) for t in (q, k, v)]  # these tensors (and rp) stay alive until the launch is queued
    rp = rpos.reshape(-1).to(torch.int64).contiguous()
    rope = (*(x for r in rows for x in (np.uint64(r[0].data_ptr()), np.int64(r[1]))),
            np.uint64(cos.data_ptr()), np.uint64(sin.data_ptr()), np.uint64(rp.data_ptr()))
    if rule is not None and not quant_fusable(rule, q.shape[2], k_cache.shape[1], q.shape[3]):
        rule = None
    return _decode(qt, k_cache, v_cache, pos, offset, scale, rule, rope)


def _aligned_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, 1, heads, D] as rows [B, heads * D] (``glue._rows``) whose starts are 16-byte aligned (the kernel's
    vector loads; copied if not), and the row stride in elements."""
    from .glue import _rows

    r, ld = _rows(t.reshape(t.shape[0], -1))
    if r.data_ptr() % 16 or ld % 8:
        r = r.contiguous()
        r = r if r.data_ptr() % 16 == 0 else r.clone()
        ld = r.shape[1]
    return r, ld


def _decode(q, k_cache, v_cache, pos, offset, scale, rule, rope=None):
    """One launch; ``rope``: the fused form's Rope arguments (attention.cu), their tensors alive in the caller."""
    import cupy as cp

    if not supports(q, k_cache):
        raise KernelError(f"decode_attention: unsupported case q {tuple(q.shape)} {q.dtype}, caches "
                         f"{tuple(k_cache.shape)} (see attention.supports)")
    b, h, _, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0):
        raise KernelError("decode_attention: the caches must be contiguous and 16-byte aligned")
    q = _aligned(q) if rope is None else q  # fused: q is read raw through the rope arguments
    g = h // hkv
    cluster = cluster_form(b, g, length)
    out = torch.empty(b, 1, h * d, dtype=q.dtype, device=q.device)
    pos = pos.to(torch.int64).contiguous()
    offset = offset.to(torch.int64).contiguous()
    if cluster:  # no global partials or tickets (attention.cu, decode_cluster)
        part_o = part_ml = ticket = None
        grid, block, smem = (CL, hkv, b), (CL_WARPS * 32,), (CL_WARPS // 2 + 2) * g * d * 4
    else:
        chunks = -(-length // CHUNK)
        part_o = torch.empty(b, h, chunks, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, chunks, 2, dtype=torch.float32, device=q.device)
        ticket = _ticket(q.device, b * hkv)
        grid, block, smem = (chunks, hkv, b), (WARPS * 32,), WARPS * g * d * 4
    ptr = [np.uint64(0 if t is None else t.data_ptr())
           for t in (q, k_cache, v_cache, pos, offset, part_o, part_ml, ticket, out)]
    quantized, qargs = None, (np.uint64(0), np.uint64(0), np.int32(0), np.int32(1), np.int32(8), np.float32(1),
                              np.float32(1), np.float32(FP16_TINY))
    if rule is not None:
        gm = min(rule.group, h * d)
        codes = torch.empty(b, rule.kp, dtype=torch.int8, device=q.device)
        scales = torch.empty(b, h * d // gm, dtype=torch.float32, device=q.device)
        quantized = (codes, scales, None, None)
        qargs = (np.uint64(codes.data_ptr()), np.uint64(scales.data_ptr()), np.int32(rule.kp), np.int32(gm),
                 np.int32(rule.bits), np.float32(rule.clip), np.float32(grid_max(rule.bits)), np.float32(FP16_TINY))
    fn = _function(d // 32, cluster, g)
    if smem > 48 * 1024 - 4096 and fn.max_dynamic_shared_size_bytes < smem:  # past the default opt-in
        fn.max_dynamic_shared_size_bytes = smem
    with cp.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream):
        launch(fn, grid, block,
               (*ptr[:5], np.int32(h), np.int32(hkv), np.int32(length), np.int32(d), np.float32(scale), *ptr[5:],
                *qargs, *(rope or _NO_ROPE)),
               shared_mem=smem, cluster=(CL, 1, 1) if cluster else None)
    return out, quantized
