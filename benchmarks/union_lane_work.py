"""How a warp's work per IE-BME tile would scale with sparsity under three decode schedules (issue 37; CPU only).

A default tile's union mask is 8 rows x 32 bits; today's kernel gives each of the 32 lanes one 8-bit segment and
decodes all 8 positions whatever they hold, so its work per tile is constant. Two schedules whose work depends on
the mask, modelled on random masks at the union densities users get (unstructured pruning: 1 - s^4 of the positions
are active; union-structured, ``--structure union``: 1 - s):

* per-segment set bits: each lane loops over its own segment's set bits; the warp takes as long as its fullest lane;
* balanced ranks: lane l takes active positions l, l + 32, ... of the whole tile (position from its rank by a
  select), so the warp runs ceil(P / 32) rounds for P active positions: proportional to the bytes.

Printed: the mean work per tile relative to today's 8 positions a lane, beside the share of active positions (the
tile's value bytes relative to a dense tile's). Run: ``python benchmarks/union_lane_work.py [--tiles N]``.
"""

from __future__ import annotations

import argparse

import numpy as np

CASES = (("unstructured 50%", 1 - 0.5 ** 4), ("unstructured 70%", 1 - 0.7 ** 4), ("unstructured 90%", 1 - 0.9 ** 4),
         ("union-structured 50%", 0.5), ("union-structured 70%", 0.3), ("union-structured 90%", 0.1))


def lane_work(density: float, tiles: int, rng: np.random.Generator) -> tuple[float, float]:
    """(per-segment set bits, balanced ranks): mean rounds a tile over 8 (today's rounds a lane)."""
    seg = rng.random((tiles, 32, 8)) < density
    per_segment = seg.sum(-1).max(-1).mean() / 8
    balanced = np.ceil(seg.sum((1, 2)) / 32).mean() / 8
    return float(per_segment), float(balanced)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=100_000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| masks | active union positions (value bytes vs dense) | per-segment set bits | balanced ranks |")
    print("|---|---|---|---|")
    for label, d in CASES:
        seg, bal = lane_work(d, args.tiles, rng)
        print(f"| {label} | {d:.2f} | {seg:.2f} | {bal:.2f} |")


if __name__ == "__main__":
    main()
