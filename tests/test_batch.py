"""`unionsparse summarize` over a folder of artifacts, and the Makefile grid targets."""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grid(tmp_path_factory, model_dirs) -> Path:
    from unionsparse.compressor.cli import main

    root = tmp_path_factory.mktemp("grid")
    for name, args in (("a_iebme.zarr", ["--format", "ie-bme", "--sparsity", "0.6"]),
                       ("sub/b_cbc.zarr", ["--format", "tiled-cbc", "--quant", "w4a4", "--sparsity", "0.5"])):
        (root / name).parent.mkdir(exist_ok=True)
        with pytest.raises(SystemExit) as e:
            main(["compress", str(model_dirs["opt"]), "-o", str(root / name), "--quiet", "--reorder", "none",
                  *args])
        assert e.value.code == 0
    return root


def test_summary_rows_are_the_inspect_figures(grid, tmp_path, run_cli):
    c, m = tmp_path / "s.csv", tmp_path / "s.md"
    r = run_cli("summarize", grid, "--csv", c, "--md", m)
    assert r.code == 0, r.err
    rows = list(csv.DictReader(io.StringIO(c.read_text())))
    assert [x["artifact"] for x in rows] == ["a_iebme.zarr", "sub/b_cbc.zarr"]
    for row in rows:
        data = json.loads(run_cli("inspect", grid / row["artifact"], "--json", "--compare").out)
        mod = data["model"]
        assert row["format"] == mod["format"]
        assert float(row["bits_per_weight"]) == pytest.approx(mod["bits_per_weight"], abs=1e-4)
        assert float(row["cr"]) == pytest.approx(mod["cr"], abs=1e-4)
        assert int(row["total_bytes"]) == mod["total_bytes"]
        assert int(row["layers"]) == len(data["layers"])
        sparse = {k: v for k, v in data["model_baselines"].items() if not k.startswith("dense")}
        best = min((v["bits_per_weight"], k) for k, v in sparse.items())
        assert row["best_baseline"] == best[1]
        assert row["verify"] == "" and row["error"] == ""
    assert rows[0]["sparsity_target"] == "0.6" and rows[1]["quant"] == "w4a4"
    md = m.read_text().splitlines()
    assert md[0].startswith("| artifact |") and md[1].startswith("|---") and len(md) == 4
    assert r.out == m.read_text()  # markdown on stdout too


def test_verify_results_and_broken_artifacts_fail_the_table(grid, tmp_path, run_cli):
    work = tmp_path / "g"
    shutil.copytree(grid, work)
    r = run_cli("verify", work / "a_iebme.zarr", "--json", "--quiet", "--n", "1")
    (work / "a_iebme.zarr.verify.json").write_text(r.out)
    (work / "sub" / "b_cbc.zarr.verify.json").write_text(json.dumps({"ok": False, "failures": ["x", "y"]}))
    r = run_cli("summarize", work, "--json")
    assert r.code == 1  # a failed check
    rows = {x["artifact"]: x for x in json.loads(r.out)}
    assert rows["a_iebme.zarr"]["verify"] == "ok"
    assert rows["sub/b_cbc.zarr"]["verify"] == "FAILED (2)"
    (work / "sub" / "b_cbc.zarr.verify.json").unlink()
    (work / "junk.zarr").mkdir()  # not an artifact: listed with its error, not a crash
    r = run_cli("summarize", work, "--json")
    assert r.code == 1
    rows = {x["artifact"]: x for x in json.loads(r.out)}
    assert "no zarr.json" in rows["junk.zarr"]["error"]


def test_summarize_bad_input(tmp_path, run_cli):
    r = run_cli("summarize", tmp_path)
    assert r.code == 2 and "no *.zarr" in r.err
    r = run_cli("summarize", tmp_path / "missing")
    assert r.code == 2 and "not a folder" in r.err


def make_dry(*args: str) -> str:
    r = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_grid_enumerates_the_cells(tmp_path):
    out = make_dry("grid", f"GRID_OUT={tmp_path}", "MODELS=tiny", "SPARSITIES=0.5 0.8", "QUANTS=w4a4 none",
                   "FORMATS=ie-bme tiled-cbc")
    cells = sorted(ln.split(" -o ")[1].split()[0] for ln in out.splitlines() if "unionsparse compress" in ln)
    want = sorted(f"{tmp_path}/tiny_s{s}_{q}_{f}.zarr" for s in ("0.5", "0.8") for q in ("w4a4", "none")
                  for f in ("ie-bme", "tiled-cbc") if not (q == "none" and f == "ie-bme"))
    assert cells == want  # 2 x 2 x 2 minus the invalid ie-bme + none
    assert "--sparsity 0.8 --quant none" in out
    assert "unionsparse summarize" in out and "tiny-model" in out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_grid_verify_runs_one_cell(tmp_path):
    r = subprocess.run(["make", "-C", str(ROOT), "-j2", "grid-verify", f"GRID_OUT={tmp_path}",
                        "SPARSITIES=0.5", "QUANTS=w4a4", "FORMATS=ie-bme tiled-cbc", "VERIFY_N=1"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert len(rows) == 2 and all(x["verify"] == "ok" for x in rows)
