"""inspect --plot / --html / --recipe, --log-level, --version and environment-variable options."""

from __future__ import annotations

import base64
import io
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
    assert names[("compress", "format")] == "UNIONSPARSE_COMPRESS_FORMAT"
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


def test_inspect_leads_with_the_summary_and_recorded_figures(tmp_path, llama_with_tokenizer, run_cli):
    """inspect starts with what a user decides from (formats, size against fp16, bits per weight, fidelity,
    speed); eval --record keeps its perplexity beside the artifact, outside the checksummed store, and inspect
    and the HTML page then show it; the per-layer table follows, collapsed in the HTML page."""
    model, _ = llama_with_tokenizer
    art = tmp_path / "s.zarr"
    assert run_cli("compress", model, "-o", art, "--quiet", "--reorder", "none", "--ignore", ".*down_proj").code == 0
    first = run_cli("inspect", art).out.splitlines()
    assert first[0].startswith(f"{art}: ie-bme w4a4 from ") and "2 kept dense" in first[1]
    assert "bits/weight" in first[2] and "not recorded" in first[3] and "not measured" in first[4]
    text = tmp_path / "wiki.txt"
    text.write_text(" = Title = \n" + "the sparse model weights of the layer input\n" * 60)
    before = sorted(p.relative_to(art) for p in art.rglob("*"))
    r = run_cli("eval", art, "--text", text, "--seqlen", "64", "--tokenizer", model, "--record", "--json")
    assert r.code == 0, r.err
    ppl = json.loads(r.out)["ppl"]
    assert sorted(p.relative_to(art) for p in art.rglob("*")) == before  # the store is untouched...
    sidecar = art.with_name(art.name + ".figures.json")
    assert sidecar.is_file()  # ...the figures sit beside it
    assert run_cli("verify", art, "--n", "1").code == 0
    lines = run_cli("inspect", art).out.splitlines()
    assert lines[3] == f"  fidelity  perplexity {ppl:.3f} on wiki.txt, seqlen 64"
    page = tmp_path / "r.html"
    assert run_cli("inspect", art, "--html", page).code == 0
    html = page.read_text()
    assert html.index("Summary") < html.index(f"perplexity {ppl:.3f}") < html.index("<details>")
    assert "<table>" in html[html.index("<details>"):]
    r = run_cli("eval", model, "--text", text, "--seqlen", "64", "--record")
    assert r.code == 2 and "not a unionsparse artifact" in r.err


def test_inspect_fits_an_80_column_terminal(artifacts):
    """A narrow console gets the compact per-layer table (every line within its width)."""
    from rich.console import Console
    from unionsparse.compressor.report.tables import inspect_data, print_tables

    console = Console(width=80, record=True, file=io.StringIO())
    print_tables(inspect_data(str(artifacts["ie-bme"]), None, False), console, False)
    text = console.export_text()
    assert "bits per weight" in text and "payload B" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
