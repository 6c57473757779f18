"""Data safety (issue 27): compress deletes nothing it did not create, writes nothing verify rejects, and
refuses bad output paths, foreign partials, absurd lengths and environment problems before the work, each
with exactly one line on stderr (exit 2) and nothing left behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

FAST = ("--quiet", "--reorder", "none")
CLI = Path(sys.executable).parent / "unionsparse"


def one_line(r) -> str:
    assert "Traceback" not in r.out + r.err, r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one line on stderr, got: {r.err!r}"
    return lines[0]


def refused(r, *needles: str) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    line = one_line(r)
    assert "internal error" not in line, line
    for n in needles:
        assert n in line, (n, line)
    return line


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or ``root`` itself) with its bytes."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(out: Path) -> list[Path]:
    return [p for p in (out, out.with_name(out.name + ".partial")) if p.exists() or p.is_symlink()]


def edited_model(src: Path, dst: Path, key: str, value: float, index=(0, 0)) -> Path:
    """A copy of the model folder with one value of one tensor replaced."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    t = sd[key].clone()
    t[index if t.ndim == 2 else index[0]] = value
    sd[key] = t
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def mark_incomplete(store: Path) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def art(tmp_path_factory, model_dirs) -> Path:
    """A finished artifact of the tiny LLaMA (FAST flags, defaults otherwise)."""
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("safety_art") / "llama.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), *FAST])
    assert e.value.code == 0
    return out


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail loudly (exit 3) if compress reaches the model load: the checks must come before any work."""
    from unionsparse.compressor.pipeline import compress as pipeline

    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(pipeline, "open_model", boom)


# ------------------------------------------------------------------------------ --overwrite and -o


@pytest.mark.parametrize("kind", ["plain", "foreign_zarr", "artifact_plus_user_file"])
def test_overwrite_keeps_a_folder_that_is_not_an_artifact(kind, tmp_path, model_dirs, art, run_cli, no_model_load):
    out = tmp_path / "mine.zarr"
    if kind == "artifact_plus_user_file":
        shutil.copytree(art, out)
    else:
        out.mkdir()
        (out / "sub").mkdir()
        (out / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
        if kind == "foreign_zarr":
            (out / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    (out / "notes.txt").write_text("my thesis")
    before = snapshot(out)
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, "--overwrite")
    refused(r, str(out), "--overwrite")
    assert snapshot(out) == before
    assert not out.with_name("mine.zarr.partial").exists()


def test_overwrite_refuses_a_regular_file_and_a_path_under_a_file(tmp_path, model_dirs, run_cli, no_model_load):
    f = tmp_path / "file.zarr"
    f.write_text("not an artifact")
    refused(run_cli("compress", model_dirs["llama"], "-o", f, *FAST), "already exists")
    refused(run_cli("compress", model_dirs["llama"], "-o", f, *FAST, "--overwrite"), "is a file")
    assert f.read_text() == "not an artifact"
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    refused(run_cli("compress", model_dirs["llama"], "-o", plain / "x.zarr", *FAST), "not a folder")
    assert plain.read_text() == "x"


@pytest.mark.parametrize("where", ["model_folder", "folder_holding_model", "inside_model"])
def test_never_touches_the_input_model(where, tmp_path, model_dirs, run_cli, no_model_load):
    if where == "model_folder":
        model = tmp_path / "model.zarr"
        shutil.copytree(model_dirs["llama"], model)
        out, flags = model, ("--overwrite",)
    elif where == "folder_holding_model":
        model = tmp_path / "models.zarr" / "llama"
        shutil.copytree(model_dirs["llama"], model)
        out, flags = model.parent, ("--overwrite",)
    else:
        model = tmp_path / "llama"
        shutil.copytree(model_dirs["llama"], model)
        out, flags = model / "out.zarr", ()
    before = snapshot(model)
    refused(run_cli("compress", model, "-o", out, *FAST, *flags), "input model")
    assert snapshot(model) == before
    assert not (model / "out.zarr").exists()


def test_overwrite_replaces_an_artifact(tmp_path, model_dirs, art, run_cli):
    out = tmp_path / "again.zarr"
    shutil.copytree(art, out)
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, "--sparsity", "0.6", "--overwrite")
    assert r.code == 0, r.err
    from unionsparse.compressor.artifact.store import Artifact

    assert Artifact(out).attrs["config"]["sparsity"] == 0.6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.zarr"]  # no backup or partial left


def test_a_folder_created_at_o_during_the_run_is_kept(tmp_path, model_dirs, run_cli, monkeypatch):
    from unionsparse.compressor.artifact.store import ArtifactWriter

    out = tmp_path / "race.zarr"
    real = ArtifactWriter.write_dense

    def user_moves_in(self, tensors):
        out.mkdir(exist_ok=True)
        (out / "photo.jpg").write_bytes(b"jpeg")
        return real(self, tensors)

    monkeypatch.setattr(ArtifactWriter, "write_dense", user_moves_in)
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST)
    refused(r, str(out))
    assert (out / "photo.jpg").read_bytes() == b"jpeg"
    assert not out.with_name("race.zarr.partial").exists()


# ---------------------------------------------------------------------------------------- partials


@pytest.mark.parametrize("resume", [False, True])
def test_partial_of_another_configuration_is_refused_and_kept(resume, tmp_path, model_dirs, art, run_cli):
    out = tmp_path / "p.zarr"
    partial = tmp_path / "p.zarr.partial"
    shutil.copytree(art, partial)  # written with --sparsity 0.5
    mark_incomplete(partial)
    before = snapshot(partial)
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, "--sparsity", "0.7", *(["--resume"] * resume))
    refused(r, "different configuration", "sparsity")
    assert snapshot(partial) == before and not out.exists()


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("kind", ["user_folder", "file"])
def test_partial_that_is_not_ours_is_refused_and_kept(kind, resume, tmp_path, model_dirs, run_cli, no_model_load):
    out = tmp_path / "q.zarr"
    partial = tmp_path / "q.zarr.partial"
    if kind == "file":
        partial.write_text("keep me")
    else:
        partial.mkdir()
        (partial / "keep.txt").write_text("keep me")
    before = snapshot(partial)
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, *(["--resume"] * resume))
    refused(r, str(partial))
    assert snapshot(partial) == before and not out.exists()


def test_resume_refuses_a_partial_of_other_weights(tmp_path, model_dirs, run_cli):
    model = tmp_path / "m"
    shutil.copytree(model_dirs["llama"], model)
    full = tmp_path / "full.zarr"
    assert run_cli("compress", model, "-o", full, *FAST).code == 0
    partial = tmp_path / "r.zarr.partial"
    shutil.copytree(full, partial)
    mark_incomplete(partial)
    shutil.rmtree(model)
    edited_model(model_dirs["llama"], model, "model.layers.0.mlp.up_proj.weight", 0.25)  # same path, new weights
    before = snapshot(partial)
    r = run_cli("compress", model, "-o", tmp_path / "r.zarr", *FAST, "--resume")
    refused(r, "different source model")
    assert snapshot(partial) == before


# ------------------------------------------------------------------------ nothing verify would reject


@pytest.mark.parametrize("key,value", [("model.embed_tokens.weight", float("nan")),
                                       ("model.norm.weight", float("inf")),
                                       ("lm_head.weight", float("-inf"))])
def test_non_finite_kept_tensor_is_refused(key, value, tmp_path, model_dirs, run_cli):
    model = edited_model(model_dirs["llama"], tmp_path / "bad", key, value)
    out = tmp_path / "nan.zarr"
    refused(run_cli("compress", model, "-o", out, *FAST), key, "NaN or inf")
    assert leftovers(out) == []


@pytest.mark.parametrize("quant", ["w4a4", "w4a16"])
def test_weight_whose_scales_overflow_fp16_is_refused(quant, tmp_path, model_dirs, run_cli):
    key = "model.layers.1.self_attn.q_proj.weight"
    model = edited_model(model_dirs["llama"], tmp_path / "huge", key, 1e30)
    out = tmp_path / "huge.zarr"
    refused(run_cli("compress", model, "-o", out, *FAST, "--quant", quant), "model.layers.1.self_attn.q_proj",
            "float16")
    assert leftovers(out) == []


# ---------------------------------------------------------------------------- lengths and calibration


@pytest.mark.parametrize("seqlen", ["512", "1000000000"])
def test_seqlen_beyond_the_context_is_refused_before_work(seqlen, tmp_path, llama_with_tokenizer, run_cli,
                                                           no_model_load):
    model, calib = llama_with_tokenizer  # max_position_embeddings 256
    out = tmp_path / "s.zarr"
    r = run_cli("compress", model, "-o", out, *FAST, "--prune", "wanda", "--calib", calib, "--nsamples", "2",
                "--seqlen", seqlen)
    refused(r, "--seqlen")
    assert leftovers(out) == []


@pytest.mark.parametrize("flag, named", [("--calib", "--calib"), ("--act-sparsity-calib", "--act-sparsity-calib"),
                                         ("--dp-calib", "--act-sparsity-calib")])  # the old name is an alias
def test_missing_calibration_file_is_refused_even_when_unused(flag, named, tmp_path, model_dirs, run_cli,
                                                              no_model_load):
    out = tmp_path / "c.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, "--prune", "magnitude", flag,
                tmp_path / "nope.jsonl")
    refused(r, named, "nope.jsonl")
    assert leftovers(out) == []


def test_calibration_error_is_the_only_line(tmp_path, model_dirs, llama_with_tokenizer, run_cli):
    _, calib = llama_with_tokenizer
    out = tmp_path / "t.zarr"  # the model has no tokenizer: no "calibration: ... tokens" note before the error
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--reorder", "none", "--prune", "wanda",
                "--calib", calib, "--nsamples", "2", "--seqlen", "64")
    refused(r, "tokenizer")
    assert leftovers(out) == []


@pytest.mark.parametrize("args,needle", [(("--seqlen", "100000"), "--seqlen"),
                                         (("--seqlen", "1"), "--seqlen"),
                                         (("--max-windows", "0"), "--max-windows")])
def test_eval_checks_its_arguments_before_rebuilding(args, needle, tmp_path, art, run_cli, monkeypatch):
    from unionsparse.compressor.evaluate import perplexity as evaluate

    def boom(*_a, **_k):
        raise AssertionError("the model was rebuilt before the arguments were checked")

    monkeypatch.setattr(evaluate, "load_for_eval", boom)
    text = tmp_path / "eval.txt"
    text.write_text("some words to evaluate\n" * 50)
    refused(run_cli("eval", art, "--text", text, *args), needle)


# --------------------------------------------------------------------------------- the environment


def test_read_only_output_folder_is_refused_before_work(tmp_path, model_dirs, run_cli, monkeypatch, no_model_load):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes anyway: simulate the permission check
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real(p, mode, **kw))
    else:
        ro.chmod(0o555)
    try:
        refused(run_cli("compress", model_dirs["llama"], "-o", ro / "x.zarr", *FAST), "not writable")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_full_disk_is_refused_before_work(tmp_path, model_dirs, run_cli, monkeypatch):
    from unionsparse.compressor import preflight as safety

    monkeypatch.setattr(safety, "free_bytes", lambda _folder: 4096)
    out = tmp_path / "full.zarr"
    refused(run_cli("compress", model_dirs["llama"], "-o", out, *FAST), "free", "needs about")
    assert leftovers(out) == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_disk_full_while_writing_is_bad_input_and_removes_the_partial(err, tmp_path, model_dirs, run_cli,
                                                                      monkeypatch):
    from unionsparse.compressor.artifact.store import ArtifactWriter

    def full(self, tensors):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(ArtifactWriter, "write_dense", full)
    out = tmp_path / "enospc.zarr"
    refused(run_cli("compress", model_dirs["llama"], "-o", out, *FAST), os.strerror(err))
    assert leftovers(out) == []


@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_fails_at_once_in_one_line(offline, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="https://unionsparse-test.invalid")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    t0 = time.perf_counter()
    p = subprocess.run([str(CLI), "compress", "someorg/somemodel", "-o", str(tmp_path / "h.zarr"), "--quiet"],
                       env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "someorg/somemodel" in lines[0]
    assert took < 15, f"took {took:.1f} s"


# ------------------------------------------------------------------------------- newcomer friction


def test_model_path_is_stored_absolute(tmp_path, model_dirs, run_cli, monkeypatch):
    monkeypatch.chdir(model_dirs["llama"].parent)
    out = tmp_path / "abs.zarr"
    assert run_cli("compress", model_dirs["llama"].name, "-o", out, *FAST).code == 0
    from unionsparse.compressor.artifact.store import Artifact

    attrs = Artifact(out).attrs
    assert attrs["source"]["model"] == str(model_dirs["llama"].resolve())
    assert attrs["config"]["model"] == str(model_dirs["llama"].resolve())


def test_help_lists_choices_and_bad_choice_is_one_line(run_cli, tmp_path, model_dirs):
    r = run_cli("compress", "--help")
    for choices in ("[wanda|sparsegpt|magnitude|none]", "[w4a4|w2a4|w4a8|w2a8|w4a16|none]", "[ie-bme|tiled-cbc]",
                    "[auto|dp|cpsat|none]", "[cpu|cuda]"):
        assert choices in r.out, choices
    refused(run_cli("compress", model_dirs["llama"], "-o", tmp_path / "x.zarr", "--prune", "bogus"), "--prune")


def test_log_level_after_the_command_and_no_none_totals(tmp_path, model_dirs, run_cli):
    from unionsparse.compressor.progress import configure_logging

    try:
        r = run_cli("compress", model_dirs["llama"], "-o", tmp_path / "l.zarr", *FAST, "--log-level", "info")
    finally:
        configure_logging("warning")
    assert r.code == 0, r.err
    assert "INFO" in r.err and "/None" not in r.err


def test_achieved_sparsity_is_explained(tmp_path, model_dirs, run_cli):
    r = run_cli("compress", model_dirs["llama"], "-o", tmp_path / "w2.zarr", *FAST, "--quant", "w2a4",
                "--sparsity", "0.5")
    assert r.code == 0, r.err
    assert "requested 50.0%" in r.out and "round to zero" in r.out


def test_packaging_friction():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # SPDX string: no setuptools deprecation banner
    assert ".venv/bin/unionsparse" in (root / "README.md").read_text()
    assert "## Guarantees" in (root / "docs" / "cli.md").read_text()


def test_remove_tree_deletes_only_unionsparse_stores(tmp_path, art):
    from unionsparse.compressor.artifact import ownership as safety
    from unionsparse.compressor.errors import UserError

    user = tmp_path / "user.zarr"
    user.mkdir()
    (user / "a.txt").write_text("a")
    with pytest.raises(UserError):
        safety.remove_tree(user)
    assert not safety.remove_artifact(user) and (user / "a.txt").exists()
    link = tmp_path / "link.zarr"
    link.symlink_to(art)
    with pytest.raises(UserError):
        safety.remove_tree(link)
    assert not safety.remove_artifact(link) and art.exists()
    mine = tmp_path / "mine.zarr"
    shutil.copytree(art, mine)
    assert safety.remove_artifact(mine) and not mine.exists()
