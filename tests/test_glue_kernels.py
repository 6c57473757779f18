"""The decode step's glue (kernels/glue.py): its torch references against transformers' LLaMA modules everywhere,
the CUDA kernels against the references and the decoder with kernels against the decoder with torch glue where
CuPy and a GPU are present."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as hf
from unionsparse.compressor.runtime.cuda import cuda_problem
from unionsparse.kernels import glue

needs_gpu = pytest.mark.skipif(cuda_problem() is not None, reason=f"needs CuPy and a CUDA device ({cuda_problem()})")


def _tables(length: int, d: int, dtype=torch.float32, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    f = torch.arange(length, device=device).float()[:, None] * inv[None]
    e = torch.cat((f, f), -1)
    return e.cos().to(dtype), e.sin().to(dtype)


def test_references_are_what_transformers_llama_modules_compute():
    torch.manual_seed(0)
    norm = hf.LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 64)
    assert torch.equal(glue.rms_norm_reference(x, norm.weight, norm.variance_epsilon), norm(x))
    g, u = torch.randn(4, 96), torch.randn(4, 96)
    assert torch.equal(glue.silu_mul_reference(g, u), transformers.activations.ACT2FN["silu"](g) * u)
    b, t, h, hkv, d, length = 2, 3, 4, 2, 16, 10
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, hkv, d), torch.randn(b, t, hkv, d)
    cos, sin = _tables(length, d)
    pos = torch.tensor([4, 5, 6])
    rpos = torch.tensor([[4, 5, 6], [1, 2, 3]])  # row 1: three slots of left padding
    kc, vc = torch.zeros(b, hkv, length, d), torch.zeros(b, hkv, length, d)
    out = glue.rotary_cache_reference(q, k, v, cos, sin, pos, rpos, kc, vc)
    for row in range(b):
        c, s = cos[rpos[row]][None], sin[rpos[row]][None]
        want_q, want_k = hf.apply_rotary_pos_emb(q[row:row + 1].transpose(1, 2), k[row:row + 1].transpose(1, 2), c, s)
        assert torch.equal(out[row:row + 1], want_q) and torch.equal(kc[row:row + 1, :, 4:7], want_k)
    assert torch.equal(vc[:, :, 4:7], v.transpose(1, 2)) and not kc[:, :, :4].any() and not vc[:, :, 7:].any()


@pytest.mark.gpu
@needs_gpu
def test_kernels_equal_their_references():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(7, 576, device=dev, generator=g) * 3).half()
    w = torch.randn(576, device=dev, generator=g).half()
    got, want = glue.rms_norm(x, w, 1e-5), glue.rms_norm_reference(x, w, 1e-5)
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp(min=6e-5)
    assert float(ulp.max()) <= 2 ** -10 * 1.01  # the sum's order only: at most one float16 step
    delta = (torch.randn(7, 576 + 8, device=dev, generator=g) * 2).half()[:, :576]  # a row view, as a fused op gives
    (xs, got), (xs_ref, want) = glue.add_rms_norm(x, delta, w, 1e-5), glue.add_rms_norm_reference(x, delta, w, 1e-5)
    assert torch.equal(xs, xs_ref)  # the residual add is one float16 add, exactly
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp(min=6e-5)
    assert float(ulp.max()) <= 2 ** -10 * 1.01
    stacked = (torch.randn(5, 2 * 1536 + 64, device=dev, generator=g) * 4).half()  # gate | up | padding rows
    gate, up = stacked[:, :1536], stacked[:, 1536 + 64:]
    assert torch.equal(glue.silu_mul(gate, up), glue.silu_mul_reference(gate, up))
    b, t, h, hkv, d, length = 2, 3, 9, 3, 64, 40
    qkv = torch.randn(b, t, (h + 2 * hkv) * d + 32, device=dev, generator=g).half()  # one stacked product
    q = qkv[..., : h * d].view(b, t, h, d)
    k = qkv[..., h * d:(h + hkv) * d].view(b, t, hkv, d)
    v = qkv[..., (h + hkv) * d:(h + 2 * hkv) * d].view(b, t, hkv, d)
    cos, sin = _tables(length, d, torch.float16, dev)
    pos = torch.tensor([17, 18, 19], device=dev)
    rpos = torch.tensor([[17, 18, 19], [0, 1, 2]], device=dev)
    kc, vc = torch.zeros(b, hkv, length, d, device=dev).half(), torch.zeros(b, hkv, length, d, device=dev).half()
    kr, vr = kc.clone(), vc.clone()
    out = glue.rotary_cache(q, k, v, cos, sin, pos, rpos, kc, vc)
    assert torch.equal(out, glue.rotary_cache_reference(q, k, v, cos, sin, pos, rpos, kr, vr))
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.gpu
@needs_gpu
def test_decoder_with_glue_kernels_agrees_with_torch_glue():
    from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).half().cuda().eval()
    ids = torch.randint(0, 97, (1, 11))
    rows = {}
    with torch.inference_mode():
        for mode in ("kernels", "torch"):
            dec = StaticDecoder(model, 1, 32)
            dec.glue = mode
            logits = [dec.prefill(ids)]
            dec.tokens.copy_(logits[0].argmax(-1))
            step = GraphedStep(dec, greedy=True)
            logits += [step().clone() for _ in range(8)]
            rows[mode] = torch.stack(logits)
    torch.testing.assert_close(rows["kernels"], rows["torch"], rtol=0, atol=2e-2)
    assert torch.equal(rows["kernels"].argmax(-1), rows["torch"].argmax(-1))


def _rule(k: int, n_side: int, dev, bits: int = 4):
    from unionsparse.kernels.norm_quant import InputRule

    if not n_side:
        return InputRule(bits, 128, 0.9, -(-k // 64) * 64)
    g = torch.Generator().manual_seed(k)
    chans = torch.randperm(k, generator=g)[:n_side].sort().values
    rest = torch.tensor([c for c in range(k) if c not in set(chans.tolist())])
    perm = torch.cat([rest, chans]).to(torch.int32).to(dev)
    return InputRule(bits, 128, 0.95, -(-k // 64) * 64, perm, n_side, 8, 8, 1.0)


def test_producer_references_are_the_glue_then_the_linears_rule():
    from unionsparse.kernels.norm_quant import (
        add_rms_norm_quant_reference,
        rms_norm_quant_reference,
        silu_mul_quant_reference,
    )

    x, w = torch.randn(3, 200), torch.randn(200)
    for n_side in (0, 16):
        rule = _rule(200, n_side, "cpu")
        y, q = rms_norm_quant_reference(x, w, 1e-5, rule)
        assert torch.equal(y, glue.rms_norm_reference(x, w, 1e-5))
        for a, b in zip(q, rule.reference(y), strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        assert q[0].shape == (3, 256) and not q[0][:, 200:].any()
        d = torch.randn(3, 200)
        xs, y2, q2 = add_rms_norm_quant_reference(x, d, w, 1e-5, rule)
        assert torch.equal(xs, x + d) and torch.equal(y2, glue.rms_norm_reference(x + d, w, 1e-5))
        assert torch.equal(q2[0], rule.reference(y2)[0])
        g, u = torch.randn(3, 200), torch.randn(3, 200)
        y, q = silu_mul_quant_reference(g, u, rule)
        assert torch.equal(y, glue.silu_mul_reference(g, u)) and torch.equal(q[0], rule.reference(y)[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k, n_side", [(576, 0), (1536, 0), (4096, 128), (200, 16)])
def test_quantizing_producer_kernels_equal_their_references(k, n_side):
    """The float16 output as the glue kernels give it, and the quantized input exactly the linear's rule applied to
    that output (codes, scales, side input)."""
    from unionsparse.kernels import norm_quant

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(k)
    rule = _rule(k, n_side, dev)
    x = (torch.randn(5, k, device=dev, generator=g) * 2).half()
    w = torch.randn(k, device=dev, generator=g).half()
    y, q = norm_quant.rms_norm_quant(x, w, 1e-5, rule)
    assert torch.equal(y, glue.rms_norm(x, w, 1e-5))
    for a, b in zip(q, rule.reference(y), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    delta = (torch.randn(5, k, device=dev, generator=g) * 2).half()
    xs, y, q = norm_quant.add_rms_norm_quant(x, delta, w, 1e-5, rule)
    assert torch.equal(xs, x + delta) and torch.equal(y, glue.add_rms_norm(x, delta, w, 1e-5)[1])
    for a, b in zip(q, rule.reference(y), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    gu = (torch.randn(5, 2 * k + 64, device=dev, generator=g) * 3).half()
    gate, up = gu[:, :k], gu[:, k + 64:]
    y, q = norm_quant.silu_mul_quant(gate, up, rule)
    assert torch.equal(y, glue.silu_mul(gate, up))
    for a, b in zip(q, rule.reference(y), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n, gs, rows, fast", [(8, 8, 5, False), (200, 64, 5, False), (128, 128, 5, True),
                                               (128, 128, 19, True), (144, 144, 3, True), (160, 64, 9, True),
                                               (256, 64, 1, True)])
def test_outlier_side_kernel_equals_grouped_int_matmul(n, gs, rows, fast):
    """The side product in one launch against the runtime's torch path, bit for bit, in both kernels (the
    coalesced one: one group or several, a last partial group, more token rows than a block takes)."""
    from unionsparse.formats.arithmetic.grouped import grouped_int_matmul
    from unionsparse.kernels.outlier_side import coalesced, side_product

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + rows)
    m, groups = 1000, -(-n // gs)
    y = (torch.randn(rows, m + 24, device=dev, generator=g) * 4).half()[:, :m]  # a row view, as a fused op gives
    xq = torch.randint(-128, 128, (rows, n), device=dev, generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (m, n), device=dev, generator=g, dtype=torch.int8)
    sx = torch.rand(rows, groups, device=dev, generator=g) * 0.01
    sw = torch.rand(m, groups, device=dev, generator=g) * 0.01
    want = grouped_int_matmul(xq, sx, wq.float(), sw, gs, out=y.float()).half()
    assert coalesced(n, gs, wq) == fast
    assert torch.equal(side_product(y, xq, sx, wq, sw, gs), want)


@pytest.mark.gpu
@needs_gpu
def test_profiler_sees_the_glue_kernels_launches():
    """bench --e2e counts launches with the profiler: CuPy's launches must appear in it by name."""
    from unionsparse.compressor.bench.launches import kernel_names, kind_of

    dev = torch.device("cuda")
    x, w = torch.randn(3, 576, device=dev).half(), torch.randn(576, device=dev).half()
    glue.rms_norm(x, w, 1e-5)  # the module loads outside the profiled call
    names = kernel_names(lambda: glue.add_rms_norm(x, x, w, 1e-5), dev)
    assert [kind_of(n) for n, _ in names if kind_of(n) != "copy"] == ["norm"], names
