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


def reorder_perms(codes: np.ndarray, cfg: CompressConfig, progress=None) -> tuple[np.ndarray | None, dict | None]:
    """Per-tile row permutations minimising the union mask (None when --reorder none).

    ``progress(n_done, n_total)`` is called as batches of tiles finish.
    """
    if cfg.reorder == "none":
        return None, None
    perm, r = reorder_matrix(codes != 0, tile=cfg.tile_shape, areas=cfg.area_grid, method=cfg.reorder,
                             progress=progress)
    return perm, {
        "method": r.method, "methods": r.methods, "union_positions_before": r.positions_before,
        "union_positions_after": r.positions_after, "union_positions_bound": r.positions_bound,
        "union_slots": r.capacity, "union_density_before": r.density_before,
        "union_density_after": r.density_after, "tiles_optimal": r.tiles_optimal,
        "tiles_not_proven": r.tiles_not_proven,  # no wall time: identical inputs give identical bytes
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
