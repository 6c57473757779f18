"""Encode one pruned 4-bit matrix as IE-BME with bitmap-aware row reordering, then as Tiled-CBC.

Run: python examples/encode_matrix.py [--m 256] [--k 512] [--sparsity 0.6]
"""

from __future__ import annotations

import argparse

import numpy as np
from unionsparse.formats import iebme, stats, tiled_cbc
from unionsparse.formats.arithmetic.weights import rtn
from unionsparse.solvers import reorder_matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--sparsity", type=float, default=0.6)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.m, args.k)).astype(np.float32)
    w[np.abs(w) < np.quantile(np.abs(w), args.sparsity)] = 0.0  # magnitude pruning
    q = rtn(w, bits=4, group_size=128)  # int8 codes in -8..7, fp16 scales [M, K/128]

    plain = iebme.encode(q.codes, bits=4, tile=(16, 64), areas=(2, 2))
    perm, report = reorder_matrix(q.codes != 0, tile=(16, 64), areas=(2, 2), method="dp")
    reordered = iebme.encode(q.codes, bits=4, tile=(16, 64), areas=(2, 2), perm=perm)
    assert np.array_equal(reordered.decode(), q.codes)  # decode() returns the original row order

    cbc = tiled_cbc.encode(q.codes, tile=(256, 16), bits=4)
    assert np.array_equal(cbc.decode(), q.codes)

    print(f"{args.m}x{args.k}, {100 * (q.codes == 0).mean():.1f}% zero codes")
    print(f"union density: {100 * report.density_before:.1f}% -> {100 * report.density_after:.1f}% after DP "
          f"reordering ({report.tiles_optimal} of {perm.shape[0]} tiles proven optimal)")
    for name, enc in (("ie-bme", plain), ("ie-bme+reorder", reordered), ("tiled-cbc", cbc)):
        s = stats(enc, group_size=128)
        print(f"{name:15s} {s['bits_per_weight']:6.3f} bits/weight  PMR {s['pmr']:6.2f}  CR {s['cr']:5.2f}x")


if __name__ == "__main__":
    main()
