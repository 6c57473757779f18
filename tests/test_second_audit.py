"""The second hostile audit (issue 40): nothing lost, nothing used that verify rejects.

Overwrite never deletes a user's file inside an artifact; generate, export, eval and bench refuse an artifact whose
files differ from its manifest (``--no-verify`` says it skips that); two writers to one output: one wins, the other
is one line and exit 2; full or read-only file systems are one line and leave nothing half-written; identical
inputs give identical manifests; compressed-tensors exports pack layers whose K the group size does not divide."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REFERENCE_FLAGS, tiny_model

FAST = ("--quiet", "--reorder", "none")
CLI = Path(sys.executable).parent / "unionsparse"
Q, O = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def refused(r, *needles: str) -> str:
    """Exit 2, exactly one line on stderr holding every needle, no traceback."""
    assert r.code == 2, (r.code, r.out, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.out + r.err, r.err
    assert "internal error" not in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def art(tmp_path_factory, llama_with_tokenizer) -> Path:
    """A W4A4 IE-BME artifact of the tiny LLaMA with its tokenizer stored (generate and eval need one)."""
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("audit2") / "a.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(llama_with_tokenizer[0]), "-o", str(out), *FAST])
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("audit2_text") / "eval.txt"
    p.write_text("the model weights of the sparse kernel\n" * 40)
    return p


# ------------------------------------------------------------------ 1. overwrite and files inside an artifact


@pytest.mark.parametrize("where,named", [("layers/notes.txt", None), (f"layers/{Q}/notes.txt", None),
                                         ("dense/mine/data.bin", "dense/mine"),  # a folder that is no zarr node
                                         (f"layers/{Q}/values/c/notes.txt", None),
                                         (f"layers/{Q}/values/c/9", None)])  # named like a chunk: not in the manifest
def test_overwrite_keeps_a_user_file_inside_the_artifact(where, named, art, tmp_path, llama_with_tokenizer,
                                                          run_cli):
    out = tmp_path / "mine.zarr"
    shutil.copytree(art, out)
    (out / where).parent.mkdir(parents=True, exist_ok=True)
    (out / where).write_text("my thesis")
    before = snapshot(out)
    r = run_cli("compress", llama_with_tokenizer[0], "-o", out, *FAST, "--overwrite")
    refused(r, str(out), named or where)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.zarr"]


def test_a_node_a_killed_run_had_just_created_is_the_stores_own(art, tmp_path):
    """A run killed between creating a layer's folder and writing its zarr.json leaves an empty folder (or one
    holding only zarr's temporary file): still the store's own, so --resume can tell the configuration apart
    (tests/test_resume_kill.py met this at random kill points); a folder with a user's file stays foreign."""
    from unionsparse.compressor.artifact.ownership import foreign_entries

    d = tmp_path / "a.zarr.partial"
    shutil.copytree(art, d)
    (d / "unionsparse_manifest.json").unlink()  # a partial store has no manifest yet
    (d / "layers" / "model.layers.9.mlp.down_proj").mkdir()
    (d / "layers" / "model.layers.9.mlp.up_proj").mkdir()
    (d / "layers" / "model.layers.9.mlp.up_proj" / f"zarr.{'0' * 32}.partial").write_text("{}")
    assert foreign_entries(d) == []
    (d / "layers" / "model.layers.9.mlp.down_proj" / "notes.txt").write_text("my thesis")
    assert foreign_entries(d) == ["layers/model.layers.9.mlp.down_proj"]


# ------------------------------------------------------------- 2. nothing used that verify rejects


def swapped_scales(art: Path, tmp: Path) -> Path:
    """Two layers' scale chunks of the same size swapped: every file keeps its size, two change content."""
    d = tmp / "swapped.zarr"
    shutil.copytree(art, d)
    a, b = (d / "layers" / n / "scales" / "c" / "0" / "0" for n in (Q, O))
    ra, rb = a.read_bytes(), b.read_bytes()
    assert len(ra) == len(rb) and ra != rb
    a.write_bytes(rb)
    b.write_bytes(ra)
    return d


def no_manifest(art: Path, tmp: Path) -> Path:
    d = tmp / "nomanifest.zarr"
    shutil.copytree(art, d)
    (d / "unionsparse_manifest.json").unlink()
    return d


def reading_commands(store: Path, tmp: Path, text: Path) -> dict[str, list]:
    return {"generate": ["generate", store, "--prompt", "the sparse", "--max-new-tokens", "2", "--quiet"],
            "export": ["export", store, "-o", tmp / "exported"],
            "eval": ["eval", store, "--text", text, "--seqlen", "64", "--max-windows", "1"],
            "bench": ["bench", "--e2e", store, "--device", "cpu"]}


@pytest.mark.parametrize("make,needle", [(swapped_scales, "scales/c/0/0 differs from the artifact's manifest"),
                                         (no_manifest, "unionsparse_manifest.json is missing")])
@pytest.mark.parametrize("command", ["generate", "export", "eval", "bench"])
def test_reading_commands_refuse_what_verify_rejects(command, make, needle, art, tmp_path, text, run_cli):
    store = make(art, tmp_path)
    assert run_cli("verify", store, "--n", "1", "--quiet").code == 1  # verify rejects it
    r = run_cli(*reading_commands(store, tmp_path, text)[command])
    refused(r, needle, "verify")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["generate", "export", "eval"])
def test_no_verify_uses_it_and_says_so(command, art, tmp_path, text, run_cli):
    store = swapped_scales(art, tmp_path)
    r = run_cli(*reading_commands(store, tmp_path, text)[command], "--no-verify")
    assert r.code == 0, r.err
    assert f"note: --no-verify: {store} is used without checking" in r.err


# ------------------------------------------------------------------------- 3. two writers to one output


def test_two_compress_runs_to_one_output(tmp_path, model_dirs, run_cli):
    out = tmp_path / "race.zarr"
    cmd = [str(CLI), "compress", str(model_dirs["llama"]), "-o", str(out), *FAST]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    (loser,) = [err for code, _, err in results if code == 2]
    lines = [ln for ln in loser.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in loser, loser
    assert "being written by another unionsparse run" in lines[0] or "already exists" in lines[0], lines[0]
    assert run_cli("verify", out, "--n", "1", "--quiet").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race.zarr"]  # no partial, no lock left


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"unionsparse-lock pid %d host elsewhere\\n" % os.getpid())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_live_writers_lock_is_respected_and_kept(tmp_path, model_dirs, run_cli):
    out = tmp_path / "held.zarr"
    lock = tmp_path / "held.zarr.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST)
        refused(r, "being written by another unionsparse run", f"pid {p.pid} on elsewhere")
        assert lock.read_text() == f"unionsparse-lock pid {p.pid} host elsewhere\n"  # never deleted
        assert not out.exists() and not (tmp_path / "held.zarr.partial").exists()
    finally:
        p.kill()
        p.wait()


def test_a_killed_writers_lock_is_taken_over(tmp_path, model_dirs, run_cli):
    out = tmp_path / "stale.zarr"
    (tmp_path / "stale.zarr.lock").write_text("unionsparse-lock pid 999999 host here\n")  # its holder is gone
    assert run_cli("compress", model_dirs["llama"], "-o", out, *FAST).code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stale.zarr"]


def test_a_user_file_named_like_the_lock_is_not_touched(tmp_path, model_dirs, run_cli):
    (tmp_path / "x.zarr.lock").write_text("my notes")
    refused(run_cli("compress", model_dirs["llama"], "-o", tmp_path / "x.zarr", *FAST), "x.zarr.lock",
            "not a unionsparse lock file")
    assert (tmp_path / "x.zarr.lock").read_text() == "my notes"


# ----------------------------------------------------------------- 4. full and read-only file systems


class _FullFile:
    """A file object on a full disk: it opened (the file exists, empty), every write fails."""

    def __init__(self, f):
        self._f = f

    def write(self, _data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writelines = write

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def broken_fs(monkeypatch):
    """``broken_fs(folder, "full" | "read-only")``: writes under ``folder`` fail as on a full disk (files open,
    every write is ENOSPC) or a read-only file system (creating, writing, renaming is EROFS)."""

    def apply(folder: Path, kind: str) -> None:
        top = os.path.abspath(folder)
        err = errno.ENOSPC if kind == "full" else errno.EROFS
        fds: set[int] = set()
        real_open, real_io_open = os.open, io.open
        real_mkdir, real_replace, real_rename = os.mkdir, os.replace, os.rename

        def under(p) -> bool:
            if isinstance(p, int):
                return p in fds
            a = os.path.abspath(os.fsdecode(p))
            return a == top or a.startswith(top + os.sep)

        def fail(p):
            raise OSError(err, os.strerror(err), str(p))

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            if dir_fd is None and writes and under(path):
                if kind != "full":
                    fail(path)
                fd = real_open(path, flags, mode)
                fds.add(fd)
                return fd
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def io_open(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+") and under(file):
                if kind != "full":
                    fail(file)
                return _FullFile(real_io_open(file, mode, *args, **kwargs))
            return real_io_open(file, mode, *args, **kwargs)

        def guard(real):
            def call(*args, **kwargs):
                if kind != "full" and any(under(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
                    fail(args[0])
                return real(*args, **kwargs)
            return call

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(io, "open", io_open)
        monkeypatch.setattr("builtins.open", io_open)
        monkeypatch.setattr(os, "mkdir", guard(real_mkdir))
        monkeypatch.setattr(os, "replace", guard(real_replace))
        monkeypatch.setattr(os, "rename", guard(real_rename))

    return apply


KINDS = [("full", "No space left on device"), ("read-only", "Read-only file system")]


@pytest.mark.parametrize("kind,words", KINDS)
@pytest.mark.parametrize("flag,name", [("--plot", "s.png"), ("--html", "s.html")])
def test_inspect_plot_and_html_on_a_broken_disk(flag, name, kind, words, art, tmp_path, broken_fs, run_cli):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs"
    out.mkdir()
    broken_fs(out, kind)
    refused(run_cli("inspect", art, flag, out / name), flag, str(out / name), words)
    assert list(out.iterdir()) == []  # no truncated PNG, no empty page, no temporary file


@pytest.mark.parametrize("kind,words", KINDS)
@pytest.mark.parametrize("flag", ["--csv", "--md"])
def test_summarize_files_on_a_broken_disk(flag, kind, words, art, tmp_path, broken_fs, run_cli):
    out = tmp_path / "tables"
    out.mkdir()
    broken_fs(out, kind)
    refused(run_cli("summarize", art.parent, flag, out / "t.txt"), flag, words)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("kind,words", KINDS)
def test_export_on_a_broken_disk(kind, words, art, tmp_path, broken_fs, run_cli):
    out = tmp_path / "exports"
    out.mkdir()
    broken_fs(out, kind)
    refused(run_cli("export", art, "-o", out / "hf"), "-o", words)
    assert list(out.iterdir()) == []  # no DIR, DIR.partial or lock file


@pytest.mark.parametrize("kind,words", KINDS)
def test_eval_record_on_a_broken_disk(kind, words, art, tmp_path, text, broken_fs, run_cli):
    d = tmp_path / "arts"
    d.mkdir()
    store = d / "a.zarr"
    shutil.copytree(art, store)
    broken_fs(d, kind)
    refused(run_cli("eval", store, "--text", text, "--seqlen", "64", "--max-windows", "1", "--record"), "--record",
            words)
    assert sorted(p.name for p in d.iterdir()) == ["a.zarr"]


# ------------------------------------------------------------------------ 5. progress and message order


def test_eval_shows_progress_on_a_terminal(art, text, run_cli, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich draws as on a terminal
    r = run_cli("eval", art, "--text", text, "--seqlen", "64", "--max-windows", "2")
    assert r.code == 0, r.err
    assert "rebuilding the artifact" in r.err and "perplexity windows of 64 tokens" in r.err, r.err


def test_eval_logs_one_line_per_stage(art, text, run_cli):
    from unionsparse.compressor.progress import configure_logging

    try:
        r = run_cli("eval", art, "--text", text, "--seqlen", "64", "--max-windows", "2", "--log-level", "info")
    finally:
        configure_logging("warning")
    assert r.code == 0, r.err
    assert "perplexity windows of 64 tokens: 2/2 in" in r.err, r.err


def test_generate_refuses_a_long_prompt_before_loading(art, run_cli, monkeypatch):
    from unionsparse.compressor import runtime

    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the prompt was checked")

    monkeypatch.setattr(runtime, "load", boom)
    r = run_cli("generate", art, "--prompt", "sparse kernel " * 40)  # byte-level tokens: > 256 positions
    refused(r, "--prompt", "positions")
    assert "loaded" not in r.err


# ------------------------------------------------------------------------------------------ 6. --help


def test_help_describes_every_option(run_cli):
    from unionsparse.compressor.cli import cli

    verify = {p.name: p for p in cli.commands["verify"].params}
    for name in ("backend", "seed", "quiet", "as_json"):
        assert verify[name].help, name
    assert "[hf|compressed-tensors]" in run_cli("export", "--help").out
    r = run_cli("export", "x.zarr", "-o", "y", "--to", "onnx")
    refused(r, "--to", "hf", "compressed-tensors")
    text = run_cli("eval", "--help").out
    assert "--act-sparsity / --no-act-sparsity" in text and "--dp" not in text
    ctx = cli.commands["eval"].make_context("eval", ["m", "--no-dp"])  # the old name still works
    assert ctx.params["dp_old"] is False


# ------------------------------------------------------------------------- 7. identical manifests


def test_identical_inputs_give_identical_manifests(reference_artifact, tmp_path, model_dirs, run_cli):
    again = tmp_path / "again.zarr"
    assert run_cli("compress", model_dirs["llama"], "-o", again, *REFERENCE_FLAGS).code == 0
    digests = []
    for store in (reference_artifact, again):
        r = run_cli("verify", store, "--n", "1", "--json")
        assert r.code == 0, r.out
        digests.append(json.loads(r.out)["manifest_sha256"])
    assert digests[0] == digests[1]
    assert (reference_artifact / "unionsparse_manifest.json").read_bytes() == \
        (again / "unionsparse_manifest.json").read_bytes()


# ------------------------------------------------------- 8. compressed-tensors: a group size that divides K


def test_compressed_tensors_picks_a_group_size_dividing_k(tmp_path, run_cli):
    """Hidden 192 (K = 192 for Q/K/V/O and gate/up, 384 for down_proj) under --group-size 128: exported with group
    size 64, every layer packed (nothing dense but lm_head), the codes and weights the artifact's."""
    pytest.importorskip("compressed_tensors")
    import torch
    from transformers import AutoModelForCausalLM
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.model.rebuild import rebuild_model

    model = tmp_path / "llama192"
    tiny_model("llama", hidden=192).save_pretrained(model)
    store = tmp_path / "g.zarr"
    assert run_cli("compress", model, "-o", store, *FAST, "--quant", "w4a16").code == 0
    out = tmp_path / "ct"
    r = run_cli("export", store, "-o", out, "--to", "compressed-tensors")
    assert r.code == 0, r.err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]
    (grp,) = qc["config_groups"].values()
    assert grp["weights"]["group_size"] == 64 and grp["weights"]["strategy"] == "group"
    meta = json.loads((out / "unionsparse.json").read_text())
    assert meta["dense_layers"] == {}
    assert meta["packing"] == [{"bits": 4, "group_size": 64, "layers": 14, "artifact_group_size": 128}]
    assert any("group size 64 instead of the artifact's 128" in ln and "K = 192" in ln for ln in r.err.splitlines())
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref = rebuild_model(store, act_quant=False)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # transformers decompresses on the first forward
        torch.testing.assert_close(loaded(tokens).logits.float(), ref(tokens).logits.float(), rtol=0, atol=1e-2)
    for name in Artifact(store).layer_names:  # decompressed by compressed-tensors: the artifact's weights
        assert torch.equal(loaded.get_submodule(name).weight.detach(), ref.get_submodule(name).weight.detach().half())


def test_export_group_rule():
    from unionsparse.compressor.export import export_group

    assert export_group(128, [576, 1536]) == 64  # SmolLM2: hidden 576, intermediate 1536
    assert export_group(128, [256, 512]) == 128
    assert export_group(128, [192]) == 64 and export_group(128, [96]) == 32
    assert export_group(128, [80]) is None  # below 32: those layers stay dense
    assert export_group(192, [256]) is None
