"""IE-BME launch settings on the H200 over the SpInfer corpus, every variant in one run.

    python benchmarks/tune_iebme_warps.py [--out DIR] [--ns 1,2,4,8] [--warps 4,5,6,7,8] [--splits 0]
    python benchmarks/tune_iebme_warps.py --variants "WARPS=8,MINB=5,XBYTES=6144;WARPS=8" ...

A variant sets fields of kernels.iebme_spmm.LaunchSettings or a study build of the kernel
(``launch_variants.py``; ``--warps 4,8`` is short for ``--variants "WARPS=4;WARPS=8"``; an empty variant is the
shipped default). For each shape and N every variant is timed
(CUDA-graph replays, weights rotated beyond L2) with the chunk ``chunk_for`` picks for it (``--splits 0``)
or, with ``--splits S``, with each of the S smallest split counts along K that the launch allows; grid,
chunk and registers are recorded so a launch rule can be fitted offline. Writes DIR/--name (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_variants import apply_overrides, parse_overrides  # noqa: E402 - beside this script

parse_variants = parse_overrides  # the name the command line and tests know


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--ns", default="1,2,4,8", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--warps", default="4,5,6,7,8", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--variants", type=parse_variants, default=None, help="overrides instead of --warps")
    ap.add_argument("--bits", default=4, type=int, choices=(2, 4))
    ap.add_argument("--splits", default=0, type=int, help="time the S smallest split counts (0: chunk_for's pick)")
    ap.add_argument("--name", default="iebme_tune_warps.json")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds after which no new shape starts")
    args = ap.parse_args()
    variants = args.variants if args.variants is not None else [{"WARPS": str(w)} for w in args.warps]

    import cupy as cp
    from unionsparse.compressor.bench.kernels import n_copies, spinfer_shapes, synth_layer, time_iebme
    from unionsparse.kernels import iebme_spmm as ks

    t0 = time.time()
    rows = []
    for label, m, k in spinfer_shapes():
        if time.time() - t0 > args.budget:
            print(f"budget reached before {label}", flush=True)
            break
        one = synth_layer(m, k, args.bits, 0.5, "none", 128, 0)
        nb = int(one.values.nbytes + one.bitmaps.nbytes)
        layers = [one] + [synth_layer(m, k, args.bits, 0.5, "none", 128, i) for i in range(1, n_copies(nb))]
        for n in args.ns:
            line = []
            for v in variants:
                tag = apply_overrides(v)
                chunks = [None]
                if args.splits:
                    s0 = -(-one.tc // ks.max_chunk(one, n))
                    chunks = sorted({ks.chunk_for(one, n, splits=s) for s in range(s0, s0 + args.splits)}, reverse=True)
                for c in chunks:
                    splits = None if c is None else -(-one.tc // c)
                    t, _ = time_iebme(layers, n, splits=splits)
                    p = ks.plan(one, n, splits)
                    chunk = p.chunk
                    rows.append({"shape": label, "M": m, "K": k, "N": n, "bits": args.bits, "variant": tag,
                                 "warps": p.warps, "minb": p.minb, "us": t * 1e6, "chunk": chunk,
                                 "grid": list(p.grid), "ctas_per_sm": ks.ctas_per_sm(one, n, chunk, p.warps),
                                 "regs": ks._kernel(args.bits, -(-n // 8), False, False, p.nstage, p.warps, p.ilp,
                                                    p.minb).num_regs})
                    line.append(f"{tag}/c{chunk} {t * 1e6:.1f}")
            print(f"{label} {m}x{k} N={n}: " + " ".join(line), flush=True)
        del layers, one
        cp.get_default_memory_pool().free_all_blocks()
    apply_overrides({})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = cp.cuda.runtime.getDeviceProperties(0)
    meta = {"machine": dev["name"].decode(), "cupy": cp.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/tune_iebme_warps.py " + " ".join(sys.argv[1:])}
    (out / args.name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
