"""Print the rows of a device run's agreement.jsonl (benchmarks/gpu_check_h200.sh) as one Markdown table."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def main(path: str) -> None:
    p = Path(path)
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
    cols = ["case", "fuse", "run", "ops", "max_err", "tol", "ratio", "ok", "tokens_agree", "first_near_tie",
            "gpu_vs_cpu16", "cpu16_vs_cpu32", "cpu_ppl", "gpu_ppl", "ppl", "seconds", "load_seconds",
            "windows_seconds", "first_window_seconds", "later_window_seconds"]
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
