"""inspect --plot / --html / --recipe, --log-level, --version and environment-variable options."""

from __future__ import annotations

import base64
import json
import re
import struct
import sys

import pytest
from unionsparse.compressor.report.plots import DPI, FIG_SIZE, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, model_dirs):
    from unionsparse.compressor.cli import main

    root = tmp_path_factory.mktemp("rep")
    out = {}
    for fmt, extra in (("ie-bme", ["--reorder", "dp"]), ("tiled-cbc", ["--quant", "none"])):
        out[fmt] = root / f"{fmt}.zarr"
        with pytest.raises(SystemExit) as e:
            main(["compress", str(model_dirs["llama"]), "-o", str(out[fmt]), "--quiet", "--format", fmt,
                  *extra])
        assert e.value.code == 0
    return out


def test_plot_is_a_png_of_the_expected_size(artifacts, tmp_path, run_cli):
    for fmt, art in artifacts.items():
        png = tmp_path / f"{fmt}.png"
        r = run_cli("inspect", art, "--plot", png)
        assert r.code == 0, r.err
        assert png_size(png.read_bytes()) == (int(FIG_SIZE[0] * DPI), int(FIG_SIZE[1] * DPI))
        assert "layer" in r.out  # the table still prints on stdout


def test_plotted_series_are_the_inspect_figures(artifacts, run_cli):
    data = json.loads(run_cli("inspect", artifacts["ie-bme"], "--json", "--compare").out)
    s = series(data)
    layers = data["layers"]
    assert s["bits"]["ie-bme"] == [r["bits_per_weight"] for r in layers]
    assert s["bits"]["tca-bme"] == [r["baselines"]["tca-bme"]["bits_per_weight"] for r in layers]
    assert set(s["bits"]) == {"ie-bme", "dense-4bit", "csr", "tiled-csl", "tca-bme"}
    assert set(s["pmr"]) == {"ie-bme", "csr", "tiled-csl", "tca-bme"}
    before, after = s["union"]["before reorder"], s["union"]["after reorder"]
    pairs = list(zip(after, before, strict=True))
    assert all(a <= b for a, b in pairs) and any(a < b for a, b in pairs)
    assert after == [r["union_density"] for r in layers]
    cbc = series(json.loads(run_cli("inspect", artifacts["tiled-cbc"], "--json", "--compare").out))
    assert cbc["union"] == {} and "dense-16bit" in cbc["bits"]


def test_html_is_one_self_contained_page(artifacts, tmp_path, run_cli):
    page = tmp_path / "r.html"
    r = run_cli("inspect", artifacts["ie-bme"], "--html", page, "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)  # --json output unchanged by --html (no baselines unless --compare)
    assert "model_baselines" not in data
    text = page.read_text()
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    for row in data["layers"]:
        assert row["layer"] in text
    assert f"{data['model']['bits_per_weight']:.3f}" in text
    for fmt in ("csr", "tiled-csl", "tca-bme", "dense-fp16"):
        assert f"<td>{fmt}</td>" in text
    imgs = re.findall(r'<img[^>]* src="([^"]+)"', text)
    assert len(imgs) == 1 and imgs[0].startswith("data:image/png;base64,")
    assert png_size(base64.b64decode(imgs[0].split(",", 1)[1]))[0] == int(FIG_SIZE[0] * DPI)
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from elsewhere


def test_plot_bad_paths_and_missing_matplotlib(artifacts, tmp_path, run_cli, monkeypatch):
    r = run_cli("inspect", artifacts["ie-bme"], "--plot", tmp_path / "nope" / "a.png")
    assert r.code == 2 and "--plot" in r.err and "does not exist" in r.err
    r = run_cli("inspect", artifacts["ie-bme"], "--plot", tmp_path / "a.jpg")
    assert r.code == 2 and ".png" in r.err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = run_cli("inspect", artifacts["ie-bme"], "--plot", tmp_path / "a.png")
    assert r.code == 2 and "matplotlib" in r.err and "Traceback" not in r.err
    assert not (tmp_path / "a.png").exists()


def test_recipe_prints_yaml(artifacts, run_cli):
    import yaml
    from unionsparse.compressor.artifact.store import Artifact

    r = run_cli("inspect", artifacts["tiled-cbc"], "--recipe")
    assert r.code == 0
    assert yaml.safe_load(r.out) == Artifact(artifacts["tiled-cbc"]).attrs["config"]


def test_version_log_level_and_env_vars(artifacts, run_cli, monkeypatch):
    from importlib.metadata import version

    r = run_cli("--version")
    assert r.code == 0 and version("unionsparse") in r.out
    r = run_cli("--log-level", "loud", "inspect", artifacts["ie-bme"])
    assert r.code == 2 and "--log-level" in r.err
    import logging

    r = run_cli("--log-level", "debug", "inspect", artifacts["ie-bme"], "--json")
    assert r.code == 0 and logging.getLogger("unionsparse").level == logging.DEBUG
    monkeypatch.setenv("UNIONSPARSE_LOG_LEVEL", "error")
    monkeypatch.setenv("UNIONSPARSE_INSPECT_JSON", "1")
    r = run_cli("inspect", artifacts["ie-bme"])
    assert r.code == 0 and json.loads(r.out)["model"]["format"] == "ie-bme"
    assert logging.getLogger("unionsparse").level == logging.ERROR


def test_env_var_names_follow_the_long_option():
    from unionsparse.compressor.cli import cli

    names = {(c, p.name): p.envvar for c, cmd in cli.commands.items() for p in cmd.params
             if getattr(p, "envvar", None)}
    assert names[("compress", "fmt")] == "UNIONSPARSE_COMPRESS_FORMAT"
    assert names[("compress", "group_size")] == "UNIONSPARSE_COMPRESS_GROUP_SIZE"
    assert names[("compress", "config_file")] == "UNIONSPARSE_COMPRESS_CONFIG"
    assert names[("verify", "ns")] == "UNIONSPARSE_VERIFY_N"


def test_log_level_info_gives_one_line_per_stage(artifacts, run_cli):
    art = artifacts["tiled-cbc"]
    r = run_cli("--log-level", "info", "verify", art, "--quiet", "--n", "1", "--backend", "cpu")
    assert r.code == 0, r.err
    assert re.search(r"INFO unionsparse: verifying layers: 14/14 in \d+\.\d s", r.err), r.err
    r = run_cli("verify", artifacts["tiled-cbc"], "--quiet", "--n", "1", "--backend", "cpu")
    assert "INFO" not in r.err  # default level: warnings only
