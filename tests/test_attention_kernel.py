"""Decode attention (kernels/attention.py): the reference against the definition everywhere, the kernel against the
definition where CuPy and a GPU are present, also replayed from a CUDA graph at moving positions (the split form's
ticket counters must be back at zero after every launch). Every GPU test runs both forms of the kernel: the split
one (global partials, the last block combines) and the cluster one (sm_90: the chunks of a head combined through
distributed shared memory; on other GPUs the same split launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from unionsparse.compressor.runtime.cuda import cuda_problem
from unionsparse.kernels import attention

needs_gpu = pytest.mark.skipif(cuda_problem() is not None, reason=f"needs CuPy and a CUDA device ({cuda_problem()})")


@pytest.fixture(params=[(False, False), (False, True), (True, False), (True, True)],
                ids=["split", "split-early", "cluster", "cluster-early"])
def form(request, monkeypatch):
    """attention.CLUSTER off and on (the kernel's two forms), each waiting for the Q/K/V product before any load
    or loading the cache's earlier slots before the wait (attention.EARLY)."""
    cluster, early = request.param
    monkeypatch.setattr(attention, "CLUSTER", cluster)
    monkeypatch.setattr(attention, "EARLY", early)
    return cluster


@pytest.mark.parametrize("cc", [80, 90])
def test_cluster_form_rule(monkeypatch, cc):
    """The default (CLUSTER None) takes the cluster form where it measured faster (batch 1 with GQA or a long cache)
    and the split form for batch-1 MHA on shorter caches and for every batch above 1; CLUSTER forces either;
    nothing before sm_90 has clusters."""
    from unionsparse.kernels import cluster_launch

    monkeypatch.setattr(cluster_launch, "compute_capability", lambda: cc)
    monkeypatch.setattr(attention, "CLUSTER", None)
    n = attention.CLUSTER_FROM_LEN
    cases = {(1, 1, 530): False, (1, 1, 2116): False, (1, 1, n): False, (1, 1, n + 1): True, (1, 1, 4164): True,
             (1, 4, 530): True, (1, 8, 2116): True, (2, 1, 530): False, (8, 1, 2116): False, (4, 4, 580): False,
             (8, 4, 4164): False}
    assert {c: attention.cluster_form(*c) for c in cases} == {c: v and cc >= 90 for c, v in cases.items()}
    for forced in (False, True):
        monkeypatch.setattr(attention, "CLUSTER", forced)
        assert {attention.cluster_form(*c) for c in cases} == {forced and cc >= 90}


def exact(q, kc, vc, pos: int, offset: list[int], scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v over the slots row b sees: offset[b] <= j <= pos, and pos itself."""
    b, h, _, d = q.shape
    g = h // kc.shape[1]
    out = torch.zeros(b, 1, h * d, dtype=torch.float64)
    for row in range(b):
        seen = [j for j in range(pos + 1) if j >= offset[row] or j == pos]
        for head in range(h):
            k = kc[row, head // g, seen].double()
            v = vc[row, head // g, seen].double()
            w = torch.softmax(k @ q[row, head, 0].double() * scale, 0)
            out[row, 0, head * d:(head + 1) * d] = w @ v
    return out


def _case(b, h, hkv, d, length, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype).to(device)
    kc = (torch.randn(b, hkv, length, d, generator=g) * 1.5).to(dtype).to(device)
    vc = torch.randn(b, hkv, length, d, generator=g).to(dtype).to(device)
    return q, kc, vc


def test_reference_is_attention_over_what_each_row_sees():
    q, kc, vc = _case(3, 6, 2, 16, 40, 0)
    offset = [0, 4, 30]  # row 2: the query at slot 33 sees slots 30..33 only
    got = attention.decode_attention_reference(q, kc, vc, torch.tensor([33]), torch.tensor(offset), 0.25)
    torch.testing.assert_close(got.double(), exact(q, kc, vc, 33, offset, 0.25), atol=1e-5, rtol=1e-5)
    wrong = exact(q, kc, vc, 33, [0, 0, 0], 0.25)  # the padding seen: a different answer, so the check can fail
    assert (got.double() - wrong).abs().max() > 1e-2


def test_supports_only_what_the_kernel_takes():
    q, kc, _ = _case(1, 8, 2, 64, 16, 1, torch.float16)
    assert not attention.supports(q, kc)  # on the CPU
    q2 = torch.randn(1, 8, 2, 64).half()
    assert not attention.supports(q2, kc)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("b, h, hkv, d, length, pos, offset", [
    (1, 32, 32, 128, 600, 530, [0]),            # LLaMA-2-7B, batch 1
    (2, 32, 8, 128, 4200, 4100, [0, 1000]),     # Llama-3-8B's GQA, long context, a padded row
    (3, 9, 3, 64, 140, 70, [0, 5, 64]),          # SmolLM2's heads; row 2's padding covers whole chunk 0
    (1, 4, 4, 64, 64, 0, [0]),                   # the first slot
    (2, 16, 2, 256, 300, 299, [0, 31]),          # eight query heads per KV head, the largest head dim
    (2, 64, 8, 128, 1100, 1090, [0, 7]),         # Llama-3-70B's heads (eight a KV head, head dim 128): the g8 kernel
    (1, 6, 2, 96, 100, 64, [0]),                 # a head dim that is not a power of two (3 halves a lane)
    (8, 32, 32, 128, 2100, 2047, [0] * 8),       # batch 8, long context: many chunks into one combine
])
def test_kernel_is_attention_over_what_each_row_sees(b, h, hkv, d, length, pos, offset, form):
    q, kc, vc = _case(b, h, hkv, d, length, pos, torch.float16, "cuda")
    scale = d ** -0.5
    want = exact(q.cpu(), kc.cpu(), vc.cpu(), pos, offset, scale)
    dev = torch.device("cuda")
    p, off = torch.tensor([pos], device=dev), torch.tensor(offset, device=dev)
    got = attention.decode_attention(q, kc, vc, p, off, scale).double().cpu()
    ref = attention.decode_attention_reference(q, kc, vc, p, off, scale).double().cpu()
    err, ref_err = (got - want).abs().max(), (ref - want).abs().max()
    # float32 sums then one float16 rounding: within an fp16 step of the exact value, as torch's SDPA
    assert err <= max(2 * ref_err, 2 ** -10 * want.abs().max()), (err, ref_err)
    kc[:, :, pos + 1:] = float("nan")  # slots past pos are never read
    assert torch.equal(attention.decode_attention(q, kc, vc, p, off, scale).cpu().double(), got)


@pytest.mark.gpu
@needs_gpu
def test_kernel_replays_in_a_cuda_graph_at_each_position(form):
    b, h, hkv, d, length = 2, 8, 2, 128, 260
    q, kc, vc = _case(b, h, hkv, d, length, 7, torch.float16, "cuda")
    dev = torch.device("cuda")
    p, off = torch.tensor([0], device=dev), torch.tensor([0, 3], device=dev)
    scale = d ** -0.5
    attention.decode_attention(q, kc, vc, p, off, scale)  # outside the capture: kernel loaded, counters made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.decode_attention(q, kc, vc, p, off, scale)
    for pos in (5, 31, 32, 33, 200, 259, 64):
        p.fill_(pos)
        graph.replay()
        torch.cuda.synchronize()
        want = exact(q.cpu(), kc.cpu(), vc.cpu(), pos, [0, 3], scale)
        ref = attention.decode_attention_reference(q, kc, vc, p, off, scale).double().cpu()
        err, ref_err = (out.double().cpu() - want).abs().max(), (ref - want).abs().max()
        assert err <= max(2 * ref_err, 2 ** -10 * want.abs().max()), (pos, err, ref_err)


def _rule(bits, group, kp, perm=None, n_side=0):
    from unionsparse.kernels.norm_quant import InputRule

    return InputRule(bits, group, 1.0, kp, perm, n_side)


def test_o_proj_input_fuses_only_where_each_kv_head_holds_whole_groups():
    """The decision both backends take (the reference backend runs the CUDA path's logic on the CPU)."""
    perm = torch.arange(4096, dtype=torch.int32)
    assert attention.quant_fusable(_rule(4, 128, 4096), 32, 32, 128)      # LLaMA-2-7B: a group a head
    assert attention.quant_fusable(_rule(8, 128, 4096), 32, 8, 128)       # Llama-3-8B: four heads, four groups
    assert not attention.quant_fusable(_rule(4, 128, 576), 9, 3, 64)      # SmolLM2: 192 channels a KV head
    assert not attention.quant_fusable(_rule(4, 128, 4096, perm, 128), 32, 32, 128)  # outlier channels
    assert not attention.quant_fusable(_rule(4, 128, 4000), 32, 32, 128)  # codes narrower than the input
    assert not attention.quant_fusable(None, 32, 32, 128)


def test_fused_reference_is_attention_then_the_rule():
    q, kc, vc = _case(3, 4, 2, 128, 40, 3)
    pos, offset = torch.tensor([33]), torch.tensor([0, 4, 30])
    rule = _rule(4, 128, 640)  # codes padded past the 512 inputs
    o, (codes, scales, oq, osx) = attention.decode_attention_quant_reference(q, kc, vc, pos, offset, 0.1, rule)
    assert torch.equal(o, attention.decode_attention_reference(q, kc, vc, pos, offset, 0.1))
    want = rule.reference(o.reshape(3, 512))
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1]) and oq is None and osx is None
    assert codes.shape == (3, 640) and not codes[:, 512:].any() and scales.shape == (3, 4)
    q9, kc9, vc9 = _case(1, 9, 3, 64, 40, 3)
    assert attention.decode_attention_quant_reference(q9, kc9, vc9, pos, offset[:1], 0.1, _rule(4, 128, 576)) is None


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("b, h, hkv, d, bits, kp", [
    (1, 32, 32, 128, 4, 4096),   # LLaMA-2-7B W4A4
    (1, 32, 8, 128, 8, 4096),    # Llama-3-8B W4A8
    (3, 8, 2, 128, 4, 1088),     # a padded batch of 3, codes padded past the 1024 inputs
    (2, 4, 4, 64, 8, 256),       # head dim 64, group 64
])
def test_kernel_writes_o_proj_input_as_act_quant_does(b, h, hkv, d, bits, kp, form):
    """One launch gives the attention output of decode_attention and act_quant.cu's codes and scales of it, bit for
    bit (the same rule on the same float16 outputs)."""
    from unionsparse.kernels.runtime_ops import get

    q, kc, vc = _case(b, h, hkv, d, 300, 7, torch.float16, "cuda")
    pos = torch.tensor([250], device="cuda")
    offset = torch.tensor([0, 17, 200][:b], device="cuda")
    rule = _rule(bits, min(128, d), kp)
    o, (codes, scales, _, _) = attention.decode_attention_quant(q, kc, vc, pos, offset, 0.088, rule)
    plain = attention.decode_attention(q, kc, vc, pos, offset, 0.088)
    want = get("cuda").act_quant(plain.reshape(b, h * d), rule)  # act_quant.cu
    assert torch.equal(o, plain)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    assert codes.abs().max() > 0 and not codes[:, h * d:].any()


# --------------------------------------------------------------- rotary + KV write inside the attention launch


def _raw_case(b, h, hkv, d, length, seed, device="cpu", stacked=True):
    """Raw q [B, 1, H, D], k and v [B, 1, Hkv, D] (row views of one stacked Q/K/V product when ``stacked``), the
    float16 caches, the rotary tables of LLaMA's frequencies."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, 1, (h + 2 * hkv) * d, generator=g) * 2).half().to(device)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, 1, h, d), k.view(b, 1, hkv, d), v.view(b, 1, hkv, d)
    if not stacked:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kc = (torch.randn(b, hkv, length, d, generator=g) * 1.5).half().to(device)
    vc = torch.randn(b, hkv, length, d, generator=g).half().to(device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.arange(length).float()[:, None] * inv[None]
    e = torch.cat((f, f), -1)
    return q, k, v, kc, vc, e.cos().half().to(device), e.sin().half().to(device)


def test_rope_reference_is_rotary_cache_then_attention():
    """The fused form's definition: glue's rotary + KV write of the raw rows, then attention (and the rule)."""
    from unionsparse.kernels.glue import rotary_cache_reference

    q, k, v, kc, vc, cos, sin = _raw_case(3, 4, 2, 128, 40, 0)
    pos, offset = torch.tensor([33]), torch.tensor([0, 4, 30])
    rpos = (pos[None, :] - offset[:, None]).clamp(min=0)
    kc2, vc2 = kc.clone(), vc.clone()
    o, quantized = attention.decode_attention_rope_reference(q, k, v, cos, sin, pos, rpos, kc, vc, offset, 0.1)
    qr = rotary_cache_reference(q, k, v, cos, sin, pos, rpos, kc2, vc2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and quantized is None
    assert not torch.equal(kc[:, :, 33], _raw_case(3, 4, 2, 128, 40, 0)[3][:, :, 33])  # slot 33 was written
    assert torch.equal(o, attention.decode_attention_reference(qr, kc2, vc2, pos, offset, 0.1))
    rule = _rule(4, 128, 512)
    o2, (codes, scales, _, _) = attention.decode_attention_rope_reference(q, k, v, cos, sin, pos, rpos, kc, vc,
                                                                          offset, 0.1, rule)
    want = rule.reference(o.reshape(3, 512))
    assert torch.equal(o2, o) and torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    q48 = torch.zeros(1, 1, 2, 48).half()  # head dim 48: no kernel, the caller runs the two launches
    assert attention.decode_attention_rope_reference(q48, q48, q48, cos, sin, pos, rpos[:1],
                                                     torch.zeros(1, 2, 40, 48).half(), torch.zeros(1, 2, 40, 48).half(),
                                                     offset[:1], 0.1) is None


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("b, h, hkv, d, length, pos, offset, stacked", [
    (1, 32, 32, 128, 600, 530, [0], True),          # LLaMA-2-7B, batch 1, views of the stacked Q/K/V product
    (2, 32, 8, 128, 4200, 4100, [0, 1000], True),   # Llama-3-8B's GQA, a padded row
    (3, 9, 3, 64, 140, 70, [0, 5, 64], False),      # SmolLM2's heads, separate q, k, v
    (1, 6, 2, 96, 100, 64, [0], True),              # three halves a lane
    (2, 16, 2, 256, 300, 299, [0, 31], True),       # eight query heads per KV head, head dim 256
    (1, 4, 4, 64, 64, 0, [0], True),                # the first slot
])
def test_rope_kernel_is_rotary_cache_then_attention_bit_for_bit(b, h, hkv, d, length, pos, offset, stacked, form):
    """One launch equals glue.cu's rotary_cache then attention.cu, bit for bit: the output and both caches."""
    from unionsparse.kernels import glue

    q, k, v, kc, vc, cos, sin = _raw_case(b, h, hkv, d, length, pos, "cuda", stacked)
    p, off = torch.tensor([pos], device="cuda"), torch.tensor(offset, device="cuda")
    rpos = (p[None, :] - off[:, None]).clamp(min=0)
    kc2, vc2 = kc.clone(), vc.clone()
    o, quantized = attention.decode_attention_rope(q, k, v, cos, sin, p, rpos, kc, vc, off, d ** -0.5)
    qr = glue.rotary_cache(q, k, v, cos, sin, p, rpos, kc2, vc2)
    want = attention.decode_attention(qr, kc2, vc2, p, off, d ** -0.5)
    assert quantized is None
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(o, want)


@pytest.mark.gpu
@needs_gpu
def test_rope_kernel_writes_o_proj_input_and_replays_in_a_graph(form):
    """LLaMA-2-7B heads, W4A4 o_proj rule, batch 2: captured once, replayed at moving positions, every replay equal
    to rotary_cache + attention + act_quant.cu on the same inputs (the cache written at each position)."""
    from unionsparse.kernels import glue
    from unionsparse.kernels.runtime_ops import get

    b, h, d, length = 2, 32, 128, 300
    q, k, v, kc, vc, cos, sin = _raw_case(b, h, h, d, length, 11, "cuda")
    p, off = torch.tensor([0], device="cuda"), torch.tensor([0, 3], device="cuda")
    rpos = torch.empty(b, 1, dtype=torch.long, device="cuda")
    rule = _rule(4, 128, h * d)
    attention.decode_attention_rope(q, k, v, cos, sin, p, rpos.copy_((p[None] - off[:, None]).clamp(min=0)), kc, vc,
                                    off, 0.088, rule)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rpos.copy_((p[None] - off[:, None]).clamp(min=0))
        o, (codes, scales, _, _) = attention.decode_attention_rope(q, k, v, cos, sin, p, rpos, kc, vc, off, 0.088,
                                                                   rule)
    kc2, vc2 = kc.clone(), vc.clone()
    for pos in (5, 31, 32, 33, 200, 299):
        p.fill_(pos)
        graph.replay()
        torch.cuda.synchronize()
        qr = glue.rotary_cache(q, k, v, cos, sin, p, (p[None] - off[:, None]).clamp(min=0), kc2, vc2)
        want = attention.decode_attention(qr, kc2, vc2, p, off, 0.088)
        wq = get("cuda").act_quant(want.reshape(b, h * d), rule)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), pos
        assert torch.equal(o, want) and torch.equal(codes, wq[0]) and torch.equal(scales, wq[1]), pos


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_rope_in_attention_gives_the_decode_steps_bit_for_bit(form):
    """A float16 GQA LLaMA (head dim 64) on the GPU glue, batch 3 with left-padded rows: prefill then 6 greedy decode
    steps with ROPE_IN_ATTENTION off and on give the same logits bit for bit (the fused launch is rotary_cache then
    attention exactly), eager and replayed from the CUDA graph."""
    import transformers
    from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval().half().cuda()
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    saved = StaticDecoder.ROPE_IN_ATTENTION
    try:
        for rope in (False, True):
            StaticDecoder.ROPE_IN_ATTENTION = rope
            dec = StaticDecoder(m, 3, 40)
            assert dec.glue == "kernels"
            first = dec.prefill(ids, [9, 4, 7])
            dec.tokens.copy_(first.argmax(-1))
            eager = [dec.step().clone() for _ in range(3)]
            step = GraphedStep(dec, greedy=True)
            runs[rope] = torch.stack([first, *eager, *(step().clone() for _ in range(3))])
    finally:
        StaticDecoder.ROPE_IN_ATTENTION = saved
    assert torch.equal(runs[False], runs[True])


def test_each_model_builds_its_two_kernels(monkeypatch):
    """A model's module holds its head dimension's split kernel and the cluster kernel unrolled to the least bound
    (attention.CL_GM, the list attention.cu's KERNELS_CL builds) that holds its query heads a KV head."""
    import re

    from unionsparse.kernels import loader

    src = (Path(attention.__file__).parent / "attention.cu").read_text()
    built = re.search(r"#define KERNELS_CL\(PER\) (.*)", src).group(1)
    assert tuple(int(g) for g in re.findall(r"KERNEL_CL\(PER, (\d+)\)", built)) == attention.CL_GM
    assert "attention_decode_cl_##PER##_g##GM(" in src

    class Module:
        def __init__(self, options):
            self.options = options

        def get_function(self, name):
            return name, self.options

    monkeypatch.setattr(loader, "load_module", lambda name, expressions=(), options=(): Module(options))
    attention._build_function.cache_clear()
    attention._kernel.cache_clear()
    try:
        for group, gm in ((1, 1), (2, 4), (3, 4), (4, 4), (5, 8), (8, 8)):
            for cluster, name in ((True, f"attention_decode_cl_4_g{gm}"), (False, "attention_decode_4")):
                got, options = attention._function(4, cluster, group)
                assert got == name and "-DATTN_PER=4" in options and f"-DATTN_GM={gm}" in options
    finally:  # no fake module stays cached for a later test
        attention._build_function.cache_clear()
        attention._kernel.cache_clear()
