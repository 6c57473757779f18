"""Every script in examples/ runs in a fresh interpreter, exits 0 and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> (extra arguments, text the output must contain); "{artifact}" is replaced by a real artifact
CASES = {
    "encode_matrix.py": (["--m", "64", "--k", "256"], ["union density", "ie-bme+reorder", "tiled-cbc"]),
    "run_kernel.py": (["--m", "128", "--k", "256", "--n", "4"],
                      ["IE-BME W4A4 SpMM (CPU reference)", "Tiled-CBC spMspV", "Tiled-CBC SpMM"]),
    "read_artifact.py": (["{artifact}"], ["14 layers", "dequantized weight", "bits/weight"]),
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, model_dirs) -> Path:
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("ex") / "tiny.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), "--quiet", "--reorder", "none"])
    assert e.value.code == 0
    return out


def run_script(name: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*CASES, "compare_formats.py"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name, artifact):
    args, expected = CASES[name]
    r = run_script(name, [str(artifact) if a == "{artifact}" else a for a in args])
    assert r.returncode == 0, r.stderr[-2000:]
    for text in expected:
        assert text in r.stdout, (text, r.stdout)


def test_compare_formats_numbers_match_the_library():
    """compare_formats.py prints the library's figures, not decoration: recompute one cell."""
    import numpy as np
    from unionsparse.formats import baselines
    from unionsparse.formats.arithmetic.weights import rtn

    r = run_script("compare_formats.py", ["--m", "128", "--k", "256", "--sparsities", "0.9"])
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.strip().splitlines()
    cols = header.split()[1:]
    vals = [float(v.rstrip("*")) for v in row.split()[1:]]
    w = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    wp = np.where(np.abs(w) >= np.quantile(np.abs(w), 0.9), w, 0.0)
    codes = rtn(wp, 4, 128).codes
    want = baselines(codes != 0, 4, 128)["csr"]["bits_per_weight"]
    assert vals[cols.index("csr")] == pytest.approx(want, abs=1e-3)
    assert row.count("*") == 1


@pytest.mark.slow
def test_read_artifact_without_arguments_builds_one():
    r = run_script("read_artifact.py", [])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tiny.zarr: 14 layers" in r.stdout
