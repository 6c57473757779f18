"""The static decode step (compressor/runtime/decoder.py) against transformers' own forward, and choosing tokens on
the device (the static generation path on compressed artifacts: tests/test_runtime.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder
from unionsparse.compressor.runtime.sampling import choose, next_token

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
MODELS = {  # name -> (config class, extra config)
    "llama-mha": (transformers.LlamaConfig, {"num_key_value_heads": 4}),
    "llama3-gqa": (transformers.LlamaConfig, {"num_key_value_heads": 2, "rope_scaling": LLAMA3_ROPE,
                                              "rope_theta": 500000.0}),
    "qwen2-bias": (transformers.Qwen2Config, {"num_key_value_heads": 2}),
    "mistral": (transformers.MistralConfig, {"num_key_value_heads": 2, "sliding_window": None}),
}


def _model(name: str) -> torch.nn.Module:
    cls, extra = MODELS[name]
    cfg = cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if name == "qwen2-bias":  # q/k/v biases exist: make them matter
        for layer in m.model.layers:
            assert layer.self_attn.q_proj.bias is not None
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
    return m


@pytest.mark.parametrize("name", sorted(MODELS))
@torch.inference_mode()
def test_static_steps_equal_transformers_forward(name):
    """Prefill and 6 greedy steps at batch 2: the logits of every step equal those of transformers' forward on
    the whole sequence (float32, up to summation order), and the greedy tokens are the same."""
    m = _model(name)
    assert StaticDecoder.unsupported(m) is None
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    dec = StaticDecoder(m, 2, 24)
    logits = dec.prefill(ids)
    seq = ids
    step = GraphedStep(dec, greedy=True)
    for i in range(6):
        ref = m(seq).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, rtol=0, atol=2e-5)
        if i == 0:
            dec.tokens.copy_(logits.argmax(-1))
        assert torch.equal(dec.tokens if i else logits.argmax(-1), ref.argmax(-1))
        seq = torch.cat([seq, dec.tokens[:, None]], 1)
        assert int(dec.position) == seq.shape[1] - 1
        logits = step()  # greedy: the next tokens are already in dec.tokens
    assert int(dec.position) == seq.shape[1]


def _fused_rope_fault(q, k, v, cos, sin, pos, rpos, k_cache, v_cache, *rest):
    """The fused op leaving the KV cache unwritten: later steps attend to stale slots."""
    from unionsparse.kernels import attention

    return attention.decode_attention_rope_reference(q, k, v, cos, sin, pos, rpos, k_cache.clone(),
                                                     v_cache.clone(), *rest)


@pytest.mark.parametrize("rope, fault", [(False, False), (True, False), (True, True)],
                         ids=["rotary launch", "rotary in attention", "planted: cache unwritten"])
@torch.inference_mode()
def test_the_glue_of_the_gpu_path_equals_transformers_forward(rope, fault, monkeypatch):
    """The GPU path's glue (norms, rotary + KV write, decode attention, with ROPE_IN_ATTENTION one fused op) run by
    the kernels' CPU references, batch 2 with a left-padded row, head dim 32 (where attention.cu takes the case):
    every step's logits equal transformers' forward on each row alone; a fused op that does not write the cache
    fails."""
    from unionsparse.kernels import attention, runtime_ops
    from unionsparse.kernels.reference_ops import ReferenceKernels

    monkeypatch.setattr(StaticDecoder, "ROPE_IN_ATTENTION", rope)
    if fault:
        monkeypatch.setattr(ReferenceKernels, "decode_attention_rope", staticmethod(_fused_rope_fault))
    calls = []
    fused = ReferenceKernels.decode_attention_rope
    monkeypatch.setattr(ReferenceKernels, "decode_attention_rope",
                        staticmethod(lambda *a: calls.append(1) or fused(*a)))
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    dec = StaticDecoder(m, 2, 24, kernels=runtime_ops.get("reference"))
    assert dec.glue == "kernels" and attention.rope_fusable(torch.zeros(2, 1, 4, 32), dec.k_cache[0])
    logits, seq, worst = dec.prefill(ids, [5, 3]), ids, 0.0  # row 1 left-padded: rotary positions != slots
    for _ in range(5):
        ref = torch.cat([m(seq[:1]).logits[:, -1], m(seq[1:, 2:]).logits[:, -1]]).float()
        worst = max(worst, float((logits - ref).abs().max()))
        seq = torch.cat([seq, ref.argmax(-1)[:, None]], 1)
        dec.tokens.copy_(seq[:, -1])
        logits = dec.step()
    assert (len(calls) == 5 * 2) if rope else not calls
    assert worst > 1e-2 if fault else worst < 2e-5, worst


@torch.inference_mode()
def test_prefill_resets_and_refuses_what_does_not_fit():
    m = _model("llama-mha")
    dec = StaticDecoder(m, 1, 16)
    ids = torch.tensor([[3, 4, 5]])
    a = dec.prefill(ids)
    dec.tokens.fill_(7)
    dec.step()
    b = dec.prefill(ids)  # a second sequence starts from position 0: the stale cache slots are masked
    assert torch.equal(a, b) and int(dec.position) == 3
    with pytest.raises(UserError, match="do not fit"):
        dec.prefill(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(UserError, match=r"ids must be \[1, T\]"):
        dec.prefill(torch.zeros(2, 3, dtype=torch.long))


def test_unsupported_models_are_named():
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=32))
    assert "architecture 'gpt2'" in StaticDecoder.unsupported(gpt2)
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    mistral = transformers.AutoModelForCausalLM.from_config(cfg)
    assert "sliding attention window of 8" in StaticDecoder.unsupported(mistral, 32)
    assert StaticDecoder.unsupported(mistral, 8) is None
    with pytest.raises(UserError, match="cannot run this model"):
        StaticDecoder(gpt2, 1, 8)


def test_choose_rows_independently_on_the_device():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[1, 7] = logits[1, 9] = 100.0  # a tie: the first index wins
    assert choose(logits, 0.0, 1.0, None).tolist() == [int(logits[0].argmax()), 7, int(logits[2].argmax())]
    # one row of a batch draws as the same row alone (same generator state)
    a = choose(logits[:1], 0.8, 0.9, torch.Generator().manual_seed(5))
    assert int(a[0]) == next_token(logits[0], 0.8, 0.9, torch.Generator().manual_seed(5))
    # top-p keeps only the most likely tokens whose mass reaches p: one dominant token per row
    peaked = torch.full((4, 50), -10.0)
    peaked[torch.arange(4), torch.tensor([3, 11, 29, 41])] = 10.0
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert choose(peaked, 1.0, 0.5, g).tolist() == [3, 11, 29, 41]
    drawn = {tuple(choose(torch.zeros(2, 6), 1.0, 1.0, g).tolist()) for _ in range(60)}
    assert len(drawn) > 10  # uniform rows: many different pairs


def test_warm_up_prepares_the_step_and_changes_no_token():
    """``Runtime.warm_up`` (what ``load`` does on a GPU) allocates the static cache and the step before any
    generation; the generation after it is the same as without it."""
    from unionsparse.compressor.runtime.generate import Runtime

    m = _model("llama-mha")
    cold = Runtime(None, m, None, None, torch.device("cpu"), "cpu", 0.0)
    want = cold.generate([3, 4, 5], max_new_tokens=6, ignore_eos=True).ids
    warm = Runtime(None, m, None, None, torch.device("cpu"), "cpu", 0.0)
    warm.warm_up()
    assert warm._decoder is not None and warm._decoder.max_len == 128  # two 256s, capped at the model's 128
    dec = warm._decoder
    assert warm.generate([3, 4, 5], max_new_tokens=6, ignore_eos=True).ids == want
    assert warm._decoder is dec


@pytest.mark.parametrize("name", ["llama-mha", "llama3-gqa"])
@torch.inference_mode()
def test_left_padded_rows_compute_what_each_computes_alone(name):
    """Prompts of 3, 9 and 6 tokens in one batch (left padding, ``lengths``): every row's prefill logits and 5
    greedy steps equal those of the row run alone, and padding changes nothing (its token ids are irrelevant)."""
    m = _model(name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (3, 9, 6)]
    t = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.full((t - len(p),), 5), p]) for p in prompts])
    dec = StaticDecoder(m, 3, 24)
    rows = [dec.prefill(ids, [len(p) for p in prompts])]
    dec.tokens.copy_(rows[0].argmax(-1))
    step = GraphedStep(dec, greedy=True)
    rows += [step().clone() for _ in range(5)]
    batched = torch.stack(rows, 1)  # [B, 6, V]
    for b, p in enumerate(prompts):
        one = StaticDecoder(m, 1, 24)
        alone = [one.prefill(p[None])]
        one.tokens.copy_(alone[0].argmax(-1))
        s1 = GraphedStep(one, greedy=True)
        alone += [s1().clone() for _ in range(5)]
        torch.testing.assert_close(batched[b], torch.cat(alone), rtol=0, atol=2e-5)
    ids[0, :6] = 50  # other padding ids (rows 0 and 2): the same logits
    ids[2, :3] = 51
    assert torch.allclose(dec.prefill(ids, [len(p) for p in prompts]), rows[0], atol=2e-5)
    with pytest.raises(UserError, match="lengths"):
        dec.prefill(ids, [3, 10, 6])
