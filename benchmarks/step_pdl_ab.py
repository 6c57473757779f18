"""Programmatic dependent launch of the step's kernels, off and on, on whole decode steps in one process.

With it (sm_90, the default there), each of the step's own kernels (norms and quantizing producers, rotary and
KV write, attention, SiLU·mul, act_quant, the outlier side product, IE-BME) is scheduled while the kernel before
it still runs and waits for it with ``griddepcontrol.wait`` (kernels/pdl.cuh); IE-BME also issues its weight-only
prologue before the wait. This script times `bench --e2e` cases with ``programmatic_launches(False)`` and with
the default, side by side (with the step checks on both), and writes both tables and the JSON:

    python benchmarks/step_pdl_ab.py --out DIR     (a CUDA machine; benchmarks/glue_h200.sh quick runs it)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unionsparse.compressor.bench.e2e import e2e_command, format_table
from unionsparse.kernels.cluster_launch import programmatic_launches

KINDS = "fp16,w4a16,iebme-w4a4-50-o128,iebme-w4a4-0-o128,iebme-w4a4-50-o128-dp,iebme-w4a4-50,iebme-w4a8-50"


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
    for label, on in (("pdl off", False), ("pdl on (default)", None)):
        with programmatic_launches(on):
            res = e2e_command(specs=args.spec, batches=args.batch, contexts=args.context, kinds=args.kinds,
                              hf_generate=False, checks=True)
        results[label] = res
        bad = [c["check"] for c in res["checks"] if not c["ok"]]
        print(f"== {label}" + (f"; CHECK FAILED: {', '.join(bad)}" if bad else ""))
        print(format_table(res), flush=True)
    (out / "step_pdl_ab.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "step_pdl_ab.md").write_text("\n\n".join(f"{k}\n\n{format_table(v)}" for k, v in results.items()) + "\n")


if __name__ == "__main__":
    main()
