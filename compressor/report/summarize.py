"""Batch jobs: `unionsparse summarize DIR` turns a folder of artifacts into one CSV / markdown table.

The Makefile's grid targets (`make grid`, `make grid-verify`) compress models x sparsity x quant x format
into one folder and call this; `verify --json` output saved as ``NAME.zarr.verify.json`` beside an
artifact fills its ``verify`` column. ``python -m unionsparse.compressor.report.summarize tiny-model DIR`` writes the
small random LLaMA the default grid uses (no download).
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

import click

from ...formats import registry
from ..errors import UserError
from ..terminal import printable

COLUMNS = ("artifact", "model", "prune", "sparsity_target", "quant", "format", "tile", "reorder", "layers",
           "sparsity", "bits_per_weight", "cr", "pmr", "union_density_before", "union_density_after",
           "best_baseline", "best_baseline_bits", "total_bytes", "verify", "error")


def find_artifacts(folder: Path) -> list[Path]:
    """Every ``*.zarr`` directory under ``folder`` (recursively, not inside another store), sorted."""
    found = []
    for p in sorted(folder.rglob("*.zarr")):
        inside = [q for q in p.relative_to(folder).parents if q != Path(".")]
        if p.is_dir() and not any(q.suffix == ".zarr" for q in inside):
            found.append(p)
    return found


def verify_status(path: Path) -> str:
    """'ok' / 'FAILED (n)' from a saved ``verify --json`` beside the artifact, '' when none was run."""
    side = path.with_name(path.name + ".verify.json")
    if not side.is_file():
        return ""
    try:
        res = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return "FAILED (unreadable verify output)"
    if not isinstance(res, dict) or "ok" not in res:
        return "FAILED (unreadable verify output)"
    return "ok" if res["ok"] else f"FAILED ({len(res.get('failures', []))})"


def artifact_row(path: Path, root: Path) -> dict:
    """One summary row; a broken artifact gives a row with ``error`` set instead of stopping the table."""
    from .tables import inspect_data

    row: dict = {"artifact": str(path.relative_to(root)), "verify": verify_status(path)}
    try:
        data = inspect_data(str(path), None, compare=True)
    except Exception as e:  # noqa: BLE001 - a CI table must list a broken artifact, not crash on it
        row["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return row
    cfg = data.get("config") or {}
    m = data["model"]
    tile = cfg.get("tile")
    row.update({
        "model": (data.get("source") or {}).get("model", cfg.get("model")),
        "prune": cfg.get("prune"), "sparsity_target": cfg.get("sparsity"), "quant": cfg.get("quant"),
        "format": m.get("format"), "tile": "x".join(map(str, tile)) if isinstance(tile, list) else tile,
        "reorder": cfg.get("reorder") if _reorders(m.get("format")) else "-",
        "layers": len(data["layers"]), "sparsity": m.get("sparsity"),
        "bits_per_weight": m.get("bits_per_weight"),
        "cr": m.get("cr"), "pmr": m.get("pmr"), "total_bytes": m.get("total_bytes"),
        "union_density_before": m.get("union_density_before_reorder"),
        "union_density_after": m.get("union_density_after_reorder", m.get("union_density")),
    })
    sparse = {k: v for k, v in data.get("model_baselines", {}).items() if not k.startswith("dense")}
    if sparse:
        best = min(sparse, key=lambda k: sparse[k]["bits_per_weight"])
        row["best_baseline"], row["best_baseline_bits"] = best, sparse[best]["bits_per_weight"]
    return row


def summarize(folder: str | Path) -> list[dict]:
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"DIR: {folder} is not a folder")
    paths = find_artifacts(root)
    if not paths:
        raise UserError(f"DIR: no *.zarr artifacts under {folder}")
    return [artifact_row(p, root) for p in paths]


def _cell(v, markdown: bool = False) -> str:
    if v is None:
        return "" if not markdown else "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3f}" if markdown else repr(v)  # CSV keeps full precision
    if not markdown:
        return str(v)
    return printable(v).replace("|", "\\|")  # the table goes to a terminal: control characters escaped


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue()


def to_markdown(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if any(r.get(c) not in (None, "") for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        short = {**r, "model": Path(str(r["model"])).name if r.get("model") else None}  # full path in CSV
        lines.append("| " + " | ".join(_cell(short.get(c), markdown=True) for c in cols) + " |")
    return "\n".join(lines) + "\n"


@click.command("summarize")
@click.argument("folder")
@click.option("--csv", "csv_file", default=None, help="Write the table as CSV to this file.")
@click.option("--md", "md_file", default=None, help="Write the table as markdown to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of markdown.")
def summarize_command(folder, csv_file, md_file, as_json) -> None:
    """One table over every artifact under FOLDER: bits/weight, CR, PMR, union density, verify."""
    from ..files import atomic_write

    rows = summarize(folder)
    for flag, target, text in (("--csv", csv_file, to_csv), ("--md", md_file, to_markdown)):
        if target:
            atomic_write(target, text(rows), flag)
    click.echo(json.dumps(rows, indent=2, default=str) if as_json else to_markdown(rows), nl=False)
    if any(r.get("error") or r.get("verify", "").startswith("FAILED") for r in rows):
        sys.exit(1)


def write_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """A small random causal LM saved as a Hugging Face folder (2 blocks, hidden 128), for CI grids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if arch != "llama":
        raise UserError(f"tiny-model: only 'llama' is built in, got {arch!r}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    out = Path(folder)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


if __name__ == "__main__":  # python -m unionsparse.compressor.report.summarize tiny-model DIR
    if len(sys.argv) != 3 or sys.argv[1] != "tiny-model":
        sys.exit("usage: python -m unionsparse.compressor.report.summarize tiny-model DIR")
    print(write_tiny_model(sys.argv[2]))


def _reorders(fmt: str | None) -> bool:
    return fmt in registry.names() and registry.get(fmt).reorders_rows
