"""The decode step's last launch (kernels/lm_head.py): lm_head and the greedy choice. Its reference and the
decoder's use of it everywhere; the CUDA kernel against the float64 product and torch.argmax where CuPy and a GPU
are present."""

from __future__ import annotations

import pytest
import torch
from conftest import second_best_head, tiny_model
from unionsparse.compressor.runtime.cuda import cuda_problem
from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder
from unionsparse.kernels import lm_head

needs_gpu = pytest.mark.skipif(cuda_problem() is not None, reason=f"needs CuPy and a CUDA device ({cuda_problem()})")


def test_reference_is_the_linear_then_the_first_argmax():
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(50, 64)
    w[31] = w[7] = w[7] + 10 * x[1]  # row 1: its two largest logits equal; argmax takes the first
    tokens = torch.full((3,), -1, dtype=torch.long)
    logits = lm_head.lm_head_greedy_reference(x, w, tokens)
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.nn.functional.linear(x, w))
    assert torch.equal(tokens, logits.argmax(-1)) and int(tokens[1]) == 7
    assert torch.equal(lm_head.lm_head_greedy_reference(x, w, None), logits)


def test_shape_rule():
    w = torch.zeros(100, 4096)
    assert all(lm_head.shape_supported(torch.zeros(b, 4096), w) for b in range(1, 9))
    assert not lm_head.shape_supported(torch.zeros(9, 4096), w)  # the mma's 8 batch columns
    assert not lm_head.shape_supported(torch.zeros(1, 12), torch.zeros(100, 12))  # 16-byte pieces of a row
    assert not lm_head.shape_supported(torch.zeros(8, 16384), torch.zeros(100, 16384))  # x past shared memory
    assert not lm_head.shape_supported(torch.zeros(2, 64), torch.zeros(100, 32))
    assert lm_head.grid_blocks(32000, 132) == 250 and lm_head.grid_blocks(128256, 132) == 264


@pytest.mark.parametrize("fault", [False, True], ids=["head", "planted: second-best token"])
@torch.inference_mode()
def test_the_step_chooses_in_the_head_launch(fault, monkeypatch):
    """With the glue kernels (their CPU references) a greedy step's tokens come from the lm_head op, which gets the
    decoder's token buffer; they are transformers' greedy tokens, and a head choosing wrongly fails."""
    from unionsparse.kernels import runtime_ops
    from unionsparse.kernels.reference_ops import ReferenceKernels

    monkeypatch.setattr(StaticDecoder, "HEAD_KERNEL", True)
    calls = []
    head = second_best_head if fault else ReferenceKernels.lm_head_greedy
    monkeypatch.setattr(ReferenceKernels, "lm_head_greedy",
                        staticmethod(lambda x, w, tokens: calls.append(tokens is not None) or head(x, w, tokens)))
    m = tiny_model("llama", hidden=64, vocab=97)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    dec = StaticDecoder(m, 2, 24, kernels=runtime_ops.get("reference"))
    logits = dec.prefill(ids)
    dec.tokens.copy_(logits.argmax(-1))
    seq, step, same = torch.cat([ids, dec.tokens[:, None]], 1), GraphedStep(dec, greedy=True), True
    for _ in range(4):
        logits = step()
        ref = m(seq).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, rtol=0, atol=2e-5)
        same &= torch.equal(dec.tokens, ref.argmax(-1))
        seq = torch.cat([seq, ref.argmax(-1)[:, None]], 1)
        dec.tokens.copy_(seq[:, -1])
    assert calls == [False] + [True] * 4  # the prefill's head (no choice), then every greedy step's
    assert same != fault


# ------------------------------------------------------------------------------------------------------------- GPU


def _check(x: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor | None) -> None:
    """Logits within float32 summation of the float64 product rounded to float16; tokens torch.argmax of them."""
    exact = x.double() @ w.double().T
    ulp = torch.finfo(torch.float16).eps * exact.abs().clamp(min=2 ** -14)
    scale = x.double().abs() @ w.double().abs().T
    err = (logits.double() - exact).abs() - (ulp + 2 ** -20 * scale)
    assert float(err.max()) <= 0, float(err.max())
    if tokens is not None:
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("v, k", [(32000, 4096), (49152, 576), (1000, 584), (97, 64)])
def test_kernel_equals_the_float64_product_and_argmax(v, k):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(v + k)
    w = (torch.randn(v, k, device=dev, generator=g) / k ** 0.5).half()
    for b in (1, 2, 5, 8):
        x = torch.randn(b, k, device=dev, generator=g).half()
        tokens = torch.full((b,), -1, dtype=torch.long, device=dev)
        logits = lm_head.lm_head_greedy(x, w, tokens)
        _check(x, w, logits, tokens)
        assert torch.equal(lm_head.lm_head_greedy(x, w, None), logits)  # no choice: the same logits
    xs = torch.randn(3, k + 40, device=dev, generator=g).half()[:, :k]  # rows of a wider buffer
    tokens = torch.empty(3, dtype=torch.long, device=dev)
    _check(xs, w, lm_head.lm_head_greedy(xs, w, tokens), tokens)


@pytest.mark.gpu
@needs_gpu
def test_kernel_takes_the_first_of_equal_logits_and_nan_first():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    v, k = 5000, 256
    w = (torch.randn(v, k, device=dev, generator=g) / 16).half()
    x = torch.randn(4, k, device=dev, generator=g).half()
    for row, (a, c) in enumerate([(3, 4999), (17, 2500), (1700, 1701)]):  # equal rows, the largest logit of x[row]
        w[a] = w[c] = (x[row].float() / x[row].float().norm() * 4).half()
    x[3, 5] = float("nan")  # every logit of row 3 NaN: torch.argmax gives 0
    tokens = torch.empty(4, dtype=torch.long, device=dev)
    logits = lm_head.lm_head_greedy(x, w, tokens)
    assert tokens.tolist() == [3, 17, 1700, 0]
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.gpu
@needs_gpu
def test_kernel_replays_in_a_graph():
    """The ticket is reset by the launch itself: replays of one captured launch choose each new input's tokens."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(32000, 4096, device=dev, generator=g) / 64).half()
    x = torch.randn(2, 4096, device=dev, generator=g).half()
    tokens = torch.empty(2, dtype=torch.long, device=dev)
    lm_head.lm_head_greedy(x, w, tokens)  # compile and make the workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = lm_head.lm_head_greedy(x, w, tokens)
    for _ in range(3):
        x.copy_(torch.randn(2, 4096, device=dev, generator=g).half())
        graph.replay()
        torch.cuda.synchronize()
        _check(x, w, logits, tokens)


@pytest.mark.gpu
@needs_gpu
@torch.inference_mode()
def test_gpu_greedy_steps_are_transformers_greedy_tokens(monkeypatch):
    monkeypatch.setattr(StaticDecoder, "HEAD_KERNEL", True)
    dev = torch.device("cuda")
    m = tiny_model("llama", hidden=128, vocab=1000).half().to(dev)
    ids = torch.randint(0, 1000, (3, 6), generator=torch.Generator().manual_seed(2)).to(dev)
    dec = StaticDecoder(m, 3, 32)
    assert dec.glue == "kernels"
    dec.tokens.copy_(dec.prefill(ids).argmax(-1))
    seq, step = torch.cat([ids, dec.tokens[:, None]], 1), GraphedStep(dec, greedy=True)
    for _ in range(5):
        logits = step()
        assert torch.equal(dec.tokens, logits.argmax(-1))
        ref = m(seq).logits[:, -1].float()
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 1e-2
        assert torch.equal(dec.tokens[sure], ref.argmax(-1)[sure])
        seq = torch.cat([seq, dec.tokens[:, None]], 1)
