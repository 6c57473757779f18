"""`inspect --plot`: per-layer figures of an artifact as one PNG (matplotlib, imported only here).

Three panels from :func:`unionsparse.compressor.report.tables.inspect_data` (``compare=True``): bits per weight
of the artifact's format beside CSR, Tiled-CSL, TCA-BME and dense b-bit on the same mask; PMR of the
sparse encodings (log scale); union density before and after row reordering (IE-BME).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from ..errors import UserError

FIG_SIZE = (12.0, 10.0)  # inches
DPI = 100  # -> 1200 x 1000 pixels
LEGEND = {"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.005, 1.0), "borderaxespad": 0.0}
SPARSE_BASELINES = ("csr", "tiled-csl", "tca-bme")
COLORS = {"ie-bme": "#1f77b4", "tiled-cbc": "#1f77b4", "csr": "#2ca02c", "tiled-csl": "#d62728",
          "tca-bme": "#9467bd",
          "before reorder": "#ff7f0e", "after reorder": "#1f77b4", "no reordering": "#1f77b4"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot/--html need matplotlib: pip install 'unionsparse[plots]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def short_name(layer: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> '3.q_proj'."""
    parts = layer.split(".")
    idx = next((p for p in parts if p.isdigit()), None)
    return f"{idx}.{parts[-1]}" if idx is not None else parts[-1]


def series(data: dict) -> dict[str, dict[str, list[float]]]:
    """Per-layer numbers the plot draws: {'bits': {fmt: [...]}, 'pmr': {...}, 'union': {...}}."""
    layers = data["layers"]
    fmt = data["model"]["format"] or "artifact"
    bits = {fmt: [r["bits_per_weight"] for r in layers]}
    pmr = {fmt: [r.get("pmr") for r in layers]}
    names = list(layers[0].get("baselines", {})) if layers else []
    for b in names:
        if b == "dense-fp16":
            continue
        bits[b] = [r["baselines"][b]["bits_per_weight"] for r in layers]
        if b in SPARSE_BASELINES:
            pmr[b] = [r["baselines"][b].get("pmr") for r in layers]
    union: dict[str, list[float]] = {}
    if layers and all("reorder" in r for r in layers):
        union["before reorder"] = [r["reorder"]["union_density_before"] for r in layers]
        union["after reorder"] = [r["reorder"]["union_density_after"] for r in layers]
    elif layers and all(r.get("union_density") is not None for r in layers):
        union["no reordering"] = [r["union_density"] for r in layers]
    return {"bits": bits, "pmr": pmr, "union": union}


def _finite(v) -> float:
    return float(v) if v is not None and math.isfinite(float(v)) else math.nan


def render(data: dict, dpi: int = DPI) -> bytes:
    """The PNG bytes of the three panels for ``data`` (needs the baselines: ``compare=True``)."""
    if not data["layers"]:
        raise UserError("--plot: the artifact has no compressed layers to plot")
    plt = _pyplot()
    s = series(data)
    labels = [short_name(r["layer"]) for r in data["layers"]]
    x = list(range(len(labels)))
    fig, axes = plt.subplots(3, 1, figsize=FIG_SIZE, dpi=dpi, sharex=True)
    try:
        ax = axes[0]
        own_fmt = data["model"]["format"]
        many = len(x) > 50  # a real model: 200+ layers, markers would hide the lines
        big, small, ms = ("o", ".", 2.5) if many else ("o", ".", 6.0)
        for name, ys in s["bits"].items():
            own = name == own_fmt
            ax.plot(x, ys, marker=(big if own else small), ms=ms, lw=2.2 if own else 1.2, label=name,
                    zorder=4 if name.startswith("dense") else 3 if own else 2,
                    color=COLORS.get(name, "#7f7f7f"), ls="--" if name.startswith("dense") else "-")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("bits per weight")
        ax.set_title(f"{Path(str(data['artifact'])).name} ({own_fmt}): per-layer storage, same masks")
        ax.legend(**LEGEND)
        ax.grid(alpha=0.3)

        ax = axes[1]
        for name, ys in s["pmr"].items():
            ax.plot(x, [_finite(v) for v in ys], marker=big if name == own_fmt else small, ms=ms, label=name,
                    color=COLORS.get(name, "#7f7f7f"), lw=2.2 if name == own_fmt else 1.2)
        ax.set_yscale("log")
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("PMR = B_w·NNZ / index B")
        ax.legend(**LEGEND)
        ax.grid(alpha=0.3, which="both")

        ax = axes[2]
        if s["union"]:
            for name, ys in s["union"].items():
                ax.plot(x, [100 * v for v in ys], marker=big, ms=ms, label=name, color=COLORS.get(name))
            ax.set_ylim(0, 105)
            ax.legend(**LEGEND)
        else:
            ax.text(0.5, 0.5, "no union mask (Tiled-CBC artifact)", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_ylabel("union density (%)")
        ax.grid(alpha=0.3)
        step = max(1, len(labels) // 40)
        ax.set_xticks(x[::step])
        ax.set_xticklabels(labels[::step], rotation=90, fontsize=7)
        ax.set_xlabel("layer (block.projection)")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_plot(data: dict, path: str | Path) -> Path:
    from ..files import atomic_write

    p = Path(path)
    if not p.parent.exists():
        raise UserError(f"--plot: folder {p.parent} does not exist")
    if p.suffix.lower() != ".png":
        raise UserError(f"--plot: {path} must end in .png")
    return atomic_write(p, render(data), "--plot")
