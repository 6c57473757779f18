"""Read an artifact from Python: its recipe, one layer's arrays and statistics, the dequantized weight.

Run: python examples/read_artifact.py [OUT.zarr] [--layer NAME]
Without OUT.zarr it first compresses a small random LLaMA (written to a temporary folder) through the
Python API, the same call `unionsparse compress` makes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from unionsparse.compressor.artifact.store import Artifact
from unionsparse.formats.arithmetic.weights import dequantize


def make_artifact(folder: Path) -> Path:
    from unionsparse.compressor.config import CompressConfig
    from unionsparse.compressor.pipeline.compress import compress
    from unionsparse.compressor.progress import Reporter
    from unionsparse.compressor.report.summarize import write_tiny_model

    model = write_tiny_model(folder / "tiny-llama")
    # keep_outliers=0: the random model has no tokenizer to calibrate outlier channels with (the default, auto)
    cfg = CompressConfig(model=str(model), output=str(folder / "tiny.zarr"), sparsity=0.5, quant="w4a4",
                         format="ie-bme", reorder="dp", keep_outliers=0)
    with Reporter(quiet=True) as rep:
        compress(cfg, rep)
    return Path(cfg.output)


def show(path: Path, layer: str | None) -> None:
    art = Artifact(path)  # checks the marker, the format version and completeness
    cfg = art.attrs["config"]
    print(f"{path}: {len(art.layer_names)} layers, {len(art.dense_names)} dense tensors; recipe "
          f"prune={cfg['prune']} sparsity={cfg['sparsity']} quant={cfg['quant']} format={cfg['format']}")
    name = layer or art.layer_names[0]
    rec = art.read_layer(name)  # crc32c-checked arrays, structurally validated
    enc, s = rec.encoding, rec.attrs["stats"]
    print(f"layer {name}: {rec.attrs['format']}, shape {tuple(enc.shape)}, "
          f"arrays {', '.join(f'{k} {v.dtype}[{v.size}]' for k, v in rec.arrays().items())}")
    print(f"  {s['bits_per_weight']:.3f} bits/weight, PMR {s['pmr']:.2f}, CR {s['cr']:.2f}x, "
          f"sparsity {100 * s['sparsity']:.1f}%")
    codes = enc.decode()  # int8 codes (or fp16 values for an unquantized Tiled-CBC layer), original row order
    if rec.scales is not None:
        w = dequantize(codes, rec.scales, int(rec.attrs["group_size"]))
        print(f"  dequantized weight: {w.dtype}{list(w.shape)}, codes in [{codes.min()}, {codes.max()}], "
              f"nonzeros {np.count_nonzero(w)} == nnz {s['nnz']}")
        assert np.count_nonzero(codes) == s["nnz"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--layer", default=None)
    args = ap.parse_args()
    if args.artifact:
        show(Path(args.artifact), args.layer)
        return
    with tempfile.TemporaryDirectory() as tmp:
        show(make_artifact(Path(tmp)), args.layer)


if __name__ == "__main__":
    main()
