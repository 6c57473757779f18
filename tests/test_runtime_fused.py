"""Fused linears at run time (compressor/runtime/fused.py): Q/K/V and gate/up stacked at load from their separate
encodings. Along a greedy path the fused model's logits equal the separate layers' bit for bit on the CPU backend and
on the kernels' numba references (which read the stacked bytes as a GPU kernel would); the model runs fewer ops and
fewer op calls; groups whose stored options differ are not fused, with the reason recorded; SharedInputLinear
recomputes whenever it cannot reuse the product."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime import PROMPT, artifacts, loaded, source  # noqa: F401  (module fixtures, reused)
from torch import nn
from unionsparse.compressor import runtime
from unionsparse.compressor.artifact.store import Artifact, write_manifest
from unionsparse.compressor.runtime.fused import (
    SharedInputLinear,
    mismatch,
    shared_input_groups,
    stack_records,
)
from unionsparse.compressor.runtime.model import build_model
from unionsparse.formats import registry
from unionsparse.formats.stacking import stack_rows

N_NEW = 10
SEPARATE_OPS = 14  # 2 blocks x 7 linears
FUSED_OPS = 8      # 2 blocks x (q/k/v, o, gate/up, down)
LAYER_RULES = [  # block 0: k_proj at other bits; block 1: v_proj and up_proj kept dense
    "--layer-overrides", json.dumps([{"match": r"model\.layers\.0\.self_attn\.k_proj", "quant": "w2a4"}]),
    "--ignore", r"model\.layers\.1\.self_attn\.v_proj", "--ignore", r"model\.layers\.1\.mlp\.up_proj"]


@pytest.fixture(scope="module")
def more_artifacts(artifacts, source, tmp_path_factory):  # noqa: F811
    """Artifacts beyond test_runtime's cases: ``clip-apart`` (the W4A4-with-outliers artifact with block 0's k_proj
    given another activation clip), ``rules`` (W4A16 with LAYER_RULES),
    ``qwen2`` (W4A16, random q/k/v biases)."""
    from unionsparse.compressor.cli import main

    made: dict[str, Path] = {}
    out_dir = tmp_path_factory.mktemp("fused_art")

    def compress(model: Path, out: Path, *flags: str) -> None:
        with pytest.raises(SystemExit) as e:
            main(["compress", str(model), "-o", str(out), "--quiet", *flags])
        assert e.value.code == 0

    def get(name: str) -> Path:
        if name not in made:
            out = out_dir / f"{name}.zarr"
            w4a16 = ["--prune", "magnitude", "--quant", "w4a16", "--reorder", "none"]
            if name == "clip-apart":  # the W4A4 artifact with one member's activation clip changed
                import zarr

                shutil.copytree(artifacts("w4a4-outliers"), out)
                root = zarr.open_group(str(out), mode="r+")
                k = "model.layers.0.self_attn.k_proj"
                act = root["layers"][k].attrs["activations"]
                root["layers"][k].attrs["activations"] = {**act, "clip": 0.5 if act["clip"] != 0.5 else 0.55}
                write_manifest(out)
            elif name == "rules":
                compress(source / "model", out, *w4a16, *LAYER_RULES)
            elif name == "qwen2":
                from conftest import tiny_model

                model = tiny_model("qwen2")
                with torch.no_grad():
                    for block in model.model.layers:
                        for p in ("q_proj", "k_proj", "v_proj"):
                            getattr(block.self_attn, p).bias.normal_(0.0, 0.5)
                model.save_pretrained(out_dir / "qwen2-model")
                compress(out_dir / "qwen2-model", out, *w4a16)
            made[name] = out
        return made[name]

    return get


def _path(name: str, artifacts, more_artifacts) -> Path:  # noqa: F811
    if name == "shared-clip":  # compress gives each set of layers reading one input one activation clip
        return artifacts("w4a4-outliers")
    return more_artifacts(name) if name in ("clip-apart", "rules", "qwen2") else artifacts(name)


def _runtime(path: Path, backend: str, fuse: bool, dynamic_pruning: bool = True) -> runtime.Runtime:
    model = build_model(Artifact(path), backend, fuse=fuse, dynamic_pruning=dynamic_pruning)
    return runtime.Runtime(path, model, None, None, torch.device("cpu"), backend, 0.0)


def _ops(model: nn.Module) -> list[runtime.CompressedLinear]:
    return [m for m in model.modules() if isinstance(m, runtime.CompressedLinear)]


def _compare(path: Path, backend: str, dynamic_pruning: bool = True) -> tuple[runtime.Runtime, runtime.Runtime]:
    """Separate and fused runtimes of ``path``: logits along the separate model's greedy path equal bit for bit,
    and so do the greedy tokens."""
    sep, fused = (_runtime(path, backend, f, dynamic_pruning) for f in (False, True))
    ids = sep.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).ids
    a, b = sep.step_logits(PROMPT, ids), fused.step_logits(PROMPT, ids)
    assert a.shape == (1 + N_NEW, 256) and torch.isfinite(a).all()
    assert torch.equal(a, b), float((a - b).abs().max())
    assert fused.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).ids == ids
    return sep, fused


# ------------------------------------------------------------------------------- logits, ops, calls


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", ["w4a16", "shared-clip", "cbc-dp", "cbc4-dp"])
def test_fused_logits_equal_the_separate_layers_bit_for_bit(case, backend, artifacts, more_artifacts):  # noqa: F811
    sep, fused = _compare(_path(case, artifacts, more_artifacts), backend)
    assert len(_ops(sep.model)) == SEPARATE_OPS and len(_ops(fused.model)) == FUSED_OPS
    rec = fused.model.unionsparse_fusion
    assert rec["enabled"] and rec["ops"] == FUSED_OPS and rec["layers"] == SEPARATE_OPS and rec["separate"] == []
    assert [len(f["layers"]) for f in rec["fused"]] == [3, 2, 3, 2]
    assert sep.model.unionsparse_fusion == {"enabled": False, "layers": SEPARATE_OPS, "ops": SEPARATE_OPS,
                                            "fused": [], "separate": []}
    shared = [m for m in fused.model.modules() if isinstance(m, SharedInputLinear)]
    assert len(shared) == 4 and all(m.stacked.backend == backend for m in shared)
    tile_rows = Artifact(sep.path).layer_attrs("model.layers.0.self_attn.q_proj")["tile"][0]
    for block in range(2):
        attn, orig = fused.model.model.layers[block].self_attn, sep.model.model.layers[block].self_attn
        for i, p in enumerate(("q_proj", "k_proj", "v_proj")):  # drop-ins with the original sizes
            member, alone = getattr(attn, p), getattr(orig, p)
            assert (member.in_features, member.out_features) == (alone.in_features, alone.out_features)
            assert member.shared is attn.fused_q_k_v_proj and member.index == i
        offs = attn.fused_q_k_v_proj.offsets  # each member starts on a whole tile of rows
        assert offs[0] == 0 and all(o % tile_rows == 0 for o in offs) and offs == rec["fused"][2 * block][
            "row_offsets"]


def test_thresholds_off_fuse_too(artifacts):  # noqa: F811
    """``dynamic_pruning=False`` (thresholds ignored): still fused, still bit for bit the separate layers."""
    _, fused = _compare(artifacts("cbc-dp"), "cpu", dynamic_pruning=False)
    assert len(_ops(fused.model)) == FUSED_OPS and all(op.plan.tau is None for op in _ops(fused.model))


def test_fewer_op_calls_per_forward(artifacts):  # noqa: F811
    sep, fused = _runtime(artifacts("w4a16"), "cpu", False), _runtime(artifacts("w4a16"), "cpu", True)
    calls = {"sep": 0, "fused": 0}
    for key, rt in (("sep", sep), ("fused", fused)):
        for op in _ops(rt.model):
            op.register_forward_hook(lambda *_a, k=key: calls.__setitem__(k, calls[k] + 1))
    ids = [9, 10, 11]
    sep.step_logits(PROMPT, ids)
    fused.step_logits(PROMPT, ids)
    forwards = 1 + len(ids)
    assert calls == {"sep": SEPARATE_OPS * forwards, "fused": FUSED_OPS * forwards}
    # transformers' forward hands q/k/v_proj one hidden_states object and gate/up_proj one x: one product each
    assert [m.computations for m in fused.model.modules() if isinstance(m, SharedInputLinear)] == [forwards] * 4


@pytest.mark.parametrize("case, offsets", [("shared-clip", [0, 128, 192]), ("cbc4-dp", [0, 256, 512])])
def test_stacked_record_holds_the_members_rows(case, offsets, artifacts, more_artifacts):  # noqa: F811
    """Encoding, scales and the outlier side stacked at the same row offsets; rows between members hold zero
    codes and scale 1 (Tiled-CBC pads q_proj's 128 and k_proj's 64 rows to GTiles of 256)."""
    art = Artifact(_path(case, artifacts, more_artifacts))
    group = shared_input_groups(art.layer_names)[0]
    recs = [art.read_layer(n) for n in group.members]
    rec = stack_records(recs)
    assert not isinstance(rec, str), rec
    enc, offs = stack_rows([r.encoding for r in recs])
    assert rec.name == group.fused_name and offs == rec.attrs["fused"]["row_offsets"] == offsets
    fmt = registry.of(enc)
    assert fmt.geometry_attrs(rec.encoding) == fmt.geometry_attrs(enc)
    assert all(np.array_equal(a, b) for a, b in zip(fmt.to_arrays(rec.encoding).values(), fmt.to_arrays(enc).values(),
                                                    strict=True))
    dec = rec.encoding.decode()
    rows = np.zeros(dec.shape[0], bool)
    for o, r in zip(offsets, recs, strict=True):
        m = r.encoding.shape[0]
        rows[o : o + m] = True
        assert np.array_equal(dec[o : o + m], r.encoding.decode())
        assert np.array_equal(rec.scales[o : o + m], r.scales)
        if r.outliers is not None:
            assert np.array_equal(rec.outliers.codes[o : o + m], r.outliers.codes)
            assert np.array_equal(rec.outliers.scales[o : o + m], r.outliers.scales)
            assert np.array_equal(rec.outliers.channels, r.outliers.channels)
    assert rec.scales.shape == (offsets[-1] + recs[-1].encoding.shape[0], recs[0].scales.shape[1])
    assert not dec[~rows].any() and (rec.scales[~rows] == 1).all() and (~rows).sum() == sum(
        o2 - o - r.encoding.shape[0] for o, o2, r in zip(offsets, offsets[1:], recs, strict=False))
    assert (rec.outliers is not None) == (case == "shared-clip")
    assert rec.attrs.get("activations") == recs[0].attrs.get("activations") and rec.attrs["bits"] == 4


# ---------------------------------------------------------------------------------- refusals


def test_groups_whose_options_differ_are_not_fused(artifacts, more_artifacts):  # noqa: F811
    """LAYER_RULES: block 0's k_proj at 2 bits stays separate (q_proj and v_proj fused); block 1 fuses q/k_proj
    (v_proj kept dense) and leaves gate_proj alone (up_proj kept dense). Logits still bit for bit."""
    sep, fused = _compare(more_artifacts("rules"), "cpu")
    rec = fused.model.unionsparse_fusion
    fused_sets = {tuple(n.rpartition(".")[2] for n in f["layers"]): f["name"].split(".")[2] for f in rec["fused"]}
    assert fused_sets == {("q_proj", "v_proj"): "0", ("gate_proj", "up_proj"): "0", ("q_proj", "k_proj"): "1"}
    why = {s["layer"]: s for s in rec["separate"]}
    assert set(why) == {"model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
                        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"}
    assert "bits 2" in why["model.layers.0.self_attn.k_proj"]["reason"] and why["model.layers.0.self_attn.k_proj"][
        "stored"]
    assert not why["model.layers.1.self_attn.v_proj"]["stored"] and "kept dense" in why[
        "model.layers.1.self_attn.v_proj"]["reason"]
    assert "only stored layer" in why["model.layers.1.mlp.gate_proj"]["reason"]
    assert all("\n" not in s["reason"] for s in rec["separate"])
    assert len(_ops(sep.model)) == 12 and len(_ops(fused.model)) == rec["ops"] == 9
    assert isinstance(fused.model.model.layers[0].self_attn.k_proj, runtime.CompressedLinear)


def test_compress_gives_each_shared_input_one_clip_so_w4a4_fuses_fully(artifacts):  # noqa: F811
    """Compress calibrates one activation clip per set of layers reading one input (their stacked output's
    error): every Q/K/V and gate/up set of the W4A4 artifact stores one clip and the runtime fuses them all."""
    path = artifacts("w4a4-outliers")
    art = Artifact(path)
    for g in shared_input_groups(art.layer_names):
        assert len({art.layer_attrs(n)["activations"]["clip"] for n in g.members}) == 1, g.members
    _, fused = _compare(path, "cpu")
    rec = fused.model.unionsparse_fusion
    assert rec["separate"] == [] and rec["ops"] == FUSED_OPS


def test_a_clip_difference_keeps_a_group_apart(artifacts, more_artifacts):  # noqa: F811
    """Stored activation records that differ (here the clip of block 0's k_proj) cannot share one quantized input:
    q_proj and v_proj fuse, k_proj runs alone, and the reason names the clip."""
    _, fused = _compare(more_artifacts("clip-apart"), "cpu")
    rec = fused.model.unionsparse_fusion
    assert [s["layer"] for s in rec["separate"]] == ["model.layers.0.self_attn.k_proj"]
    assert "clip" in rec["separate"][0]["reason"]
    assert rec["ops"] == FUSED_OPS + 1


def test_qwen2_biases_stay_with_their_members(more_artifacts):
    sep, fused = _compare(more_artifacts("qwen2"), "cpu")
    attn = fused.model.model.layers[0].self_attn
    orig = sep.model.model.layers[0].self_attn
    for p in ("q_proj", "k_proj", "v_proj"):
        member, alone = getattr(attn, p), getattr(orig, p)
        assert member.bias is not None and torch.equal(member.bias, alone.bias) and alone.bias.abs().sum() > 0
    assert attn.fused_q_k_v_proj.stacked.bias is None and len(_ops(fused.model)) == FUSED_OPS


def test_stack_records_says_why_not(artifacts):  # noqa: F811
    cbc, w4a4 = Artifact(artifacts("cbc-dp")), Artifact(artifacts("w4a4-outliers"))
    q, o, down = (cbc.read_layer(f"model.layers.0.{n}") for n in ("self_attn.q_proj", "self_attn.o_proj",
                                                                   "mlp.down_proj"))
    assert "threshold" in stack_records([q, o]) and "input features 256" in stack_records([q, down])
    assert mismatch(q, o, ignore_thresholds=True) is None and not isinstance(
        stack_records([q, o], ignore_thresholds=True), str)
    wq, wo = (w4a4.read_layer(f"model.layers.0.self_attn.{n}") for n in ("q_proj", "o_proj"))
    assert "outlier channels" in stack_records([wq, wo])
    assert "format" in stack_records([q, wq]) and stack_records([]) == "no layers to stack"


def test_groups_by_module_path():
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.gate_proj",
              "mlp.down_proj")]
    groups = shared_input_groups(names)
    assert [(g.parent, [n.rpartition(".")[2] for n in g.members], [n.rpartition(".")[2] for n in g.missing])
            for g in groups] == [
        ("model.layers.0.self_attn", ["q_proj", "k_proj"], ["v_proj"]),
        ("model.layers.0.mlp", ["gate_proj", "up_proj"], []),
        ("model.layers.1.self_attn", ["q_proj", "k_proj"], ["v_proj"]),
        ("model.layers.1.mlp", ["gate_proj", "up_proj"], [])]
    assert shared_input_groups(["model.decoder.layers.0.fc1", "x.self_attn.out_proj"]) == []


# --------------------------------------------------------------------------------- SharedInputLinear


class _Counting(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x @ self.weight.T


def test_shared_input_linear_reuses_only_what_it_may():
    torch.manual_seed(0)
    w = torch.randn(40, 8)
    op = _Counting(w)
    bias = torch.randn(8)
    shared = SharedInputLinear(op, ["a", "b", "c"], [0, 16, 32], [12, 16, 8], [None, None, bias])
    a, b, c = shared.members()
    assert [m.out_features for m in (a, b, c)] == [12, 16, 8] and all(m.in_features == 8 for m in (a, b, c))

    def want(x, i):
        y = x @ w.T
        return [y[..., 0:12], y[..., 16:32], y[..., 32:40] + bias][i]

    def check(calls, *seq):
        before = op.calls
        for member, x in seq:
            got = member(x)
            assert torch.equal(got, want(x, member.index)), member.index
        assert op.calls - before == calls, seq

    def fresh():
        return torch.randn(2, 3, 8)

    x = fresh()
    check(1, (a, x), (b, x), (c, x))               # one input, every member once: one product
    x = fresh()
    check(1, (c, x), (a, x), (b, x))               # in any order
    x = fresh()
    check(2, (a, x), (a, x), (b, x), (c, x))       # a member twice: recomputed
    x, x2 = fresh(), fresh()
    check(2, (a, x), (b, x2), (c, x2))             # a new input: recomputed
    x = fresh()
    check(3, (a, x), (b, x.clone()), (c, x))       # equal values, another object: recomputed (and again for c)
    x = fresh()
    check(2, (a, x), (b, x), (a, x), (c, x))       # a served member asked again: recomputed
    y = fresh()
    check(1, (a, y))
    y.add_(1.0)                                    # changed in place between calls: recomputed
    check(1, (b, y), (c, y))
    with torch.inference_mode():                   # no version counter there: identity alone
        xi = torch.randn(1, 8)
        check(1, (a, xi), (b, xi), (c, xi))
        xi = torch.randn(1, 8)
        check(2, (b, xi), (b, xi), (a, xi), (c, xi))
    x = fresh()
    check(1, (a, x), (b, x), (c, x))
    assert shared._input is None and shared._output is None  # released once every member was served
    check(3, (a, x), (b, x), (c, x), (a, x), (b, x), (c, x), (c, x))  # the same input again: a new product
    assert torch.equal(shared(x), x @ w.T) and shared.computations == op.calls - 1
    with pytest.raises(ValueError, match="exceed"):
        SharedInputLinear(op, ["a"], [36], [8])


def test_load_fuses_on_request_and_generates_the_same_tokens(artifacts):  # noqa: F811
    """``runtime.load(fuse=True)`` (the default on cuda): fewer ops for the same stored linears, the same tokens."""
    path = artifacts("w4a4-outliers")
    plain, fused = runtime.load(path), runtime.load(path, fuse=True)
    assert plain.n_ops == plain.n_compressed == SEPARATE_OPS
    assert fused.n_compressed == SEPARATE_OPS and fused.n_ops == FUSED_OPS
    g = fused.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True)
    assert g.stats["decoder"] == "static"
    assert g.ids == plain.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).ids


@pytest.mark.parametrize("fuse", [True, False])
def test_quantizing_producers_hand_over_exactly_the_codes_the_linear_makes(artifacts, fuse):  # noqa: F811
    """With quantizing producers (on by default with the GPU glue; here their torch references), the RMSNorms
    before Q/K/V and gate/up and the SiLU·mul before down_proj hand their linear its quantized input: the logits
    are bit for bit the same, and each forward of each block takes three hand-overs (the stacked Q/K/V op or
    q_proj alone, the stacked gate/up op or gate_proj alone, down_proj)."""
    rt = runtime.load(artifacts("w4a4-outliers"), fuse=fuse)
    ids = rt.generate(PROMPT, max_new_tokens=N_NEW, ignore_eos=True).ids
    plain = rt.step_logits(PROMPT, ids)
    ops = [m.op for m in rt.model.modules() if isinstance(m, runtime.CompressedLinear)]
    assert not rt._decoder.prequant and sum(op.offers_used for op in ops) == 0
    rt._decoder.prequant = True
    handed = rt.step_logits(PROMPT, ids)
    assert torch.equal(handed, plain)
    forwards = 1 + len(ids)
    assert sum(op.offers_used for op in ops) == forwards * 2 * 3  # 2 blocks, 3 hand-overs each


def test_fused_batched_generation_with_quantizing_producers(artifacts):  # noqa: F811
    """Everything the GPU path combines, on the CPU: fused Q/K/V and gate/up, quantizing producers (their torch
    references), three prompts of different lengths in one batch; each row's tokens equal its plain generation."""
    path = artifacts("w4a4-outliers")
    plain = runtime.load(path)
    rt = runtime.load(path, fuse=True)
    prompts = [PROMPT, [9, 4], PROMPT[:3] + [200, 17]]
    rt.generate_batch(prompts, max_new_tokens=2, ignore_eos=True)  # builds the batch-3 decoder
    dec = rt._batched[3][0]
    dec.prequant = True
    ops = [m.op for m in rt.model.modules() if isinstance(m, runtime.CompressedLinear)]
    before = sum(op.offers_used for op in ops)
    batch = rt.generate_batch(prompts, max_new_tokens=N_NEW, ignore_eos=True)
    assert sum(op.offers_used for op in ops) - before == N_NEW * 2 * 3  # prefill + N_NEW - 1 steps, 2 blocks
    for p, g in zip(prompts, batch, strict=True):
        assert g.ids == plain.generate(p, max_new_tokens=N_NEW, ignore_eos=True).ids
