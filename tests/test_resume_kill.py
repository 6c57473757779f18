"""--resume after SIGKILL at a random layer gives the same bytes as an uninterrupted run; runs repeat."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REFERENCE_FLAGS, assert_same_artifacts
from unionsparse.compressor.artifact.store import Artifact

CLI = Path(sys.executable).parent / "unionsparse"
COMMON = REFERENCE_FLAGS


def complete_layers(partial: Path) -> list[Path]:
    out = []
    for meta in (partial / "layers").glob("**/zarr.json"):
        try:
            attrs = json.loads(meta.read_text()).get("attributes", {})
        except (OSError, ValueError):  # being written right now
            continue
        if attrs.get("complete") and "format" in attrs:
            out.append(meta)
    return out


def test_same_config_twice_gives_identical_arrays(reference_artifact, tmp_path, model_dirs, run_cli):
    again = tmp_path / "again.zarr"
    assert run_cli("compress", model_dirs["llama"], "-o", again, *COMMON).code == 0
    assert_same_artifacts(reference_artifact, again)


def test_sigkill_at_random_layer_then_resume(reference_artifact, tmp_path, model_dirs, run_cli):
    n_layers = len(Artifact(reference_artifact).layer_names)
    rnd = random.Random(int(os.environ.get("UNIONSPARSE_TEST_SEED", time.time_ns() % 1000)))
    target = rnd.randrange(1, n_layers - 1)
    out = tmp_path / "killed.zarr"
    partial = tmp_path / "killed.zarr.partial"
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    p = subprocess.Popen([str(CLI), "compress", str(model_dirs["llama"]), "-o", str(out), *COMMON], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while p.poll() is None and len(complete_layers(partial)) < target:
            time.sleep(0.01)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not out.exists(), "the run finished before it could be killed"
    before = {m: m.stat().st_mtime_ns for m in complete_layers(partial)}
    assert len(before) >= target
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--resume")
    assert r.code == 0, (target, r.err)
    assert not partial.exists()
    assert_same_artifacts(reference_artifact, out)
    for meta, mtime in before.items():  # layers completed before the kill were kept, not recomputed
        moved = out / meta.relative_to(partial)
        assert moved.stat().st_mtime_ns == mtime, moved


def test_resume_refuses_a_different_configuration(tmp_path, model_dirs, run_cli):
    out = tmp_path / "cfg.zarr"
    partial = tmp_path / "cfg.zarr.partial"
    p = subprocess.Popen([str(CLI), "compress", str(model_dirs["llama"]), "-o", str(out), *COMMON],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while p.poll() is None and not complete_layers(partial):
            time.sleep(0.01)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", "--sparsity", "0.6", "--resume")
    assert r.code == 2 and "different configuration" in r.err and "Traceback" not in r.err
    assert partial.exists()  # the interrupted run's work is the user's: not deleted


def test_resume_after_a_kill_mid_write_of_zarr(tmp_path, model_dirs, run_cli, monkeypatch):
    """A kill while zarr writes a file leaves its temporary ``zarr.<uuid hex>.partial``; the partial is still this
    run's: --resume continues it (the leftover removed, the artifact verifies) and another configuration is told
    'different configuration', not 'not a partial artifact'."""
    from unionsparse.compressor.artifact.store import ArtifactWriter

    out, partial = tmp_path / "t.zarr", tmp_path / "t.zarr.partial"
    real = ArtifactWriter.write_layer
    calls = {"n": 0}

    def interrupted(self, rec):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, rec)

    monkeypatch.setattr(ArtifactWriter, "write_layer", interrupted)
    assert run_cli("compress", model_dirs["llama"], "-o", out, *COMMON).code == 130
    monkeypatch.setattr(ArtifactWriter, "write_layer", real)
    leftovers = [partial / "zarr.0123456789abcdef0123456789abcdef.partial",
                 partial / "dense" / "zarr.fedcba9876543210fedcba9876543210.partial"]
    for f in leftovers:
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"half a zarr.json")
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", "--sparsity", "0.6", "--resume")
    assert r.code == 2 and "different configuration" in r.err, r.err
    assert all(f.exists() for f in leftovers)  # refused: nothing touched
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--resume")
    assert r.code == 0, r.err
    assert not list(out.rglob("zarr.*.partial"))
    assert run_cli("verify", out, "--n", "1", "--quiet").code == 0
