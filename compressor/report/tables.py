"""`inspect`: the PMR/CR table of an artifact, per layer and for the whole model, baselines beside it.

Figures come from the layers' attributes as stored (``verify`` recomputes them from the arrays); their
types are checked, and every cell is printed as plain text (no rich markup, control characters escaped).
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..artifact.store import Artifact
from ..errors import UserError
from ..terminal import printable
from .figures import read_figures

COLUMNS = ("shape", "sparsity", "union_density", "bits_per_weight", "payload_bytes", "meta_bytes",
           "scale_bytes", "pmr", "cr")


NUMBERS = ("nnz", "payload_bytes", "meta_bytes", "scale_bytes", "total_bytes", "sparsity", "bits_per_weight",
           "pmr", "cr", "union_density", "union_positions", "formula_bytes")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_figures(where: str, s: object) -> dict:
    """A layer's (or baseline's) ``stats`` with the types inspect sums and prints, else UserError."""
    shape = s.get("shape") if isinstance(s, dict) else None
    ok = (isinstance(shape, list) and len(shape) == 2 and all(type(x) is int and x >= 0 for x in shape)
          and all(s.get(k) is None or _is_number(s[k]) for k in NUMBERS))
    if not ok:
        raise UserError(f"{where}: stats are malformed (run unionsparse verify)")
    return dict(s)


def layer_rows(art: Artifact, layer: str | None = None) -> list[dict]:
    names = [layer] if layer else art.layer_names
    rows = []
    for name in names:
        a = art.layer_attrs(name)
        s = check_figures(f"layer {printable(name)}", a.get("stats"))
        if a.get("bits") is not None and type(a.get("bits")) is not int:
            raise UserError(f"layer {printable(name)}: bits {a.get('bits')!r} is not an integer")
        row = {"layer": name, "format": a.get("format"), "bits": a.get("bits"), **s}
        if "reorder" in a:
            row["reorder"] = _check_reorder(name, a["reorder"])
        bl = a.get("baselines", {})
        if not isinstance(bl, dict):
            raise UserError(f"layer {printable(name)}: baselines are malformed (run unionsparse verify)")
        row["baselines"] = {b: check_figures(f"layer {printable(name)} baseline", v) for b, v in bl.items()}
        rows.append(row)
    return rows


def _check_reorder(name: str, r: object) -> dict:
    keys = ("union_positions_before", "union_positions_after", "union_slots", "union_density_before")
    if not isinstance(r, dict) or not all(_is_number(r.get(k)) for k in keys):
        raise UserError(f"layer {printable(name)}: reorder figures are malformed (run unionsparse verify)")
    return r


def model_row(rows: list[dict], fmt: str) -> dict:
    """Model-level figures: sums of bytes over all layers, ratios recomputed from the sums."""
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    tot = {k: sum(r.get(k, 0) for r in rows) for k in ("nnz", "payload_bytes", "meta_bytes", "scale_bytes",
                                                         "total_bytes")}
    bw = (rows[0]["bits"] or 16) / 8 if rows else 0.5
    out = {
        "layer": "model", "format": fmt, "shape": f"{weights:,} w", "weights": weights, **tot,
        "sparsity": 1 - tot["nnz"] / max(weights, 1),
        "bits_per_weight": tot["total_bytes"] * 8 / max(weights, 1),
        "pmr": bw * tot["nnz"] / tot["meta_bytes"] if tot["meta_bytes"] else math.inf,
        "cr": 2 * weights / max(tot["total_bytes"], 1),
    }
    if rows and all("formula_bytes" in r for r in rows):
        out["formula_bytes"] = sum(r["formula_bytes"] for r in rows)
    pos = [r.get("union_positions") for r in rows]
    if all(p is not None for p in pos) and rows:
        slots = sum(r["union_positions"] / r["union_density"] for r in rows if r.get("union_density"))
        out["union_density"] = sum(pos) / slots if slots else 0.0
    return out


def baseline_model_rows(rows: list[dict]) -> dict[str, dict]:
    """Per baseline format, the model-level figures summed the same way."""
    names = list(rows[0]["baselines"]) if rows else []
    out = {}
    for b in names:
        sub = [{**r["baselines"][b], "bits": r["bits"]} for r in rows if b in r.get("baselines", {})]
        out[b] = model_row(sub, b)
    return out


def inspect_data(path: str, layer: str | None = None, compare: bool = False) -> dict:
    art = Artifact(path, verify=False)  # a report on the store as it is; verify checks it
    rows = layer_rows(art, layer)
    formats = sorted({str(r["format"]) for r in rows})
    fmt = formats[0] if len(formats) == 1 else f"mixed: {', '.join(formats)}" if formats else None
    data = {
        "artifact": str(path),
        "source": art.attrs.get("source"),
        "config": art.attrs.get("config"),
        "layers": rows if compare else [{k: v for k, v in r.items() if k != "baselines"} for r in rows],
        "model": model_row(rows, fmt),
    }
    if compare:
        data["model_baselines"] = baseline_model_rows(rows)
    if layer is None:
        data["summary"] = model_summary(art, rows)
        data["figures"] = read_figures(path)
    reorder = [r["reorder"] for r in rows if "reorder" in r]
    if reorder:
        before = sum(r["union_positions_before"] for r in reorder)
        after = sum(r["union_positions_after"] for r in reorder)
        slots = sum(r["union_slots"] for r in reorder)
        data["model"]["union_density_before_reorder"] = before / slots if slots else 0.0
        data["model"]["union_density_after_reorder"] = after / slots if slots else 0.0
    return data


def without_baselines(data: dict) -> dict:
    """``inspect_data(..., compare=True)`` as ``compare=False`` gives it, without reading the artifact again."""
    out = {k: v for k, v in data.items() if k != "model_baselines"}
    out["layers"] = [{k: v for k, v in r.items() if k != "baselines"} for r in data["layers"]]
    return out


def model_summary(art: Artifact, rows: list[dict]) -> dict:
    """What a user decides from: source, formats and quantization, how many linears are compressed or kept
    dense, the size against fp16, bits per weight, CR and sparsity (the root summary, kept-dense linears
    included, when the artifact has one)."""
    stored = art.attrs.get("summary") if isinstance(art.attrs.get("summary"), dict) else {}
    m = model_row(rows, "")
    weights = stored.get("weights") if _is_number(stored.get("weights")) else m["weights"]
    total = stored.get("total_bytes") if _is_number(stored.get("total_bytes")) else m["total_bytes"]
    cfg = art.attrs.get("config") if isinstance(art.attrs.get("config"), dict) else {}
    rules = art.attrs.get("layer_rules") if isinstance(art.attrs.get("layer_rules"), dict) else {}
    return {
        "source": (art.attrs.get("source") or {}).get("model") if isinstance(art.attrs.get("source"), dict) else None,
        "formats": sorted({str(r["format"]) for r in rows}),
        "quant": sorted({str(art.layer_attrs(r["layer"]).get("quant") or cfg.get("quant")) for r in rows}),
        "layers": len(rows),
        "dense_linears": sum(1 for v in rules.values() if v == {"dense": True}),
        "bytes": total, "fp16_bytes": 2 * weights,
        "bits_per_weight": total * 8 / max(weights, 1), "cr": 2 * weights / max(total, 1),
        "sparsity": stored.get("sparsity") if _is_number(stored.get("sparsity")) else m["sparsity"],
    }


def summary_lines(data: dict) -> list[str]:
    """The summary inspect leads with, as short lines (they fit 80 columns but for long paths)."""
    s, fig = data["summary"], data.get("figures") or {}
    mb = 1e6
    lines = [f"{data['artifact']}: {', '.join(s['formats'])} {'/'.join(s['quant'])} from {s['source']}",
             f"  layers    {s['layers']} compressed, {s['dense_linears']} kept dense (per-layer rules)",
             f"  size      {s['bytes'] / mb:.1f} MB (fp16 {s['fp16_bytes'] / mb:.1f} MB): {s['bits_per_weight']:.3f} "
             f"bits/weight, CR {s['cr']:.2f}x, sparsity {100 * s['sparsity']:.1f}%"]
    ppl = fig.get("perplexity") or {}
    if ppl:
        lines += [f"  fidelity  perplexity {v.get('ppl', float('nan')):.3f} on {k}" for k, v in sorted(ppl.items())]
    else:
        lines.append(f"  fidelity  not recorded (unionsparse eval {data['artifact']} --text FILE --record)")
    for k, v in sorted((fig.get("tasks") or {}).items()):
        lines.append(f"  tasks     {k}: " + ", ".join(f"{m} {x:.4f}" for m, x in sorted(v.items())
                                                    if isinstance(x, (int, float)) and not isinstance(x, bool)))
    speed = fig.get("speed") or {}
    if speed:
        lines += [f"  speed     {k}: {v}" for k, v in sorted(speed.items())]
    else:
        lines.append("  speed     not measured (unionsparse bench --e2e, on a GPU)")
    return lines


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key == "shape":
        return v if isinstance(v, str) else "x".join(str(x) for x in v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if key in ("sparsity", "union_density"):
            return f"{100 * v:.1f}%"
        return f"{v:.3f}"
    if isinstance(v, int) and key.endswith("bytes"):
        return f"{v:,}"
    return str(v)


def _cell(v: object) -> Text:
    """Plain text: no markup is interpreted, control characters are shown as escapes."""
    return Text(printable(v))


COMPACT = ("shape", "sparsity", "bits_per_weight", "cr")  # what fits an 80-column terminal


def print_tables(data: dict, console: Console, compare: bool) -> None:
    if "summary" in data:
        for line in summary_lines(data):
            console.print(_cell(line))
        console.print()
    columns = COLUMNS if console.width >= 140 else COMPACT
    t = Table(title=_cell(f"per layer ({data['model']['format']})"), show_lines=False)
    t.add_column("layer", overflow="fold")
    for c in columns:
        t.add_column(c.replace("_bytes", " B").replace("_", " "), justify="right")
    if columns is COLUMNS and any("reorder" in r for r in data["layers"]):
        t.add_column("union before reorder", justify="right")
    for r in data["layers"] + [data["model"]]:
        cells = [r["layer"]] + [_fmt(c, r.get(c)) for c in columns]
        if len(t.columns) > len(cells):
            ro = r.get("reorder")
            cells.append(_fmt("union_density", ro["union_density_before"]) if ro else
                         _fmt("union_density", r.get("union_density_before_reorder")))
        t.add_row(*map(_cell, cells), style="bold" if r["layer"] == "model" else None)
    console.print(t)
    if compare:
        b = Table(title="same masks, other encodings (model level)")
        b.add_column("format")
        for c in ("bits_per_weight", "total_bytes", "meta_bytes", "pmr", "cr"):
            b.add_column(c.replace("_", " "), justify="right")
        b.add_column("seed formula B", justify="right")
        rows = [data["model"]] + list(data["model_baselines"].values())
        for r in rows:
            cells = [r["format"], *[_fmt(c, r.get(c)) for c in ("bits_per_weight", "total_bytes", "meta_bytes",
                                                                "pmr", "cr")], _fmt("x_bytes", r.get("formula_bytes"))]
            b.add_row(*map(_cell, cells))
        console.print(b)
