"""Streaming compress (meta skeleton + lazy shard reads) gives the same artifact as loading the model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from unionsparse.compressor import pipeline, streaming
from unionsparse.compressor.artifact import Artifact
from unionsparse.compressor.config import CompressConfig
from unionsparse.compressor.progress import Reporter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def compress(model: Path, out: Path, stream: bool, monkeypatch, **kw) -> Artifact:
    if not stream:
        monkeypatch.setattr(pipeline, "open_model", lambda src, streaming=True: streaming_off(src))
    cfg = CompressConfig(model=str(model), output=str(out), **kw)
    with Reporter(quiet=True) as rep:
        pipeline.compress(cfg, rep)
    monkeypatch.undo()
    return Artifact(out)


def streaming_off(src):
    from unionsparse.compressor.model_io import load_model

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


def test_calibrated_runs_do_not_stream(model_dirs):
    s = streaming.open_model(str(model_dirs["llama"]), streaming=False)
    assert not isinstance(s, streaming.StreamingModel)
    assert not any(p.is_meta for p in s.model.parameters())
