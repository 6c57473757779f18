"""`compress`: model -> prune -> quantize -> reorder -> encode -> artifact, one decoder block at a time."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...formats.errors import UnionsparseError
from .. import preflight
from ..activation_sparsity.calibrate import ThresholdCalibrator, announce
from ..artifact.store import ArtifactWriter, new_root_attrs
from ..artifact.tokenizer import store_tokenizer
from ..calibrate import layerwise
from ..config import CompressConfig
from ..errors import UserError
from ..files import cannot_write, environment_errors, is_environment_error
from ..layer_rules import describe as describe_rules
from ..layer_rules import resolve as resolve_rules
from ..model.loading import LoadedModel, block_linears, find_blocks
from ..model.shared_inputs import shared_input_sets
from ..model.streaming import StreamingModel, block_loader, model_dense_tensors, open_model, source_weight
from ..output_lock import output_lock
from ..progress import Reporter
from ..pruning.dispatch import prune_layer
from ..quantize.act_clip import shared_act_clip
from ..quantize.layer import QuantizedLayer, hessian_kind, quantize_layer, spec_from_config
from ..quantize.outliers import check_outlier_count
from .executor import LayerEncoder


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
    dense_linears: dict = field(default_factory=dict)

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

    def add_dense(self, name: str, shape: tuple[int, int]) -> None:
        """A decoder linear kept dense by the per-layer rules: counted as fp16 in the model's figures."""
        m, k = shape
        self.weights += m * k
        self.nnz += m * k
        self.total_bytes += 2 * m * k
        self.payload_bytes += 2 * m * k
        self.dense_linears[name] = [m, k]

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
        if self.dense_linears:
            out["dense_linears"] = len(self.dense_linears)
        return out


def to_storage_dtype(t: torch.Tensor) -> np.ndarray:
    """Dense tensors are kept as float16 unless a value would overflow it."""
    a = t.detach().float().numpy()
    h = a.astype(np.float16)
    return h if np.isfinite(h).all() == np.isfinite(a).all() else a


@dataclass
class _Run:
    """One compress run: what its steps share."""

    cfg: CompressConfig
    reporter: Reporter
    loaded: StreamingModel | LoadedModel
    writer: ArtifactWriter
    encoder: LayerEncoder
    totals: LayerTotals
    blocks: list
    prefix: str
    done: set[str] = field(default_factory=set)  # layers already in the store (--resume)
    compressed: set[str] = field(default_factory=set)  # state_dict names of the compressed weights
    layer_cfg: dict[str, CompressConfig | None] = field(default_factory=dict)  # per-layer rules; None: dense
    activation_sparsity_info: dict | None = None  # TEAL calibration record, when thresholds were calibrated

    @property
    def streamed(self) -> bool:
        return isinstance(self.loaded, StreamingModel)


def compress(cfg: CompressConfig, reporter: Reporter) -> dict:
    """Run the whole job; returns the model-level summary. Bad input raises UserError with nothing left."""
    cfg.validate()
    t0 = time.perf_counter()
    out = Path(cfg.output)
    recipe = {**cfg.to_dict(), "model": preflight.model_reference(cfg.model)}  # absolute: eval works elsewhere
    preflight.check_output(out, cfg.model, cfg.overwrite, cfg.resume, recipe)  # what -o may replace, writable
    with output_lock(out, "-o"):  # one writer per output: a second run is refused, nothing of the first lost
        return _compress(cfg, reporter, out, recipe, t0)


def _compress(cfg: CompressConfig, reporter: Reporter, out: Path, recipe: dict, t0: float) -> dict:
    loaded = load_source(cfg, reporter)
    blocks, prefix = find_blocks(loaded.model)
    in_features = {f"{prefix}.{i}.{n}": lin.weight.shape[1]
                   for i, b in enumerate(blocks) for n, lin in block_linears(b)}
    if cfg.keep_outliers != "auto":  # auto leaves at least 3/4 of every layer's channels
        check_outlier_count(int(cfg.keep_outliers), in_features)
    layer_cfg = layer_configs(cfg, list(in_features))  # per-layer rules, checked against the model's layers
    preflight.check_loaded_model(cfg, out, loaded, blocks, prefix)  # context, memory, disk, finite dense tensors
    with environment_errors("-o", out):  # the writer removes a partial it began itself
        writer = ArtifactWriter(out, new_root_attrs(recipe["model"], loaded.fingerprint, recipe, loaded.config),
                                resume=cfg.resume, overwrite=cfg.overwrite)
    totals = LayerTotals()
    encoder = None
    try:
        encoder = LayerEncoder(cfg, writer.write_layer, totals.add, reporter.note)  # inline or on Dask
        run = _Run(cfg, reporter, loaded, writer, encoder, totals, blocks, prefix, writer.completed_layers(),
                   layer_cfg=layer_cfg)
        plan = layerwise.calibration_plan(  # calibration windows, statistics kind, per-block sparsity (OWL)
            loaded.model, cfg.model, cfg.prune, cfg.sparsity, cfg.sparsity_profile, cfg.calib, cfg.nsamples,
            cfg.seqlen, cfg.seed, cfg.device, note=reporter.note, nm=cfg.nm, load=block_loader(loaded),
            outliers=cfg.uses_outliers,
        )
        compress_blocks(run, plan)
        dense, tied = write_dense(run)
        with reporter.stage("storing the tokenizer", total=None):  # generate needs nothing but the artifact
            reporter.note(store_tokenizer(writer.tmp, cfg.model, loaded.config))
        summary = totals.summary()  # no timings in the store: identical inputs give identical bytes
        writer.finalize({"layers": totals.layers, "dense": sorted(dense), "tied": tied, "summary": summary,
                         "block_prefix": prefix, "n_blocks": len(blocks),
                         "layer_rules": describe_rules(layer_cfg, cfg),
                         "block_sparsity": plan.block_sparsity, "calibration": plan.info,
                         **({"dynamic_pruning": run.activation_sparsity_info} if cfg.act_sparsity > 0 else {})})
    except UnionsparseError:
        writer.abort()
        raise
    except OSError as e:  # a full disk or a read-only file system while writing: bad input, nothing left
        if not is_environment_error(e, out):
            raise
        writer.abort()
        raise cannot_write("-o", out, e) from None
    finally:
        if encoder is not None:
            encoder.close()
    return {**summary, "seconds": time.perf_counter() - t0}


def layer_configs(cfg: CompressConfig, names: list[str]) -> dict[str, CompressConfig | None]:
    """Each decoder linear's options under the recipe's per-layer rules (None: kept dense)."""
    rules = cfg.rules
    return {n: cfg for n in names} if rules.empty else resolve_rules(rules, cfg, names)


def load_source(cfg: CompressConfig, reporter: Reporter) -> StreamingModel | LoadedModel:
    """The model: safetensors folders stream (a meta skeleton; one layer, or with calibration one block, in
    memory), other sources load whole."""
    with reporter.stage(f"loading {Path(cfg.model).name}", total=None):
        return open_model(cfg.model, forward=cfg.needs_calibration or cfg.sparsity_profile == "owl")


def compress_blocks(run: _Run, plan: layerwise.CalibrationPlan) -> None:
    """Prune, quantize and encode every linear, block by block; each block's statistics come from the outputs
    of the already compressed blocks before it."""
    cfg, model, load = run.cfg, run.loaded.model, block_loader(run.loaded)
    kind = hessian_kind(plan.kind) if cfg.gptq or cfg.clip_search else plan.kind  # GPTQ needs H
    # a token sample of every layer's input calibrates its activation clip ratio (same pass as the statistics)
    tokens = any(c is not None and c.quant_mode.quantizes_activations for c in run.layer_cfg.values())
    forward = kind is not None or cfg.act_sparsity > 0  # blocks run: streaming fills each one in
    device = "meta" if run.streamed and not forward else cfg.device
    stream = layerwise.BlockStream(model, plan.samples, device, load) if kind is not None else None
    teal = threshold_calibrator(run, plan, stream, load)
    run.activation_sparsity_info = teal.info if teal is not None else None
    n_layers = sum(len(block_linears(b)) for b in run.blocks)
    rep = run.reporter
    with rep.stage("blocks", total=len(run.blocks)) as block_bar, \
            rep.stage("layers (prune, quantize, encode, write)", total=n_layers) as bar, \
            rep.stage("reordering tiles of the current layer", total=None) as tile_bar:
        run.encoder.reorder_progress = tile_bar.update
        blocks = layerwise.calibrated_blocks(model, plan.samples, kind, device, load if forward else None,
                                             tokens=tokens, stream=stream)
        for i, block, block_stats in blocks:
            names = {sub: f"{run.prefix}.{i}.{sub}" for sub, _ in block_linears(block)}
            sets = shared_input_sets(n for n in names.values() if run.layer_cfg[n] is not None)
            waiting = {n: s for s in sets for n in s}  # a layer that shares its input waits for its siblings
            prepared = []
            for sub, lin in block_linears(block):
                stats = block_stats.pop(sub, None)
                if run.layer_cfg[names[sub]] is None:  # kept dense: its weight goes to dense/ untouched
                    run.totals.add_dense(names[sub], tuple(lin.weight.shape))
                else:
                    prepared.append(prepare_layer(run, names[sub], lin, plan.block_sparsity[i], stats, forward))
                    siblings = waiting.get(names[sub], ())
                    if teal is None and set(siblings) <= {n for n, _ in prepared}:
                        # submit at once: one layer, or one set of layers sharing an input, in memory
                        share_activation_clip(run, [item for item in prepared if item[0] in siblings])
                        for name, payload in prepared:
                            submit(run, name, payload, {})
                        prepared.clear()
                bar.advance()
            if teal is not None:  # the block is compressed: its thresholds, then its layers, in order
                thresholds = teal.block(block, names)  # on a shared stream: the pass that advances it
                for s in sets:
                    share_activation_clip(run, [item for item in prepared if item[0] in s])
                for name, payload in prepared:
                    submit(run, name, payload, thresholds.get(name, {}))
            block_bar.advance()
        run.encoder.finish()
    if teal is not None:
        teal.close()


def threshold_calibrator(run: _Run, plan: layerwise.CalibrationPlan, stream: layerwise.BlockStream | None,
                         load) -> ThresholdCalibrator | None:
    """Activation sparsity (TEAL): thresholds from a calibration stream through the compressed blocks; the
    statistics' own ``stream`` when ``--act-sparsity-calib`` names the ``--calib`` text (same windows)."""
    cfg = run.cfg
    if cfg.act_sparsity == 0:
        return None
    if stream is not None and cfg.act_sparsity_calib == cfg.calib:
        announce(run.reporter.note, cfg.act_sparsity_calib, cfg.nsamples, cfg.seqlen, cfg.seed,
                 cfg.act_sparsity_profile)
        return ThresholdCalibrator(stream, plan.windows, cfg.act_sparsity, cfg.act_sparsity_profile, shared=True)
    return ThresholdCalibrator.from_text(model=run.loaded.model, source=cfg.act_sparsity_calib,
                                         model_source=cfg.model, nsamples=cfg.nsamples, seqlen=cfg.seqlen,
                                         seed=cfg.seed, target=cfg.act_sparsity, profile=cfg.act_sparsity_profile,
                                         device=cfg.device, note=run.reporter.note, load=load)


def prepare_layer(run: _Run, full: str, lin: torch.nn.Linear, sparsity: float, stats,
                  forward: bool) -> tuple[str, QuantizedLayer | torch.Tensor | None]:
    """Prune and quantize one layer (the one place weights are quantized); the model keeps the compressed
    weight so that later blocks see it. Returns (name, what the encoder takes: a QuantizedLayer, float16
    weights for ``--quant none``, or None for a layer already in the store)."""
    cfg = run.layer_cfg[full]
    if cfg.sparsity != run.cfg.sparsity:  # a per-layer sparsity replaces the run's (and OWL's per-block one)
        sparsity = cfg.sparsity
    run.compressed.add(f"{full}.weight")
    tokens = stats.tokens if stats is not None else None
    if full in run.done and not forward:  # --resume, and nothing later needs its weight
        return full, None
    w = source_weight(run.loaded, full, lin)
    if not torch.isfinite(w.sum()) and not torch.isfinite(w).all():  # a finite sum: all finite
        raise UserError(f"MODEL: layer {full} has NaN or inf weights")
    w_pruned, mask = prune_layer(cfg.prune, w, sparsity, cfg.nm, stats, **({"union": cfg.union} if cfg.union else {}))
    payload: QuantizedLayer | torch.Tensor | None = w_pruned.cpu()
    if cfg.bits is not None:  # also for a stored layer that later blocks see: they must see the same weights
        payload = quantize_layer(w_pruned, spec_from_config(cfg, w.shape[1]), mask=mask, h=stats and stats.H,
                                 x_sq_norm=stats and stats.x_sq_norm, tokens=tokens)
        preflight.check_scales(full, payload.qweight.scales, cfg.quant)  # verify rejects scales over fp16's range
        if payload.outliers is not None:
            preflight.check_scales(full, payload.outliers.scales, cfg.quant, "outlier scales")
        w_pruned = torch.from_numpy(payload.dequantize())  # later blocks see it quantized
    if not lin.weight.is_meta:
        lin.weight.data.copy_(w_pruned.to(lin.weight.dtype))
    return full, None if full in run.done else payload


def share_activation_clip(run: _Run, items: list[tuple[str, QuantizedLayer | torch.Tensor | None]]) -> None:
    """Give layers that read one input (``items``: a set of :func:`shared_input_sets`, or one layer) one
    activation clip ratio, so that one quantized input serves their stacked product at run time
    (docs/quantization.md, "Activation clip"): the argmin of their stacked output's error. A member already in
    the store (--resume) fixes the clip: a fresh run chose that one for all. Members whose activation records
    differ otherwise (per-layer rules) keep their own clips."""
    if len(items) < 2:
        return
    layers = [p for _, p in items if isinstance(p, QuantizedLayer)]
    stored = [run.writer.layer_attrs(n).get("activations") or {} for n, p in items if p is None]
    records = [ql.activations for ql in layers] + stored
    if not layers or any(not r or int(r.get("bits") or 16) == 16 for r in records):
        return
    if len({json.dumps({k: v for k, v in r.items() if k != "clip"}, sort_keys=True) for r in records}) > 1:
        return
    if stored:
        clip = float(stored[0]["clip"])
    elif all("act_clip_energy" in ql.report for ql in layers):
        clip = shared_act_clip([ql.report["act_clip_rel_error"] for ql in layers],
                               [ql.report["act_clip_energy"] for ql in layers])
    else:
        return
    for ql in layers:
        ql.report["act_clip_own"] = ql.activations["clip"]
        ql.activations["clip"] = clip


def submit(run: _Run, name: str, payload, thresholds: dict) -> None:
    """Hand one layer to the executor (a layer already in the store keeps its place in the order)."""
    if payload is None:
        run.encoder.done(name, run.writer.layer_attrs(name))
        return
    cfg = run.layer_cfg[name]
    if not (cfg.fmt.activation_sparsity and not cfg.quant_mode.quantizes_activations):  # its kernel skips no input
        thresholds = {}
    extra = {"overrides": diff} if (diff := describe_rules({name: cfg}, run.cfg).get(name)) else {}
    run.encoder.submit(name, payload, cfg, {**thresholds, **extra})


def write_dense(run: _Run) -> tuple[dict, dict]:
    """Every tensor that is not a compressed weight (embeddings, norms, biases, lm_head) into dense/."""
    dense, tied = model_dense_tensors(run.loaded, run.compressed)
    kept = {f"{n}.weight" for n in run.totals.dense_linears}  # checked here: preflight saw only non-linears
    with run.reporter.stage("writing dense tensors", total=len(dense)) as bar:
        for name, t in dense.items():
            if name in kept:
                preflight.check_finite(f"layer {name[: -len('.weight')]} (kept dense)", t)
            run.writer.write_dense({name: to_storage_dtype(t)})
            bar.advance()
    return dense, tied
