"""`unionsparse bench --e2e` on the CPU: the tiny spec end to end through the command line, each linear kind
against the product of its own weights, the static decoder on the stacked peers against transformers' forward,
the byte floor by hand, refusals in one line (the timings themselves need a GPU: benchmarks/e2e_h200.sh)."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from unionsparse.compressor.bench import e2e
from unionsparse.compressor.bench.e2e_models import GROUPS, SPECS, build_model, install_group
from unionsparse.compressor.bench.e2e_peers import (
    DEFAULT_KINDS,
    KINDS,
    W4A16Linear,
    iebme_record,
    record_read_bytes,
    sparse_fp16,
    tcbc_record,
    w4a16_dequantized,
)
from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder
from unionsparse.formats.arithmetic.activations import dequantize_activations, quantize_activations

CPU = torch.device("cpu")


def _main(*args: str) -> tuple[int, str, str]:
    from unionsparse.compressor.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One CPU smoke run of every kind through the command line, JSON out and a results file."""
    out = tmp_path_factory.mktemp("e2e")
    code, stdout, err = _main("bench", "--e2e", "--device", "cpu", "--spec", "tiny", "--batch", "1,2", "--context",
                              "8", "--steps", "2", "--json", "--out", out)
    assert code == 0, err
    return json.loads(stdout), out


def test_cli_tiny_runs_every_kind_end_to_end(tiny_run):
    res, out = tiny_run
    assert res["label"] == e2e.CPU_LABEL and res["machine"]["device"] == "cpu"
    assert res["kinds"] == list(DEFAULT_KINDS)
    assert not res["errors"] and not res["skipped"]
    rows = {(r["kind"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(k, b) for k in DEFAULT_KINDS for b in (1, 2)}
    for r in rows.values():
        assert r["spec"] == "tiny" and r["context"] == 8
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["step_ms"])
        assert set(r["linears_ms"]) == {*GROUPS, "total"}
        assert r["linears_ms"]["total"] == pytest.approx(sum(r["linears_ms"][g] for g in GROUPS))
        assert r["outside_share"] == pytest.approx(1 - r["linears_ms"]["total"] / r["step_ms"])
        assert r["floor_ms"] == pytest.approx(r["bytes"]["total"] / e2e.PEAK_BW * 1e3)
        assert r["speedup_vs_fp16"] == pytest.approx(rows[("fp16", r["batch"])]["step_ms"] / r["step_ms"])
        assert r["speedup_vs_w4a16"] is not None
    assert rows[("iebme-w4a4-50", 1)]["speedup_vs_control"] is not None
    # every kind of a case steps from the same state: one prefill (by the fp16 peers) per batch and context
    for b in (1, 2):
        assert {(rows[(k, b)]["prefill_by"], rows[(k, b)]["prefill_s"]) for k in DEFAULT_KINDS} == {
            ("fp16", rows[("fp16", b)]["prefill_s"])}
    # stored bytes follow the kinds: IE-BME 50% < IE-BME 0% < fp16 linears; W4A16 a quarter of fp16 and a bit
    lin = {k: rows[(k, 1)]["bytes"]["linears_total"] for k in DEFAULT_KINDS}
    assert lin["iebme-w4a4-50"] < lin["iebme-w4a4-0"] < lin["fp16"]
    assert lin["iebme-w4a4-50"] < lin["iebme-w4a4-50-o128"] < lin["iebme-w4a4-0-o128"]  # the side is counted
    assert rows[("iebme-w4a4-50-o128", 1)]["speedup_vs_control"] is not None
    assert lin["fp16"] / 4 < lin["w4a16"] < lin["fp16"] / 3.5
    # Tiled-CBC's thresholds apply to every row of a decode step (calibrated at 30% on the step's own inputs): a
    # batch of 2 leaves unread only the columns inactive in both rows (one launch), so it skips less and reads more
    dyn1 = rows[("tcbc-fp16-30+30", 1)]["dynamic_sparsity_measured"]
    dyn2 = rows[("tcbc-fp16-30+30", 2)]["dynamic_sparsity_measured"]
    assert set(dyn1) == set(dyn2) == set(GROUPS) and all(0.05 < v < 0.7 for v in dyn1.values())
    assert all(v >= 0 for v in dyn2.values()) and sum(dyn2.values()) < sum(dyn1.values())
    assert rows[("tcbc-fp16-30+30", 1)]["bytes"]["linears_total"] < rows[("tcbc-fp16-30+30", 2)]["bytes"][
        "linears_total"]
    assert [h["label"] for h in res["hf_generate"]] == [e2e.HF_LABEL]
    assert res["checks"] and all(c["ok"] for c in res["checks"]), res["checks"]
    assert {t["status"] for t in res["targets"]} == {"not measured"}
    files = sorted(p.name for p in out.iterdir())
    assert files == ["e2e-cpu-" + res["date"][:10] + ".json", "e2e-cpu-" + res["date"][:10] + ".md"]
    assert json.loads((out / files[0]).read_text())["rows"] == res["rows"]


def test_cli_table_is_printed_without_json(tmp_path):
    code, out, err = _main("bench", "--e2e", "--device", "cpu", "--batch", "1", "--context", "4", "--steps", "1",
                           "--kinds", "w4a16")
    assert code == 0, err
    assert "CPU, not a performance figure" in out.splitlines()[0]
    kinds = [line.split()[3] for line in out.splitlines() if line.startswith("tiny ")]
    assert kinds[:2] == ["fp16", "w4a16"]  # fp16 always runs: every ratio needs it
    assert "HF generate" in out
    assert "checks:" in err  # progress on stderr


@pytest.mark.parametrize("args, message", [
    (("--e2e",), "needs a CUDA GPU"),
    (("--e2e", "--device", "cpu", "--spec", "llama2-7b"), "--spec tiny only"),
    (("--e2e", "--device", "cpu", "--spec", "llama9"), "--spec: unknown value 'llama9'"),
    (("--e2e", "--device", "cpu", "--batch", "0"), "--batch: expected comma-separated positive integers"),
    (("--e2e", "--device", "cpu", "--context", "a,b"), "--context: expected comma-separated positive integers"),
    (("--e2e", "--device", "cpu", "--kinds", "fp32"), "--kinds: unknown value 'fp32'"),
    (("--e2e", "--device", "cpu", "--steps", "0"), "--steps must be a positive integer"),
    (("--e2e", "--device", "cpu", "--time-budget", "-1"), "--time-budget must be a positive number"),
    (("--e2e", "--device", "tpu"), "'tpu' is not one of"),
    (("--spec", "tiny"), "--spec applies to bench --e2e only"),
    (("--device", "cpu"), "--device applies to bench --e2e only"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    if args == ("--e2e",) and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    code, out, err = _main("bench", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_time_budget_skips_what_it_cannot_start():
    res = e2e.e2e_command(None, None, "1", "4", "fp16,w4a16", 1, "cpu", time_budget=1e-9, checks=False)
    assert res["rows"] == [] and not res["errors"]
    assert "tiny fp16: time budget spent" in res["skipped"]
    assert any("no fp16 peers" in s for s in res["skipped"])


def test_artifact_refusals(reference_artifact):
    code, _, err = _main("bench", "--e2e", str(reference_artifact), "--device", "cpu", "--spec", "tiny")
    assert code == 2 and "brings its own model" in err
    code, _, err = _main("bench", "--e2e", str(reference_artifact), "--device", "cpu", "--kinds", "iebme-w4a4-50")
    assert code == 2 and "with an ARTIFACT the peers are fp16, w4a16" in err


def test_artifact_runs_beside_its_fp16_and_w4a16_peers(reference_artifact):
    res = e2e.e2e_command(str(reference_artifact), None, "1", "6", None, 1, "cpu", checks=False, hf_generate=False)
    assert res["kinds"] == ["artifact", "fp16", "w4a16"] and not res["errors"]
    rows = {r["kind"]: r for r in res["rows"]}
    assert set(rows) == {"artifact", "fp16", "w4a16"}
    art = rows["artifact"]
    assert art["spec"] == reference_artifact.name and art["label"].startswith("the artifact")
    fusion = res["models"][0]["kinds"]["artifact"]["fusion"]  # Q/K/V and gate/up stacked, as for the peers
    assert len(fusion["fused"]) == 4 and fusion["ops"] == 8 and fusion["layers"] == 14
    # the artifact's linears are its stored IE-BME layers (one module each): fewer bytes than its fp16 peers
    assert art["bytes"]["linears_total"] < rows["fp16"]["bytes"]["linears_total"] / 3
    assert art["speedup_vs_fp16"] is not None and art["speedup_vs_w4a16"] is not None


def test_cli_opens_the_artifact_once(reference_artifact, monkeypatch):
    """`bench --e2e ARTIFACT` checks and opens the artifact once and runs that one (no second open), every file's
    hash checked once."""
    from unionsparse.compressor.artifact.store import Artifact

    opened, checked = [], []
    real_init, real_check = Artifact.__init__, Artifact.check_files

    def init(self, *a, **k):
        opened.append(a[0] if a else k.get("path"))
        real_init(self, *a, **k)

    def check(self, *a, **k):
        checked.append(self.path)
        return real_check(self, *a, **k)

    monkeypatch.setattr(Artifact, "__init__", init)
    monkeypatch.setattr(Artifact, "check_files", check)
    code, out, err = _main("bench", "--e2e", str(reference_artifact), "--device", "cpu", "--batch", "1",
                           "--context", "6", "--steps", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["kinds"] == ["artifact", "fp16", "w4a16"]
    assert [str(p) for p in opened] == [str(reference_artifact)] and len(checked) == 1


# ----------------------------------------------------------------------------------- each peer's arithmetic


def test_w4a16_matches_its_dequantized_weights():
    g = torch.Generator().manual_seed(0)
    m, k = 64, 256
    q = torch.randint(0, 16, (m, k), dtype=torch.int32, generator=g)
    s = torch.rand(2, m, generator=g) * 0.01 + 0.005
    z = (torch.rand(2, m, generator=g) - 0.5) * 0.01
    lin = W4A16Linear(q, s, z)
    w = w4a16_dequantized(lin, q, s, z)
    x = torch.randn(3, 5, k, generator=g).half()
    ref = (x.to(torch.bfloat16).float() @ w.t()).half()
    y = lin(x)
    assert y.dtype == torch.float16 and y.shape == (3, 5, m)
    torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=0.01 * float(ref.abs().max()))
    # the comparison is not vacuous: the midpoint code 8 is zero weight, another code is not
    q2 = q.clone()
    q2[:, :128] = 8
    y2 = W4A16Linear(q2, s, torch.zeros_like(z))(x)
    assert (y2 - y).abs().max() > 0.1 * ref.abs().max()
    # from a weight: round to nearest on 16 levels per group of 128
    wt = torch.randn(m, k, generator=g) * 0.02
    lin = W4A16Linear.from_weight(wt)
    err = (lin(torch.eye(k).half()).float().t() - wt).abs().max()
    assert err < 0.6 * float((wt.amax() - wt.amin()) / 15)


def test_iebme_runtime_linear_matches_quantized_activations_times_decoded_weights():
    from unionsparse.compressor.model.rebuild import layer_weight
    from unionsparse.compressor.runtime.linear import CompressedLinear

    rng = np.random.default_rng(0)
    rec = iebme_record("t", 96, 256, 0.5, rng)
    assert rec.attrs["activations"]["bits"] == 4 and rec.encoding.perm is None
    codes = rec.encoding.decode()
    assert 0.45 < (codes == 0).mean() < 0.55 and np.abs(codes).max() <= 8
    lin = CompressedLinear(rec, None, "cpu")
    assert lin.plan.act_bits == 4 and lin.plan.bits == 4
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).half()
    xq, sx = quantize_activations(x.float().numpy(), 4, 128)
    ref = torch.from_numpy(dequantize_activations(xq, sx, 128)) @ torch.from_numpy(layer_weight(rec)).t()
    torch.testing.assert_close(lin(x).float(), ref.half().float(), rtol=0, atol=2e-3 * float(ref.abs().max()))
    # activation quantization matters: fp16 inputs differ from the W4A4 product by far more than that
    assert (x.float() @ torch.from_numpy(layer_weight(rec)).t() - ref).abs().max() > 1e-2 * ref.abs().max()
    zero = iebme_record("t0", 96, 256, 0.0, rng)
    assert (zero.encoding.decode() == 0).mean() == 0
    assert record_read_bytes(zero) > record_read_bytes(rec)


def test_iebme_outlier_kind_is_the_main_product_plus_the_8bit_side():
    """The kind that keeps quality: 128 outlier channels (at most K // 4) in an 8-bit side matrix; the runtime
    linear equals the main W4A4 product over the permuted, zeroed input plus the side's int8 product."""
    from unionsparse.compressor.runtime.linear import CompressedLinear
    from unionsparse.formats.arithmetic.outlier_side import quantize_inputs_torch

    rng = np.random.default_rng(3)
    rec = iebme_record("t", 96, 256, 0.5, rng, outliers=128)
    side = rec.outliers
    assert side is not None and side.codes.shape == (96, 64)  # min(128, 256 // 4)
    assert rec.attrs["activations"]["outlier_channels"] == side.channels.tolist()
    assert not rec.encoding.decode()[:, 256 - 64:].any()  # the permuted order's outlier columns are zero
    lin = CompressedLinear(rec, None, "cpu")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).half()
    perm = torch.from_numpy(side.perm.astype(np.int64))
    xq, sx, oq, osx = quantize_inputs_torch(x.float(), perm, 64, rec.attrs["activations"])
    main_w = torch.from_numpy(rec.encoding.decode().astype(np.float32))
    main_w = main_w * torch.from_numpy(rec.scales.astype(np.float32)).repeat_interleave(128, 1)[:, :256]
    main = torch.from_numpy(dequantize_activations(xq.numpy(), sx.numpy(), 128)) @ main_w.t()
    side_x = oq.float() * osx.float().repeat_interleave(64, 1)
    ref = main + side_x @ torch.from_numpy(side.dequantize()).t()
    torch.testing.assert_close(lin(x).float(), ref.half().float(), rtol=0, atol=2e-3 * float(ref.abs().max()))
    # without the side product the output is far off: the side matters
    assert (main - ref).abs().max() > 1e-2 * ref.abs().max()
    # sparser and lower-bit kinds read fewer bytes; the side adds its int8 matrix
    sizes = {s: record_read_bytes(iebme_record("s", 96, 256, s, rng)) for s in (0.5, 0.7, 0.9)}
    assert sizes[0.9] < sizes[0.7] < sizes[0.5]
    assert record_read_bytes(iebme_record("w2", 96, 256, 0.5, rng, bits=2)) < sizes[0.5]
    assert record_read_bytes(rec) > record_read_bytes(iebme_record("n", 96, 256, 0.5, rng))



def test_reordered_kind_permutes_rows_and_reads_fewer_union_positions():
    """``-dp``: the exact DP's per-tile row permutations, as ``--reorder dp`` stores them; the product is unchanged
    (the runtime undoes the permutation) and the union positions, hence the bytes, drop."""
    from unionsparse.compressor.runtime.linear import CompressedLinear

    plain = iebme_record("p", 96, 256, 0.5, np.random.default_rng(5), outliers=128)
    dp = iebme_record("d", 96, 256, 0.5, np.random.default_rng(5), outliers=128, reorder=True)
    assert plain.encoding.perm is None and dp.encoding.perm is not None
    assert (dp.encoding.perm != np.arange(16, dtype=np.uint8)).any()  # some tile's rows moved
    np.testing.assert_array_equal(dp.encoding.decode(), plain.encoding.decode())  # same weights
    assert record_read_bytes(dp) < record_read_bytes(plain)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).half()
    torch.testing.assert_close(CompressedLinear(dp, None, "cpu")(x), CompressedLinear(plain, None, "cpu")(x),
                               rtol=0, atol=0)


def test_tcbc_runtime_linear_applies_tau_at_one_row_only():
    from unionsparse.compressor.runtime.linear import CompressedLinear

    rng = np.random.default_rng(0)
    w = sparse_fp16(512, 256, 0.3, rng)
    assert 0.27 < (w == 0).mean() < 0.33
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).half()
    tau = float(np.quantile(np.abs(x.float().numpy()), 0.3))
    lin = CompressedLinear(tcbc_record("t", w, tau), None, "cpu")
    assert lin.plan.tau == pytest.approx(tau) and lin.plan.sparse_inputs
    wt = torch.from_numpy(w.astype(np.float32))
    masked = torch.where(x.float().abs() > tau, x.float(), torch.zeros(()))
    torch.testing.assert_close(lin(x).float(), (masked @ wt.t()).half().float(), rtol=0, atol=1e-3)
    assert (lin(x).float() - (x.float() @ wt.t())).abs().max() > 1e-2  # tau changes the decode step
    x4 = torch.cat([x, x, x, x])
    torch.testing.assert_close(lin(x4).float(), (x4.float() @ wt.t()).half().float(), rtol=0, atol=1e-3)


def test_tcbc_int4_kind_is_the_dequantized_codes_with_tau_and_reads_fewer_bytes():
    """Issue 38's kinds: Tiled-CBC with 4-bit codes and group scales, thresholds at batch 1; its values take half
    a byte, so at 50% static and 30% / 50% dynamic it reads well under the fp16 layer."""
    from unionsparse.compressor.runtime.linear import CompressedLinear
    from unionsparse.formats.arithmetic.weights import dequantize

    rng = np.random.default_rng(4)
    w = sparse_fp16(512, 256, 0.5, rng)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5)).half()
    tau = float(np.quantile(np.abs(x.float().numpy()), 0.5))
    rec = tcbc_record("t4", w, tau, bits=4)
    assert rec.attrs["bits"] == 4 and rec.scales.shape == (512, 2)
    codes = rec.encoding.decode()
    # pruned weights stay zero; about 14% of the kept N(0, 0.02²) weights round to code 0 at 4 bits (|w| < scale / 2)
    assert not codes[w == 0].any() and (codes[w != 0] == 0).mean() < 0.2
    wt = torch.from_numpy(dequantize(codes, rec.scales, 128))
    step = torch.from_numpy(rec.scales.astype(np.float32)).repeat_interleave(128, 1)
    assert ((wt - torch.from_numpy(w.astype(np.float32))).abs() <= 0.5 * step + 1e-4).all()  # round to nearest
    lin = CompressedLinear(rec, None, "cpu")
    masked = torch.where(x.float().abs() > tau, x.float(), torch.zeros(()))
    torch.testing.assert_close(lin(x).float(), (masked @ wt.t()).half().float(), rtol=0, atol=1e-3)
    fp16 = tcbc_record("t16", w, tau)
    assert record_read_bytes(rec, 0.5) < record_read_bytes(rec, 0.3) < 0.5 * record_read_bytes(fp16, 0.3)


def test_the_other_kinds_step_on_the_cpu():
    """The kinds outside the default run (sparser IE-BME, W2A4 with outliers, Tiled-CBC int4 and fp16 at 50%
    static) build and step through the same code; their bytes follow their sparsity and bits."""
    extra = ("iebme-w4a4-70", "iebme-w4a4-90", "iebme-w2a4-50-o128", "iebme-w4a4-50-o128-dp", "tcbc-fp16-50+30",
             "tcbc-int4-50+30", "tcbc-int4-50+50", "iebme-w4a16-50", "iebme-w4a16-50u", "iebme-w4a16-90u")
    assert not set(extra) & set(DEFAULT_KINDS) and set(extra) <= set(KINDS)
    res = e2e.e2e_command(specs="tiny", batches="1", contexts="8", kinds=",".join(extra), steps=1, device="cpu",
                          hf_generate=False, checks=False)
    assert not res["errors"] and not res["skipped"]
    rows = {r["kind"]: r for r in res["rows"]}
    assert set(rows) == {"fp16", *extra} and all(r["step_ms"] > 0 for r in rows.values())
    lin = {k: r["bytes"]["linears_total"] for k, r in rows.items()}
    assert lin["iebme-w4a4-90"] < lin["iebme-w4a4-70"]
    assert lin["tcbc-int4-50+50"] < lin["tcbc-int4-50+30"] < lin["tcbc-fp16-50+30"] / 2
    # union-structured masks: the union holds half the positions, so far fewer bytes than the unstructured 50%
    assert lin["iebme-w4a16-90u"] < lin["iebme-w4a16-50u"] < 0.75 * lin["iebme-w4a16-50"]


def test_check_peers_pass_here_and_fail_one_by_one(monkeypatch):
    checks = e2e.check_peers(CPU)
    assert len(checks) == 8 and all(c["ok"] for c in checks), checks

    def broken(*_a, **_k):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(e2e, "tcbc_record", broken)
    monkeypatch.setattr(W4A16Linear, "forward", lambda self, x: torch.zeros(x.shape[0], self.out_features).half())
    checks = {c["check"]: c for c in e2e.check_peers(CPU)}
    assert not checks["tcbc-fp16-30+30 N=1"]["ok"] and "RuntimeError: no kernel" in checks["tcbc-fp16-30+30 N=1"]["err"]
    assert not checks["w4a16 N=4"]["ok"] and checks["iebme-w4a4-50 N=4"]["ok"] and checks["iebme-w4a16-50 N=1"]["ok"]


# ------------------------------------------------------------------------ the model and the step code


@torch.no_grad()
def test_static_decoder_on_stacked_fp16_peers_gives_transformers_tokens():
    """The tiny spec with Q/K/V and gate/up stacked: the graphed static step's greedy tokens and logits equal
    transformers' forward of the same model on the whole sequence, and each stacked product runs once."""
    spec = SPECS["tiny"]
    model = build_model(spec, CPU, seed=3, linears=False)
    e2e.install_kind(model, spec, "fp16", CPU, seed=3)
    calls = {g: 0 for g in GROUPS}
    for layer in range(spec.layers):
        for g in GROUPS:
            for mod in e2e.group_modules(model, layer, g):
                mod.register_forward_hook(lambda *_a, g=g: calls.__setitem__(g, calls[g] + 1))
    ids = torch.randint(0, spec.vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    dec = StaticDecoder(model, 2, 20)
    logits = dec.prefill(ids)
    dec.tokens.copy_(logits.argmax(-1))
    step = GraphedStep(dec, greedy=True)
    seq = ids
    for _ in range(5):
        ref = model(seq).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, rtol=0, atol=2e-3)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        seq = torch.cat([seq, dec.tokens[:, None]], 1)
        for g in GROUPS:
            calls[g] = 0
        logits = step()
        assert calls == {g: spec.layers for g in GROUPS}  # one product per group and block per step
    # each stacked member is a slice of the product: q, k, v of the one [qkv, K] weight
    shared = model.model.layers[0].self_attn.fused_q_k_v_proj
    h = torch.randn(3, spec.hidden).half()
    w = shared.stacked.weight
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    torch.testing.assert_close(torch.cat([q, k, v], -1), torch.nn.functional.linear(h, w))


def test_install_group_single_and_stacked():
    spec = SPECS["tiny"]
    model = build_model(spec, CPU, linears=False)
    lin = torch.nn.Linear(spec.hidden, spec.hidden, bias=False).half()
    install_group(model, 1, "o", lin, spec.splits()["o"])
    assert model.model.layers[1].self_attn.o_proj is lin
    assert e2e.group_modules(model, 1, "o") == [lin]
    stacked = torch.nn.Linear(spec.hidden, 2 * spec.intermediate, bias=False).half()
    install_group(model, 1, "gateup", stacked, spec.splits()["gateup"])
    assert e2e.group_modules(model, 1, "gateup") == [stacked]
    assert model.model.layers[1].mlp.up_proj.out_features == spec.intermediate
    assert model.model.layers[1].mlp.fused_gate_up_proj.stacked is stacked  # where runtime.load puts a fused op
    # a snapshot puts a kind back exactly, stacked ops included
    from unionsparse.compressor.bench.e2e_models import clear_groups, restore_linears, snapshot_linears

    snap = snapshot_linears(model, spec)
    clear_groups(model, spec)
    assert not hasattr(model.model.layers[1].mlp, "fused_gate_up_proj")
    assert isinstance(model.model.layers[1].self_attn.o_proj, torch.nn.Identity)
    restore_linears(model, spec, snap)
    assert model.model.layers[1].self_attn.o_proj is lin
    assert e2e.group_modules(model, 1, "gateup") == [stacked]


def test_specs_have_the_real_shapes():
    s7, s8 = SPECS["llama2-7b"], SPECS["llama3-8b"]
    assert s7.groups() == {"qkv": (12288, 4096), "o": (4096, 4096), "gateup": (22016, 4096), "down": (4096, 11008)}
    assert s8.groups() == {"qkv": (6144, 4096), "o": (4096, 4096), "gateup": (28672, 4096), "down": (4096, 14336)}
    assert s7.linear_params() == 32 * (12288 + 4096 + 22016) * 4096 + 32 * 4096 * 11008  # 6.48e9
    assert s8.kv_bytes(1, 2048) == 2 * 32 * 2048 * 8 * 128 * 2  # GQA: 8 KV heads
    from unionsparse.compressor.bench.e2e_models import llama_config

    cfg = llama_config(s8)
    params = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert params["rope_type"] == "llama3" and float(params.get("rope_theta", getattr(cfg, "rope_theta", 0))) == 5e5


# -------------------------------------------------------------------------------------------- byte floor


@torch.no_grad()
def test_byte_floor_by_hand():
    """fp16 peers of the tiny spec at batch 2, context 8: every decoder weight, the lm_head, two embedding rows,
    the norms and K and V of 8 positions, in bytes, over 4.16 TB/s."""
    spec = SPECS["tiny"]  # hidden 256, intermediate 512, 2 blocks, 4 heads of 64, 2 KV heads, vocab 512
    model = build_model(spec, CPU, linears=False)
    e2e.install_kind(model, spec, "fp16", CPU)
    dec, start, _ = e2e.prepare_case(model, spec, 2, 8, 1, CPU)
    row = e2e.run_case(model, spec, "fp16", dec, start, 8, 1, 1, CPU)
    weights = 2 * 2 * (512 * 256 + 256 * 256 + 1024 * 256 + 256 * 512)  # blocks x fp16 bytes x (qkv, o, gateup, down)
    head, rows, norms = 512 * 256 * 2, 2 * 256 * 2, (2 * 2 + 1) * 256 * 2
    kv = 2 * 2 * 2 * 8 * 2 * 64 * 2  # K and V x blocks x batch x positions x KV heads x head dim x fp16
    assert row["bytes"]["linears_total"] == weights
    assert (row["bytes"]["lm_head"], row["bytes"]["embedding_rows"], row["bytes"]["norms"]) == (head, rows, norms)
    assert row["bytes"]["kv_cache"] == kv
    assert row["floor_ms"] == pytest.approx((weights + head + rows + norms + kv) / 4.16e12 * 1e3)
    assert row["floor_pct"] == pytest.approx(100 * row["floor_ms"] / row["step_ms"])
    e2e.apply_floor([row], 3.0e12)  # a GPU run measures its own copy bandwidth (an H100: about 3.0 TB/s)
    assert row["floor_ms"] == pytest.approx((weights + head + rows + norms + kv) / 3.0e12 * 1e3)
    assert row["floor_pct"] == pytest.approx(100 * row["floor_ms"] / row["step_ms"])


def test_tcbc_read_bytes_skip_the_values_of_inactive_inputs():
    rec = tcbc_record("t", sparse_fp16(256, 128, 0.3, np.random.default_rng(0)), 0.5)
    arrays = rec.arrays()
    values = arrays["values"].nbytes
    rest = sum(a.nbytes for k, a in arrays.items() if k != "values")
    assert record_read_bytes(rec) == values + rest
    assert record_read_bytes(rec, 0.25) == rest + values - int(values * 0.25)


# ---------------------------------------------------------------------------------- targets and analysis


def _row(kind, step, lin, batch=1, spec="llama2-7b", ctx=512):
    parts = dict(zip(GROUPS, (0.25 * lin,) * 4, strict=True))
    return {"spec": spec, "kind": kind, "batch": batch, "context": ctx, "step_ms": step,
            "linears_ms": {**parts, "total": lin}, "outside_ms": step - lin, "outside_share": 1 - lin / step,
            "bytes": {"linears_total": 1e9}}


def test_targets_and_where_it_loses():
    o = "iebme-w4a4-50-o128"  # the targets' kind: the configuration that keeps quality
    rows = [_row("fp16", 3.6, 3.0), _row("w4a16", 2.1, 1.4), _row(o, 2.0, 1.2),
            _row("iebme-w4a4-0-o128", 2.12, 1.3), _row("tcbc-fp16-30+30", 2.2, 1.6)]
    for b in (4, 8):
        rows += [_row("fp16", 3.7, 3.1, b), _row("w4a16", 4.5, 3.9, b), _row(o, 2.4, 1.8, b)]
    e2e.add_ratios(rows)
    gpu = torch.device("cuda")  # a device object only: nothing runs on it
    t = {x["target"]: x for x in e2e.evaluate_targets(rows, gpu)}
    assert t[f"{o} llama2-7b batch 1 context 512: step >= 1.9x fp16"]["status"] == "missed"  # 1.80x
    assert t[f"{o} llama2-7b batch 1 context 512: step faster than w4a16"]["status"] == "met"
    assert t[f"{o} llama2-7b batch 8 context 512: step faster than w4a16"]["status"] == "met"
    assert t["tcbc-fp16-30+30 llama2-7b batch 1 context 512: step >= 1.5x fp16"]["status"] == "met"
    assert {x["status"] for x in e2e.evaluate_targets(rows, CPU)} == {"not a GPU figure"}
    lines = e2e.explain(rows)
    miss = [x for x in lines if x.startswith(f"{o} llama2-7b B=1") and "fp16" in x]
    assert len(miss) == 1 and "1.80x fp16 (wanted >= 1.9x)" in miss[0]
    assert "the linears must take <= 1.095 ms" in miss[0]  # 3.6 / 1.9 - (2.0 - 1.2)
    assert any("only 1.06x its 0% control" in x for x in lines)
    assert not any(x.startswith("iebme-w4a4-0-o128 ") for x in lines)  # the control is not a contender


# ------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(e2e.gpu_problem() is not None, reason="needs CuPy and a CUDA device")
@torch.no_grad()
def test_gpu_peers_and_graphed_steps():
    """What `bench --e2e` checks before timing, as a test: each kind's CUDA linear against its own weights, and
    for every kind the CUDA-graph replay of a step equals the eager step (the capture runs what eager runs)."""
    gpu = torch.device("cuda")
    checks = e2e.check_peers(gpu) + e2e.check_steps(gpu, tuple(KINDS))
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert 1e12 < e2e.copy_bandwidth(gpu) < 2e13  # bytes/s: read + write of a copy, an HBM device


def test_record_keeps_the_artifacts_speed_for_inspect(reference_artifact, tmp_path, run_cli):
    import shutil

    art = tmp_path / "a.zarr"
    shutil.copytree(reference_artifact, art)
    res = {"machine": {"gpu": "NVIDIA H200"}, "rows": [
        {"kind": "artifact", "batch": 1, "context": 512, "step_ms": 2.0, "tokens_per_s": 500.0,
         "speedup_vs_fp16": 1.8, "speedup_vs_w4a16": 1.1},
        {"kind": "fp16", "batch": 1, "context": 512, "step_ms": 3.6, "tokens_per_s": 277.8}]}
    path = e2e.record_speed(str(art), res)
    assert path.name == "a.zarr.figures.json"
    r = run_cli("inspect", str(art))
    assert r.code == 0
    speed = [line for line in r.out.splitlines() if line.strip().startswith("speed")]
    assert len(speed) == 1 and "bench --e2e, NVIDIA H200, batch 1, context 512" in speed[0]
    assert "'vs_fp16': 1.8" in speed[0] and "'ms_per_step': 2.0" in speed[0]
    with pytest.raises(e2e.UserError, match="not a unionsparse artifact"):
        e2e.record_speed(str(tmp_path), res)
    code, _, err = _main("bench", "--e2e", str(art), "--device", "cpu", "--record")
    assert code == 2 and "not recorded; run on a GPU" in err


def test_launches_outside_the_linears_by_kind():
    """The step's kernels less those its linears launch alone, grouped by kind; a producer that replaced a
    linear's own activation quantization counts as outside (the linears-alone run has the quantization)."""
    from unionsparse.compressor.bench.launches import kind_of, outside_launches

    layer = ["rms_norm_quant", "iebme_spmm_w4", "rotary_cache", "fmha_cutlassF_f16", "Memcpy DtoD",
             "iebme_spmm_w4", "rms_norm_quant", "iebme_spmm_w4", "silu_mul_quant", "iebme_spmm_w4"]
    step = ["indexSelectLargeIndex", *layer, *layer, "rms_norm", "gemv_f16", "argmax_kernel"]
    alone = ["act_quant", "iebme_spmm_w4"] * 8
    got = outside_launches([(n, 1.0 + (n == "rms_norm")) for n in step], [(n, 3.0) for n in alone], layers=2)
    assert got["step"] == len(step) and got["linears"] == 8 and got["outside"] == len(step) - 8
    assert got["outside_per_layer"] == (len(step) - 8) / 2
    assert got["outside_by_kind"] == {"argmax/reduce": 1, "attention": 2, "copy": 2, "elementwise": 1,
                                      "matmul": 1, "norm": 5, "rotary+kv": 2, "silu*mul": 2}
    assert got["outside_us_by_kind"]["norm"] == 6.0 and got["step_kernel_us"] == len(step) + 1.0
    assert got["outside_top"][0] == {"name": "rms_norm_quant", "launches": 4, "us": 4.0}
    assert {"name": "rms_norm", "launches": 1, "us": 2.0} in got["outside_top"]
    assert kind_of("side_product") == "outlier side" and kind_of("void at::native::foo") == "other"


def test_write_table_writes_the_table_and_its_figures(tmp_path):
    """A benchmark script's outputs (benchmarks/attention_bytes.py, compile_times.py): the Markdown as given, the
    figures as JSON, into a folder made for them."""
    out = tmp_path / "new" / "dir"
    e2e.write_table(out, "case", "| a |\n", {"machine": "m", "rows": [{"t_us": 1.5}]})
    assert (out / "case.md").read_text() == "| a |\n"
    assert json.loads((out / "case.json").read_text()) == {"machine": "m", "rows": [{"t_us": 1.5}]}
