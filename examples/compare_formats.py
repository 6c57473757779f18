"""Bits per weight of every encoding on the same 4-bit masks, across sparsities (smallest marked *).

Run: python examples/compare_formats.py [--m 512] [--k 512] [--sparsities 0.5,0.7,0.9]
"""

from __future__ import annotations

import argparse

import numpy as np
from unionsparse.formats import baselines, iebme, stats, tiled_cbc
from unionsparse.formats.arithmetic.weights import rtn
from unionsparse.solvers import reorder_matrix


def bits_per_weight(codes: np.ndarray, group: int) -> dict[str, float]:
    """bits/weight of IE-BME (DP-reordered), Tiled-CBC and the baselines on the mask of ``codes``."""
    perm, _ = reorder_matrix(codes != 0, tile=(16, 64), areas=(2, 2), method="dp")
    ie = iebme.encode(codes, 4, (16, 64), (2, 2), perm)
    cbc = tiled_cbc.encode(codes, tile=(256, 16), bits=4)
    out = {"ie-bme": stats(ie, group_size=group)["bits_per_weight"],
           "tiled-cbc": stats(cbc, group_size=group)["bits_per_weight"]}
    for name, s in baselines(codes != 0, 4, group).items():
        out[name] = s["bits_per_weight"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--sparsities", default="0.5,0.7,0.9")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.m, args.k)).astype(np.float32)
    rows = []
    for sp in (float(v) for v in args.sparsities.split(",")):
        wp = np.where(np.abs(w) >= np.quantile(np.abs(w), sp), w, 0.0)
        rows.append((sp, bits_per_weight(rtn(wp, 4, 128).codes, 128)))
    names = list(rows[0][1])
    print("sparsity " + " ".join(f"{n:>11s}" for n in names))
    for sp, bpw in rows:
        best = min((v, n) for n, v in bpw.items() if n != "dense-fp16")[1]
        print(f"{sp:8.2f} " + " ".join(f"{bpw[n]:10.3f}{'*' if n == best else ' '}" for n in names))


if __name__ == "__main__":
    main()
