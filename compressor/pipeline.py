"""`compress`: model -> prune -> quantize -> reorder -> encode -> artifact, one decoder block at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..formats import baselines, iebme, stats, tiled_cbc
from . import layerwise, pruning, safety
from .artifact import ArtifactWriter, LayerRecord, new_root_attrs
from .cluster import LayerEncoder
from .config import CompressConfig, parse_nm
from .dp_calib import DPCalibrator
from .errors import UserError
from .layer_quant import QuantizedLayer, TokenTap, hessian_kind, quantize_layer, spec_from_config
from .model_io import block_linears, find_blocks
from .outliers import add_side_figures, check_outlier_count
from .progress import Reporter
from .streaming import StreamingModel, block_loader, layer_weight, model_dense_tensors, open_model


@dataclass
class LayerTotals:
    """Model-level sums over the compressed layers."""

    weights: int = 0
    nnz: int = 0
    total_bytes: int = 0
    payload_bytes: int = 0
    meta_bytes: int = 0
    scale_bytes: int = 0
    union_before: int = 0
    union_after: int = 0
    union_slots: int = 0
    layers: dict = field(default_factory=dict)

    def add(self, name: str, attrs: dict) -> None:
        s = attrs["stats"]
        m, k = s["shape"]
        self.weights += m * k
        for key in ("nnz", "total_bytes", "payload_bytes", "meta_bytes", "scale_bytes"):
            setattr(self, key, getattr(self, key) + s[key])
        r = attrs.get("reorder")
        if r:
            self.union_before += r["union_positions_before"]
            self.union_after += r["union_positions_after"]
            self.union_slots += r["union_slots"]
        self.layers[name] = {"format": attrs["format"], "shape": [m, k], "bits": attrs["bits"]}

    def summary(self) -> dict:
        w = max(self.weights, 1)
        out = {
            "layers": len(self.layers), "weights": self.weights, "nnz": self.nnz,
            "sparsity": 1 - self.nnz / w, "total_bytes": self.total_bytes,
            "payload_bytes": self.payload_bytes, "meta_bytes": self.meta_bytes,
            "scale_bytes": self.scale_bytes, "bits_per_weight": self.total_bytes * 8 / w,
            "cr": 2 * self.weights / max(self.total_bytes, 1),
        }
        if self.union_slots:
            out["union_density_before"] = self.union_before / self.union_slots
            out["union_density_after"] = self.union_after / self.union_slots
        return out


def prune_weight(w: torch.Tensor, cfg: CompressConfig, sparsity: float, calib_stats: dict | None):
    """Dispatch to one pruning method. Returns (pruned weight, kept mask)."""
    nm = parse_nm(cfg.nm) if cfg.nm else None
    if cfg.prune == "none" or (sparsity == 0 and nm is None):
        return w, w != 0
    if cfg.prune == "magnitude":
        mask = pruning.magnitude(w, sparsity, nm=nm)
        return w * mask, mask
    if calib_stats is None:
        raise RuntimeError(f"--prune {cfg.prune} needs calibration statistics")
    if cfg.prune == "wanda":
        mask = pruning.wanda(w, calib_stats["x_sq_norm"], sparsity, nm=nm)
        return w * mask, mask
    w2, mask = pruning.sparsegpt(w, calib_stats["H"], sparsity, nm=nm)
    return w2, mask


def reorder_perms(codes: np.ndarray, cfg: CompressConfig, progress=None) -> tuple[np.ndarray | None, dict | None]:
    """Per-tile row permutations minimising the union mask (None when --reorder none).

    ``progress(n_done, n_total)`` is called as batches of tiles finish.
    """
    if cfg.reorder == "none":
        return None, None
    from ..solvers import reorder_matrix

    perm, r = reorder_matrix(codes != 0, tile=cfg.tile_shape, areas=cfg.area_grid, method=cfg.reorder,
                             progress=progress)
    return perm, {
        "method": r.method, "methods": r.methods, "union_positions_before": r.positions_before,
        "union_positions_after": r.positions_after, "union_positions_bound": r.positions_bound,
        "union_slots": r.capacity, "union_density_before": r.density_before,
        "union_density_after": r.density_after, "tiles_optimal": r.tiles_optimal,
        "tiles_not_proven": r.tiles_not_proven, "seconds": r.wall_s,
    }


def encode_layer(name: str, w: torch.Tensor | QuantizedLayer, cfg: CompressConfig, progress=None) -> LayerRecord:
    """Quantize (round to nearest, unless ``w`` comes already quantized) and encode one pruned layer."""
    bits = cfg.bits
    attrs: dict = {"prune": cfg.prune, "quant": cfg.quant}
    if bits is None:
        values = w.to(torch.float16).numpy()
        if not np.isfinite(values).all():
            raise UserError(f"MODEL: layer {name} overflows float16; use --quant w4a16 or w4a4")
        enc = tiled_cbc.encode(values, tile=cfg.tile_shape)
        scales, group = None, None
    else:
        ql = w if isinstance(w, QuantizedLayer) else quantize_layer(w, spec_from_config(cfg))
        q = ql.qweight
        group = q.group_size
        scales = q.scales
        safety.check_scales(name, scales, cfg.quant)  # verify rejects scales that overflow fp16
        if ql.outliers is not None:
            safety.check_scales(name, ql.outliers.scales, cfg.quant, "outlier scales")
        attrs["group_size"] = group
        if cfg.act_bits is not None:  # act_quant.activation_scheme: how kernels quantize inputs
            attrs["activations"] = ql.activations
        if cfg.format == "ie-bme":
            perm, report = reorder_perms(q.codes, cfg, progress)
            enc = iebme.encode(q.codes, bits, cfg.tile_shape, cfg.area_grid, perm)
            if report is not None:
                attrs["reorder"] = report
        else:
            enc = tiled_cbc.encode(q.codes, tile=cfg.tile_shape, bits=bits)
    s = stats(enc, group_size=group)
    mask = (q.codes != 0) if bits is not None else (w != 0).numpy()  # = enc.decode() != 0 (lossless)
    attrs["stats"] = s
    attrs["baselines"] = baselines(mask, 16 if bits is None else bits, group)
    if cfg.format == "tiled-cbc":
        attrs["dp_threshold"] = None
    side = None if bits is None else ql.outliers  # --keep-outliers: the 8-bit side matrix, counted in stats
    if side is not None:
        add_side_figures(attrs, side, bits)
    return LayerRecord(name, enc, scales, attrs, side)


def to_storage_dtype(t: torch.Tensor) -> np.ndarray:
    """Dense tensors are kept as float16 unless a value would overflow it."""
    a = t.detach().float().numpy()
    h = a.astype(np.float16)
    return h if np.isfinite(h).all() == np.isfinite(a).all() else a


def compress(cfg: CompressConfig, reporter: Reporter) -> dict:
    """Run the whole job; returns the model-level summary. Bad input raises UserError with nothing left."""
    cfg.validate()
    t0 = time.perf_counter()
    out = Path(cfg.output)
    recipe = {**cfg.to_dict(), "model": safety.model_reference(cfg.model)}  # absolute: eval works elsewhere
    safety.check_output(out, cfg.model, cfg.overwrite, cfg.resume, recipe)  # what -o may replace, writable
    # safetensors folders stream (meta skeleton; one layer, or with calibration one block, in memory)
    with reporter.stage(f"loading {Path(cfg.model).name}", total=None):
        loaded = open_model(cfg.model, forward=cfg.needs_calibration or cfg.sparsity_profile == "owl")
    load = block_loader(loaded)  # streaming: fills a block's (or the embeddings') weights in while it runs
    model = loaded.model
    blocks, prefix = find_blocks(model)
    check_outlier_count(cfg.keep_outliers, {f"{prefix}.{i}.{n}": lin.weight.shape[1]
                                            for i, b in enumerate(blocks) for n, lin in block_linears(b)})
    safety.check_loaded_model(cfg, out, loaded, blocks, prefix)  # context, memory, disk, finite dense tensors
    writer = ArtifactWriter(out, new_root_attrs(recipe["model"], loaded.fingerprint, recipe, loaded.config),
                            resume=cfg.resume, overwrite=cfg.overwrite)
    totals = LayerTotals()
    encoder = None
    try:
        encoder = LayerEncoder(cfg, writer.write_layer, totals.add, reporter.note)  # inline or on Dask
        plan = layerwise.calibration_plan(  # calibration windows, statistics kind, per-block sparsity (OWL)
            model, cfg.model, cfg.prune, cfg.sparsity, cfg.sparsity_profile, cfg.calib, cfg.nsamples,
            cfg.seqlen, cfg.seed, cfg.device, note=reporter.note, nm=cfg.nm, load=load,
        )
        done = writer.completed_layers()
        compressed: set[str] = set()
        names = [(i, n) for i, b in enumerate(blocks) for n, _ in block_linears(b)]
        with reporter.stage("blocks", total=len(blocks)) as block_bar, \
                reporter.stage("layers (prune, quantize, encode, write)", total=len(names)) as bar, \
                reporter.stage("reordering tiles of the current layer", total=None) as tile_bar:
            encoder.reorder_progress = tile_bar.update
            # each block's statistics come from the outputs of the already-pruned blocks before it
            kind = hessian_kind(plan.kind) if cfg.gptq or cfg.clip_search else plan.kind  # GPTQ needs H
            # a token sample of every layer's input calibrates its activation clip ratio
            tap = (TokenTap(blocks, block_linears, prefix)
                   if kind is not None and cfg.act_bits else None)
            # --dp-sparsity: TEAL thresholds from their own calibration stream through the pruned blocks; a
            # block's layers are then submitted at the block's end, once its thresholds are known
            with layerwise.non_block_weights(model, load if cfg.dp_sparsity > 0 else None):
                dp = (DPCalibrator(model, cfg.dp_calib, cfg.model, cfg.nsamples, cfg.seqlen, cfg.seed,
                                   cfg.dp_sparsity, cfg.dp_profile, cfg.device, reporter.note)
                      if cfg.dp_sparsity > 0 else None)
            later: list = []
            dp_extra: dict[str, dict] = {}

            def emit(fn, *args) -> None:  # writes stay in layer order either way
                if dp is None:
                    fn(*args)
                else:
                    later.append((fn, args))

            streamed = isinstance(loaded, StreamingModel)
            forward = kind is not None or dp is not None  # blocks run: streaming fills each one in
            blocks_iter = layerwise.calibrated_blocks(
                model, plan.samples, kind, "meta" if streamed and not forward else cfg.device,
                load if forward else None)
            for i, block, block_stats in blocks_iter:
                for sub, lin in block_linears(block):
                    full = f"{prefix}.{i}.{sub}"
                    compressed.add(f"{full}.weight")
                    if full in done and streamed and not forward:  # nothing later needs its weight
                        emit(encoder.done, full, writer.layer_attrs(full))
                        bar.advance()
                        continue
                    w = layer_weight(loaded, full, lin)
                    if not torch.isfinite(w.sum()) and not torch.isfinite(w).all():  # a finite sum: all finite
                        raise UserError(f"MODEL: layer {full} has NaN or inf weights")
                    st = block_stats.pop(sub, None)
                    w_pruned, mask = prune_weight(w, cfg, plan.block_sparsity[i], st)
                    tokens = tap.pop(full) if tap is not None else None
                    ql = None
                    if (st is not None or dp is not None) and cfg.bits is not None and full not in done:
                        ql = quantize_layer(w_pruned, spec_from_config(cfg), mask=mask, h=st and st.H,
                                            x_sq_norm=st and st.x_sq_norm, tokens=tokens)
                        w_pruned = torch.from_numpy(ql.dequantize())  # later blocks see it quantized
                    if not lin.weight.is_meta:
                        lin.weight.data.copy_(w_pruned.to(lin.weight.dtype))
                    w_pruned = w_pruned.cpu()
                    if full in done:
                        emit(encoder.done, full, writer.layer_attrs(full))
                    else:
                        extra: dict = {}
                        if dp is not None:
                            dp_extra[full] = extra  # receives the layer's threshold at the block's end
                        emit(encoder.submit, full, w_pruned if ql is None else ql, cfg, extra)  # in layer order
                    del w, w_pruned  # one layer in memory at a time
                    bar.advance()
                if dp is not None:  # the block is pruned: calibrate its thresholds, then write its layers
                    taus = dp.block(block, {sub: f"{prefix}.{i}.{sub}" for sub, _ in block_linears(block)})
                    for full, extra in dp_extra.items():
                        extra.update(taus[full])
                    for fn, args in later:
                        fn(*args)
                    dp_extra.clear()
                    later.clear()
                block_bar.advance()
            encoder.finish()
            if tap is not None:
                tap.close()
        dense, tied = model_dense_tensors(loaded, compressed)
        with reporter.stage("writing dense tensors", total=len(dense)) as bar:
            for name, t in dense.items():
                writer.write_dense({name: to_storage_dtype(t)})
                bar.advance()
        summary = totals.summary()
        summary["seconds"] = time.perf_counter() - t0
        writer.finalize({"layers": totals.layers, "dense": sorted(dense), "tied": tied, "summary": summary,
                         "block_prefix": prefix, "n_blocks": len(blocks),
                         "block_sparsity": plan.block_sparsity, "calibration": plan.info,
                         **({"dynamic_pruning": dp.info} if dp is not None else {})})
    except UserError:
        writer.abort()
        raise
    except OSError as e:  # a full disk or a read-only file system while writing: bad input, nothing left
        if not safety.is_environment_error(e, out):
            raise
        writer.abort()
        raise UserError(f"-o: cannot write {out}: {e.strerror or e}") from None
    finally:
        if encoder is not None:
            encoder.close()
    return summary

