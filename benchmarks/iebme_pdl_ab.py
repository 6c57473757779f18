"""The IE-BME kernel's programmatic dependent launch, off and on, on whole decode steps in one process.

With it (sm_90, the default there), an IE-BME launch starts while the producer of its input (the quantizing
norm, SiLU·mul or act_quant launch) still runs: its offsets, bitmaps, weight scales and first ring copies are
in flight before ``griddepcontrol.wait`` (kernels/iebme_spmm.cu). This script times `bench --e2e` cases with
``LaunchSettings(pdl=False)`` and with the default, side by side, and writes both tables and the JSON:

    python benchmarks/iebme_pdl_ab.py --out DIR     (a CUDA machine; benchmarks/glue_h200.sh quick runs it)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unionsparse.compressor.bench.e2e import e2e_command, format_table
from unionsparse.compressor.bench.kernels import apply_overrides

KINDS = "w4a16,iebme-w4a4-50-o128,iebme-w4a4-0-o128,iebme-w4a4-50"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="llama2-7b")
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", default="512")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, variant, checks in (("pdl off", {"PDL": "0"}, False), ("pdl on (default)", {}, True)):
        apply_overrides(variant)
        res = e2e_command(specs=args.spec, batches=args.batch, contexts=args.context, kinds=args.kinds,
                          hf_generate=False, checks=checks)
        results[label] = res
        bad = [c["check"] for c in res["checks"] if not c["ok"]]
        print(f"== {label}" + (f"; CHECK FAILED: {', '.join(bad)}" if bad else ""))
        print(format_table(res), flush=True)
    (out / "iebme_pdl_ab.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "iebme_pdl_ab.md").write_text("\n\n".join(f"{k}\n\n{format_table(v)}" for k, v in results.items()) + "\n")


if __name__ == "__main__":
    main()
