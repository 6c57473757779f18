"""`inspect --html`: one self-contained page (tables + the plot inlined as a data: URI, no external files)."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from ..errors import UserError
from .tables import COLUMNS, _fmt, summary_lines

CSS = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child{text-align:left}tr.model td{font-weight:bold;background:#fafafa}
img{max-width:100%}pre{background:#f6f6f6;padding:1em}"""
BASELINE_COLUMNS = ("bits_per_weight", "total_bytes", "meta_bytes", "pmr", "cr")


def _table(headers: list[str], rows: list[tuple[list[str], bool]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        ('<tr class="model">' if bold else "<tr>") + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        + "</tr>" for cells, bold in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def layer_table(data: dict) -> str:
    reorder = any("reorder" in r for r in data["layers"])
    headers = ["layer", *COLUMNS] + (["union before reorder"] if reorder else [])
    rows = []
    for r in data["layers"] + [data["model"]]:
        cells = [r["layer"]] + [_fmt(c, r.get(c)) for c in COLUMNS]
        if reorder:
            ro = r.get("reorder")
            cells.append(_fmt("union_density", ro["union_density_before"] if ro else
                              r.get("union_density_before_reorder")))
        rows.append((cells, r["layer"] == "model"))
    return _table(headers, rows)


def baseline_table(data: dict) -> str:
    rows = [data["model"], *data.get("model_baselines", {}).values()]
    body = [([r["format"], *(_fmt(c, r.get(c)) for c in BASELINE_COLUMNS),
              _fmt("x_bytes", r.get("formula_bytes"))], r is data["model"]) for r in rows]
    return _table(["format", *BASELINE_COLUMNS, "seed formula bytes"], body)


def render(data: dict, png: bytes | None) -> str:
    """The whole page as a string."""
    title = f"unionsparse inspect: {data['artifact']}"
    img = (f'<img alt="per-layer figures" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
           if png else "<p>(plot unavailable)</p>")
    recipe = json.dumps(data.get("config"), indent=2, default=str)
    m = data["model"]
    cr = m.get("cr")
    cr_text = _fmt("x", cr) if cr is not None and math.isfinite(cr) else "-"
    lead = (f"{len(data['layers'])} layers, format {m.get('format')}, "
            f"{_fmt('x', m.get('bits_per_weight'))} bits per weight, CR {cr_text}x vs fp16, "
            f"sparsity {_fmt('sparsity', m.get('sparsity'))}")
    summary = (f"<pre>{html.escape(chr(10).join(summary_lines(data)))}</pre>" if "summary" in data
               else f"<p>{html.escape(lead)}</p>")
    return (
        f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<h2>Summary</h2>{summary}"
        f"<h2>Per-layer figures</h2>{img}"
        f"<details><summary>Per layer ({len(data['layers'])} layers: {html.escape(lead)})</summary>"
        f"{layer_table(data)}</details>"
        f"<h2>Same masks, other encodings (model level)</h2>{baseline_table(data)}"
        f"<h2>Recipe</h2><pre>{html.escape(recipe)}</pre></body></html>\n"
    )


def write_html(data: dict, path: str | Path, png: bytes | None) -> Path:
    from ..files import atomic_write

    p = Path(path)
    if not p.parent.exists():
        raise UserError(f"--html: folder {p.parent} does not exist")
    return atomic_write(p, render(data, png), "--html")
