"""Streaming compress (meta skeleton + lazy shard reads) gives the same artifact as loading the model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from unionsparse.compressor.artifact.store import Artifact
from unionsparse.compressor.config import CompressConfig
from unionsparse.compressor.model import streaming
from unionsparse.compressor.pipeline import compress as pipeline
from unionsparse.compressor.progress import Reporter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def compress(model: Path, out: Path, stream: bool, monkeypatch, **kw) -> Artifact:
    kw.setdefault("keep_outliers", 0)  # the tiny models have no tokenizer (outliers calibrate: tests pass their own)
    if not stream:
        monkeypatch.setattr(pipeline, "open_model", lambda src, streaming=True, **_: streaming_off(src))
    cfg = CompressConfig(model=str(model), output=str(out), **kw)
    with Reporter(quiet=True) as rep:
        pipeline.compress(cfg, rep)
    monkeypatch.undo()
    return Artifact(out)


def streaming_off(src):
    from unionsparse.compressor.model.loading import load_model

    return load_model(src)


def same(a: Artifact, b: Artifact) -> None:
    assert a.layer_names == b.layer_names
    for n in a.layer_names:
        ra, rb = a.read_layer(n).arrays(), b.read_layer(n).arrays()
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k].dtype == rb[k].dtype and np.array_equal(ra[k], rb[k]), (n, k)
    assert a.dense_names == b.dense_names
    for n in a.dense_names:
        x, y = a.read_dense(n), b.read_dense(n)
        assert x.dtype == y.dtype and np.array_equal(x, y), n
    assert a.attrs["tied"] == b.attrs["tied"]
    assert a.attrs["source"] == b.attrs["source"]  # same fingerprint


@pytest.mark.parametrize("arch,kw", [("llama", {"reorder": "none"}),
                                     ("opt", {"format": "tiled-cbc", "quant": "none"})])
def test_streamed_equals_fully_loaded(tmp_path, model_dirs, monkeypatch, arch, kw):
    s = streaming.open_model(str(model_dirs[arch]))
    assert isinstance(s, streaming.StreamingModel)
    assert all(p.is_meta for p in s.model.parameters())  # no weight memory held
    a = compress(model_dirs[arch], tmp_path / "s.zarr", True, monkeypatch, **kw)
    b = compress(model_dirs[arch], tmp_path / "f.zarr", False, monkeypatch, **kw)
    same(a, b)
    if arch == "opt":  # tied lm_head stored once, as an alias
        assert a.attrs["tied"] == {"lm_head.weight": "model.decoder.embed_tokens.weight"}


def test_sharded_checkpoint_streams(tmp_path, monkeypatch):
    from make_synthetic_checkpoint import write_checkpoint

    model = tmp_path / "sharded"
    info = write_checkpoint(model, layers=2, hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=64)
    assert info["shards"] == 4 and len(list(model.glob("*.safetensors"))) == 4
    a = compress(model, tmp_path / "s.zarr", True, monkeypatch, reorder="none")
    b = compress(model, tmp_path / "f.zarr", False, monkeypatch, reorder="none")
    same(a, b)
    assert len(a.layer_names) == 14 and "lm_head.weight" in a.dense_names


def test_streaming_off_loads_fully(model_dirs):
    s = streaming.open_model(str(model_dirs["llama"]), streaming=False)
    assert not isinstance(s, streaming.StreamingModel)
    assert not any(p.is_meta for p in s.model.parameters())


def with_tokenizer(model: Path, tok_dir: Path) -> Path:
    """Copy the tokenizer files of ``tok_dir`` next to ``model``'s weights."""
    import shutil

    for f in tok_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, model / f.name)
    return model


class BlockWatch:
    """Wraps ``layerwise.calibrated_blocks``: at every yielded block and every pruned layer, records how many
    decoder blocks hold real (non-meta) weights and whether any other module does."""

    def __init__(self, monkeypatch):
        from unionsparse.compressor.calibrate import layerwise
        from unionsparse.compressor.model.loading import find_blocks

        self.max_blocks, self.outside, self.checks, self.model = 0, 0, 0, None
        orig = layerwise.calibrated_blocks
        prune = pipeline.prune_layer

        def watched(model, *a, **kw):
            self.model = model
            for item in orig(model, *a, **kw):
                self.check()
                yield item

        def prune_watched(*a, **kw):
            self.check()
            return prune(*a, **kw)

        self.find_blocks = find_blocks
        monkeypatch.setattr(layerwise, "calibrated_blocks", watched)
        monkeypatch.setattr(pipeline, "prune_layer", prune_watched)

    def check(self) -> None:
        blocks, _ = self.find_blocks(self.model)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        real = [any(not p.is_meta for p in b.parameters()) for b in blocks]
        self.max_blocks = max(self.max_blocks, sum(real))
        self.outside += sum(not p.is_meta for p in self.model.parameters() if id(p) not in in_blocks)
        self.checks += 1


CALIBRATED = [
    {"prune": "wanda", "quant": "w4a4", "reorder": "dp"},  # activation clip calibration (token taps)
    {"prune": "sparsegpt", "quant": "w4a4", "gptq": True, "reorder": "none"},
    {"prune": "wanda", "quant": "none", "format": "tiled-cbc", "act_sparsity": 0.5},  # TEAL thresholds
    {"prune": "magnitude", "quant": "w4a4", "sparsity_profile": "owl", "reorder": "none"},  # dense OWL pass
]


@pytest.mark.parametrize("kw", CALIBRATED, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_calibrated_run_streams_one_block(tmp_path, llama_with_tokenizer, monkeypatch, kw):
    """A calibrated run on a sharded checkpoint never loads the model: at most one block holds weights at
    any time, nothing else does while blocks run, and the artifact equals the fully loaded run's.

    (Magnitude pruning after the OWL pass reads each layer from its shard: no block is filled in then.)"""
    from make_synthetic_checkpoint import write_checkpoint

    tok, calib = llama_with_tokenizer
    model = tmp_path / "sharded"
    write_checkpoint(model, layers=3, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=256)
    with_tokenizer(model, tok)
    common = {"calib": str(calib), "nsamples": 4, "seqlen": 32, "keep_outliers": 0, **kw}
    if "act_sparsity" in kw:
        common["act_sparsity_calib"] = str(calib)

    def no_full_load(src):
        raise AssertionError("a calibrated streaming run loaded the whole model")

    monkeypatch.setattr(streaming, "load_model", no_full_load)
    watch = BlockWatch(monkeypatch)
    cfg = CompressConfig(model=str(model), output=str(tmp_path / "s.zarr"), **common)
    with Reporter(quiet=True) as rep:
        pipeline.compress(cfg, rep)
    monkeypatch.undo()
    filled = 0 if kw["prune"] == "magnitude" and "act_sparsity" not in kw else 1  # blocks filled in at once
    assert watch.checks >= 3 * 7 and watch.max_blocks == filled and watch.outside == 0
    b = compress(model, tmp_path / "f.zarr", False, monkeypatch, **common)
    same(Artifact(tmp_path / "s.zarr"), b)


@pytest.mark.parametrize("arch", ["opt", "qwen2"])
def test_calibrated_streaming_other_architectures(tmp_path, model_dirs, llama_with_tokenizer, monkeypatch, arch):
    """OPT (learned positions, tied lm_head) and Qwen2 (biases) stream their calibrated runs identically."""
    import shutil

    tok, calib = llama_with_tokenizer
    model = tmp_path / arch
    shutil.copytree(model_dirs[arch], model)
    with_tokenizer(model, tok)
    common = {"calib": str(calib), "nsamples": 4, "seqlen": 32, "prune": "sparsegpt", "reorder": "none"}
    s = streaming.open_model(str(model), forward=True)
    assert isinstance(s, streaming.StreamingModel) and all(p.is_meta for p in s.model.parameters())
    a = compress(model, tmp_path / "s.zarr", True, monkeypatch, **common)
    b = compress(model, tmp_path / "f.zarr", False, monkeypatch, **common)
    same(a, b)
