"""Same-run comparison of spMspV v2 launch settings and value decodes over the SpInfer corpus (H200).

    python benchmarks/study_spmspv_modes.py [--statics 0.5,0.3] [--quick] [--out DIR] [--name study.json]
        [--baseline old_tiled_cbc_spmspv.cu ...] [--bits 16|4|2]

Every setting is timed on every shape in the same process beside cuBLAS fp16 GEMV (``bench_spmspv`` of
``unionsparse.compressor.bench.tiled_cbc``: CUDA graphs, weights rotated beyond L2, median), after a reference
check of its output; the summary is the geomean speedup over cuBLAS per setting and its geomean ratio
to split-K with the default warps and stages (``w4/d2/x1/m0``; ``w4/d3/x1/m0`` for b-bit codes, ``--bits``:
random nonzero codes with fp16 scales per 128 inputs). Settings are ``warps/stages/scale/mode``
plus ``/sk`` (stream-K launch) or ``/auto`` (the shipped rule, ``use_streamk``); see
``kernels/tiled_cbc_spmspv.cu`` for the modes; scale < 1 makes several waves of smaller blocks. Edit
SETTINGS (or the kernel's instantiations) to compare other variants; docs/kernels.md lists what was tried.
A ``--baseline`` file must have the current kernel's template parameters and arguments (since 2026-12-07 the
input-row count NR and the ``nrows, ldx`` arguments): the launcher names those instantiations.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SETTINGS = (  # warps, stages, scale, mode, stream-K (None: the default rule, use_streamk)
    (4, 2, 1.0, 0, False), (4, 2, 1.0, 0, True), (4, 2, 1.0, 0, None),
    (8, 2, 1.0, 0, False), (8, 2, 1.0, 0, True),
    (4, 2, 1.0, 3, False), (4, 2, 1.0, 3, True), (4, 2, 1.0, 3, None), (8, 2, 1.0, 3, True),
)
BASE = "w4/d2/x1/m0"
SETTINGS_CODES = ((4, 3, 1.0, 0, False), (4, 3, 1.0, 0, True), (4, 3, 1.0, 0, None))  # the int4/int2 build
SETTINGS_INT4 = SETTINGS_CODES + ((4, 3, 1.0, 4, False), (4, 3, 1.0, 4, True), (4, 3, 1.0, 4, None))  # + mode 4
BASE_CODES = "w4/d3/x1/m0"


def _statics(text: str) -> list[float]:
    try:
        v = [float(t) for t in text.split(",")]
    except ValueError:
        v = []
    if not v or not all(0.0 <= s < 1.0 for s in v):
        raise argparse.ArgumentTypeError(f"expected sparsities in [0, 1) separated by commas, got {text!r}")
    return v


def summarize(rows: list[dict], base: str = BASE) -> dict:
    """Per setting: geomean speedup vs cuBLAS and geomean time ratio to ``base``, over the shapes timing both."""
    out = {}
    keys = sorted({k for r in rows for k in r["tried_by_setting_us"]})
    for k in keys:
        rr = [r for r in rows if k in r["tried_by_setting_us"] and base in r["tried_by_setting_us"]]
        if not rr:
            continue
        sp = [r["t_cublas_us"] / r["tried_by_setting_us"][k] for r in rr]
        ratio = [r["tried_by_setting_us"][base] / r["tried_by_setting_us"][k] for r in rr]
        out[k] = dict(speedup=float(np.exp(np.mean(np.log(sp)))), vs_default=float(np.exp(np.mean(np.log(ratio)))),
                      min_vs_default=float(min(ratio)), max_vs_default=float(max(ratio)), n=len(rr))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--statics", type=_statics, default=[0.5, 0.3])
    ap.add_argument("--quick", action="store_true", help="4 shapes")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="tiled_cbc_h200_spmspv_modes.json")
    ap.add_argument("--baseline", action="append", default=[], help="another revision of kernels/"
                    "tiled_cbc_spmspv.cu (repeatable): its split-K and default launches are timed too, labelled "
                    "/<file stem> (a study build, kernels/study.py)")
    ap.add_argument("--bits", type=int, choices=(16, 4, 2), default=16,
                    help="values: 16 (fp16) or b-bit codes with fp16 scales per 128 inputs")
    args = ap.parse_args(argv)
    for b in args.baseline:
        if not Path(b).is_file():
            ap.error(f"--baseline {b!r} is not a file")
    import cupy as cp
    import torch
    from unionsparse.compressor.bench.tiled_cbc import SPINFER, bench_spmspv, machine_info
    from unionsparse.kernels import study
    from unionsparse.kernels.tiled_cbc_spmspv import KERNEL

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    settings, base = ((SETTINGS, BASE) if args.bits == 16 else (SETTINGS_INT4, BASE_CODES) if args.bits == 4
                      else (SETTINGS_CODES, BASE_CODES))
    cands = [dict(warps=w, stages=s, scale=x, mode=m, streamk=k) for w, s, x, m, k in settings]
    for b in args.baseline:
        build = study.Build(source=str(Path(b).resolve()))
        cands += [dict(warps=4, stages=settings[0][1], scale=1.0, mode=0, streamk=k, tag=f"/{Path(b).stem}",
                       within=lambda build=build: study.building(KERNEL, build)) for k in (False, None)]
    res = dict(command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
               machine=machine_info(cp, torch), bits=args.bits, settings=[list(s) for s in settings], runs={})
    shapes = SPINFER[:4] if args.quick else SPINFER
    for s in args.statics:
        rows = bench_spmspv(cp, torch, shapes, (s,), 0.3, log, candidates=cands, bits=args.bits)
        summ = summarize(rows, base)
        res["runs"][f"{s:g}"] = dict(rows=rows, summary=summ)
        for k, v in sorted(summ.items(), key=lambda kv: -kv[1]["speedup"]):
            log(f"SUMMARY static {s:.0%} + dynamic 30% {k}: {v['speedup']:.3f}x cuBLAS, "
                f"{v['vs_default']:.3f} vs {base} ({v['min_vs_default']:.2f}-{v['max_vs_default']:.2f}, n={v['n']})")
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
