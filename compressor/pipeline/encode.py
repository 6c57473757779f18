"""One compressed layer reordered and encoded into its format: what the executor runs per layer."""

from __future__ import annotations

import numpy as np
import torch

from ...formats import baselines, stats
from ...solvers import reorder_matrix
from ..artifact.store import LayerRecord
from ..config import CompressConfig
from ..errors import UserError
from ..quantize.layer import QuantizedLayer
from ..quantize.outliers import add_side_figures

#: ``--reorder auto`` keeps a layer's row permutations only where they cut its stored union positions by at least
#: this fraction: what applying them costs the GPU kernel, measured (the LLaMA-2-7B decode step 13.7% slower with
#: them on an H100, 18-37% per layer at N = 1 on the H200 corpus; BENCHMARKS.md). At 50% unstructured sparsity the
#: exact DP saves about 5% (SmolLM2, magnitude) and 1.5% (random), so such layers store none. ``dp`` and ``cpsat``
#: keep what they find.
AUTO_MIN_GAIN = 0.14


def reorder_perms(codes: np.ndarray, cfg: CompressConfig, progress=None) -> tuple[np.ndarray | None, dict | None]:
    """Per-tile row permutations minimising the union mask (None when --reorder none, or with ``auto`` when they
    save less than :data:`AUTO_MIN_GAIN` of the union positions; the report then says what the search found).

    ``progress(n_done, n_total)`` is called as batches of tiles finish.
    """
    if cfg.reorder == "none":
        return None, None
    perm, r = reorder_matrix(codes != 0, tile=cfg.tile_shape, areas=cfg.area_grid, method=cfg.reorder,
                             progress=progress)
    gain = 1 - r.positions_after / r.positions_before if r.positions_before else 0.0
    kept = cfg.reorder != "auto" or gain >= AUTO_MIN_GAIN
    after = r.positions_after if kept else r.positions_before  # what is stored
    return (perm if kept else None), {
        "method": r.method, "methods": r.methods, "union_positions_before": r.positions_before,
        "union_positions_after": after, "union_positions_bound": r.positions_bound,
        "union_slots": r.capacity, "union_density_before": r.density_before,
        "union_density_after": after / r.capacity if r.capacity else 0.0, "tiles_optimal": r.tiles_optimal,
        "tiles_not_proven": r.tiles_not_proven,  # no wall time: identical inputs give identical bytes
        "kept": kept, "found_positions": r.positions_after,  # auto: the search's result, stored or not
    }


def encode_layer(name: str, w: torch.Tensor | QuantizedLayer, cfg: CompressConfig, progress=None) -> LayerRecord:
    """Reorder and encode one compressed layer: a QuantizedLayer, or float16 weights for ``--quant none``."""
    bits = cfg.bits
    attrs: dict = {"prune": cfg.prune, "quant": cfg.quant}
    if bits is None:
        values = w.to(torch.float16).numpy()
        if not np.isfinite(values).all():
            raise UserError(f"MODEL: layer {name} overflows float16; use --quant w4a16 or w4a4")
        enc = cfg.fmt.encode(values, bits=None, tile=cfg.tile_shape)
        scales, group = None, None
    else:
        if not isinstance(w, QuantizedLayer):
            raise TypeError(f"layer {name}: --quant {cfg.quant} layers arrive quantized (quantize_layer)")
        ql = w
        q = ql.qweight
        group = q.group_size
        scales = q.scales
        attrs["group_size"] = group
        if cfg.quant_mode.quantizes_activations:  # activation_scheme: how kernels quantize inputs
            attrs["activations"] = ql.activations
        perm, report = reorder_perms(q.codes, cfg, progress) if cfg.fmt.reorders_rows else (None, None)
        enc = cfg.fmt.encode(q.codes, bits=bits, tile=cfg.tile_shape, areas=cfg.area_grid, perm=perm)
        if report is not None:
            attrs["reorder"] = report
    s = stats(enc, group_size=group)
    mask = (q.codes != 0) if bits is not None else (w != 0).numpy()  # = enc.decode() != 0 (lossless)
    attrs["stats"] = s
    attrs["baselines"] = baselines(mask, 16 if bits is None else bits, group)
    if cfg.fmt.activation_sparsity:
        attrs["dp_threshold"] = None
    side = None if bits is None else ql.outliers  # --keep-outliers: the 8-bit side matrix, counted in stats
    if side is not None:
        add_side_figures(attrs, side, bits)
    return LayerRecord(name, enc, scales, attrs, side)
