"""Measured figures kept beside an artifact: ``OUT.zarr.figures.json``.

``eval --record`` (perplexity, task accuracy) and the benchmarks (time per token) write what they measured
here, next to the store and never inside it, so the checksummed artifact is not altered and ``verify`` is
unaffected; ``inspect`` leads with them. Each entry is keyed by what was measured and on what, and carries the
tool version and the time of the measurement; a newer measurement of the same key replaces the older one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import UserError
from ..files import atomic_write

SUFFIX = ".figures.json"
MAX_BYTES = 4 << 20  # a sidecar larger than this is not ours


def figures_path(artifact: str | Path) -> Path:
    p = Path(artifact)
    return p.with_name(p.name + SUFFIX)


def read_figures(artifact: str | Path) -> dict:
    """The recorded figures ({} when none); a sidecar that is not ours is ignored, never trusted."""
    p = figures_path(artifact)
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > MAX_BYTES:
            return {}
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("unionsparse_figures") == 1 else {}


def record(artifact: str | Path, kind: str, key: str, value: dict) -> Path:
    """Add (or replace) one measurement ``figures[kind][key] = value`` beside the artifact; returns the path."""
    from ..artifact.store import tool_version

    p = figures_path(artifact)
    if p.is_symlink() or (p.exists() and not p.is_file()):
        raise UserError(f"--record: {p} is not a regular file; not written")
    if p.exists() and not read_figures(artifact):
        raise UserError(f"--record: {p} exists and is not a unionsparse figures file; not written")
    data = read_figures(artifact) or {"unionsparse_figures": 1}
    entry = {**value, "tool_version": tool_version(), "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    data.setdefault(kind, {})[key] = entry
    return atomic_write(p, json.dumps(data, indent=2, sort_keys=True), "--record")
