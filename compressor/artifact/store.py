"""The zarr v3 artifact (docs/format.md, "The store"): writing layer by layer, atomically, and reading safely.

Layout::

    OUT.zarr/                      root attrs: unionsparse marker, format_version, tool version, source,
                                   config, created, layer index, dense index, tied aliases
      layers/<module path>/        arrays of one encoded layer, attrs (shape, format, bits, stats, ...)
      dense/<tensor name>          every other tensor (embeddings, norms, biases, lm_head)
      unionsparse_manifest.json    size and crc32c of every file, with its own checksum

Every array carries a crc32c codec, so a flipped byte in a chunk fails on read. The manifest covers the
metadata files too. The store is written as ``OUT.zarr.partial`` and renamed at the end; a layer group
counts only once its ``complete`` attribute is set (written after its arrays).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from ...formats import registry
from ...formats.arithmetic.outlier_side import OutlierSide, side_arrays, side_from_arrays
from ...formats.errors import FormatError
from ..errors import UserError
from . import ownership

FORMAT_VERSION = 1
MARKER = "unionsparse"
MANIFEST = "unionsparse_manifest.json"
CHUNK_BYTES = 16 << 20


def tool_version() -> str:
    try:
        from importlib.metadata import version

        return version("unionsparse")
    except Exception:  # pragma: no cover - running from a source tree without metadata
        return "0+unknown"


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _chunks(a: np.ndarray) -> tuple[int, ...]:
    if a.ndim == 0 or a.size == 0:
        return tuple(max(1, s) for s in a.shape)
    row = max(1, a.nbytes // max(1, a.shape[0]))
    return (max(1, min(a.shape[0], CHUNK_BYTES // row)),) + tuple(a.shape[1:])


def write_array(group: zarr.Group, name: str, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data)
    arr = group.create_array(
        name, shape=data.shape, dtype=data.dtype, chunks=_chunks(data), compressors=[Crc32cCodec()],
        config={"write_empty_chunks": True}, overwrite=True,
    )
    if data.size:
        arr[...] = data


@dataclass
class LayerRecord:
    """One encoded linear layer as stored: the encoding, its scales and attributes."""

    name: str
    encoding: registry.Matrix
    scales: np.ndarray | None
    attrs: dict = field(default_factory=dict)
    outliers: OutlierSide | None = None  # Atom 8-bit side matrix (the main encoding is column-permuted)

    @property
    def format(self) -> str:
        return registry.of(self.encoding).name

    def arrays(self) -> dict[str, np.ndarray]:
        out = registry.of(self.encoding).to_arrays(self.encoding)
        if self.scales is not None:
            out["scales"] = self.scales
        if self.outliers is not None:
            out.update(side_arrays(self.outliers))
        return out


class ArtifactWriter:
    """Writes ``OUT.zarr.partial`` layer by layer; :meth:`finalize` renames it to ``OUT.zarr``."""

    def __init__(self, out: Path, root_attrs: dict, resume: bool = False, overwrite: bool = False):
        self.out = Path(out)
        self.tmp = partial_path(self.out)
        if self.out.exists() and not overwrite:
            raise UserError(f"-o: {self.out} already exists (remove it or pass --overwrite)")
        if self.out.exists() or self.out.is_symlink():
            ownership.check_replaceable(self.out)  # only an artifact is ever replaced (at finalize)
        if self.tmp.exists() or self.tmp.is_symlink():  # this configuration's and source's, or refused
            ownership.check_partial(self.tmp, root_attrs.get("config"), (root_attrs.get("source") or {}).get(
                "fingerprint"), resume)
        if self.tmp.exists() and resume:
            self.root = zarr.open_group(str(self.tmp), mode="r+")
            self._drop_incomplete()
        else:
            ownership.remove_tree(self.tmp)  # our own partial, checked above
            self.root = zarr.open_group(str(self.tmp), mode="w")
            self.root.attrs.update({**root_attrs, MARKER: True, "format_version": FORMAT_VERSION,
                                    "complete": False})
            self.root.create_group("layers")
            self.root.create_group("dense")

    def _drop_incomplete(self) -> None:
        for group in ("layers", "dense"):  # killed right after the root was created
            if group not in self.root:
                self.root.create_group(group)
        layers = self.root["layers"]
        for name in list(layers.group_keys()):
            if not layers[name].attrs.get("complete", False):
                ownership.remove_tree(self.tmp / "layers" / name, store=False)

    def completed_layers(self) -> set[str]:
        layers = self.root["layers"]
        return {n for n in layers.group_keys() if layers[n].attrs.get("complete", False)}

    def layer_attrs(self, name: str) -> dict:
        return dict(self.root["layers"][name].attrs)

    def write_layer(self, rec: LayerRecord) -> dict:
        """Write one layer's arrays, then its attrs with ``complete`` last; returns the attrs."""
        ownership.remove_tree(self.tmp / "layers" / rec.name, store=False)  # a leftover of an interrupted write
        g = self.root["layers"].create_group(rec.name)
        for k, v in rec.arrays().items():
            write_array(g, k, v)
        attrs = _jsonable({**registry.of(rec.encoding).geometry_attrs(rec.encoding), **rec.attrs})
        g.attrs.update(attrs)
        g.attrs["complete"] = True  # last: the layer counts only from here on
        return attrs

    def write_dense(self, tensors: dict[str, np.ndarray]) -> None:
        dense = self.root["dense"]
        for name, t in tensors.items():
            write_array(dense, name, t)

    def finalize(self, extra_attrs: dict) -> None:
        self.root.attrs.update(_jsonable({**extra_attrs, "complete": True}))
        write_manifest(self.tmp)
        ownership.replace_artifact(self.tmp, self.out)  # an existing -o only if it is (still) an artifact

    def abort(self) -> None:
        """Remove the partial store (bad input found midway); never through a link."""
        if not self.tmp.is_symlink():
            shutil.rmtree(self.tmp, ignore_errors=True)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if np.isfinite(f) else None
    return obj


# ----------------------------------------------------------------------------------------- manifest


def _file_entries(root: Path) -> dict[str, list[int]]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for fn in files:
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            out[rel] = [p.stat().st_size, crc32c.crc32c(p.read_bytes())]
    return dict(sorted(out.items()))


def write_manifest(root: Path) -> None:
    body = json.dumps({"files": _file_entries(root)}, sort_keys=True, separators=(",", ":"))
    text = body + "\n" + f"crc32c {crc32c.crc32c(body.encode()):08x}\n"
    (root / MANIFEST).write_text(text)


def check_manifest(root: Path) -> list[str]:
    """Every problem between the files on disk and the manifest: one message each."""
    mpath = root / MANIFEST
    if not mpath.is_file():
        return [f"{MANIFEST} is missing"]
    text = mpath.read_bytes()
    try:
        body, trailer = text.decode().rstrip("\n").rsplit("\n", 1)
        want = int(trailer.split()[1], 16)
        files = json.loads(body)["files"]
    except (ValueError, IndexError, KeyError, UnicodeDecodeError):
        return [f"{MANIFEST} is corrupt"]
    if crc32c.crc32c(body.encode()) != want:
        return [f"{MANIFEST} fails its checksum"]
    problems = []
    actual = _file_entries(root)
    for rel, entry in files.items():
        if rel not in actual:
            problems.append(f"{rel}: file missing")
        elif actual[rel] != entry:
            problems.append(f"{rel}: size or crc32c differs from the manifest")
    for rel in actual:
        if rel not in files:
            problems.append(f"{rel}: file not in the manifest")
    return problems


# ------------------------------------------------------------------------------------------ reading


class Artifact:
    """Read access to a finished artifact. Opening checks the marker, version and completeness."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"{path}: no such artifact")
        if not (self.path / "zarr.json").is_file():
            raise UserError(f"{path}: not a unionsparse artifact (no zarr.json)")
        try:
            self.root = zarr.open_group(str(self.path), mode="r")
            self.attrs = dict(self.root.attrs)
        except Exception as e:  # zarr raises several types for broken metadata
            raise UserError(f"{path}: not a readable zarr store ({type(e).__name__})") from None
        if not self.attrs.get(MARKER):
            raise UserError(f"{path}: not a unionsparse artifact (root attrs lack the marker)")
        version = self.attrs.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise UserError(
                f"{path}: format_version {version!r} is newer than this unionsparse reads "
                f"({FORMAT_VERSION}); upgrade unionsparse"
            )
        if not self.attrs.get("complete"):
            raise UserError(f"{path}: incomplete artifact (interrupted compress? rerun with --resume)")

    @property
    def layer_names(self) -> list[str]:
        index = self.attrs.get("layers")
        if isinstance(index, dict):
            return list(index)
        return sorted(self.root["layers"].group_keys())

    @property
    def dense_names(self) -> list[str]:
        index = self.attrs.get("dense")
        if isinstance(index, list):
            return [str(n) for n in index]
        return sorted(self.root["dense"].array_keys())

    def layer_attrs(self, name: str) -> dict:
        try:
            return dict(self.root["layers"][name].attrs)
        except KeyError:
            raise UserError(f"--layer: no layer named {name} (see `unionsparse inspect`)") from None

    def read_layer(self, name: str) -> LayerRecord:
        """Read and structurally validate one layer. Corruption raises FormatError or a zarr error."""
        g = self.root["layers"][name]
        a = dict(g.attrs)
        present = set(g.array_keys())

        def arr(key: str, required: bool = True) -> np.ndarray | None:
            if key not in present:
                if required:
                    raise FormatError(f"layer {name}: array '{key}' is missing")
                return None
            return np.asarray(g[key][...])

        try:
            fmt = registry.get(a.get("format"))
            enc = fmt.from_arrays(a, arr)
        except FormatError as e:
            raise FormatError(f"layer {name}: {e}") from None
        shape, bits = enc.shape, enc.bits
        scales = arr("scales", required=bits is not None)
        if scales is not None:
            gs = a.get("group_size")
            if not isinstance(gs, int) or gs <= 0:
                raise FormatError(f"layer {name}: bad group_size {gs!r}")
            want = (shape[0], -(-shape[1] // gs))
            if scales.dtype != np.float16 or scales.shape != want:
                raise FormatError(f"layer {name}: scales must be float16 {want}, got {scales.dtype} {scales.shape}")
        recorded = (a.get("activations") or {}).get("outlier_channels")
        side = None
        if recorded is not None or "outlier_codes" in present:
            side = side_from_arrays(name, shape, arr("outlier_codes"), arr("outlier_scales"),
                                    arr("outlier_channels"), recorded)
        return LayerRecord(name, enc, scales, a, side)

    def read_dense(self, name: str) -> np.ndarray:
        return np.asarray(self.root["dense"][name][...])


def new_root_attrs(source: str, fp: str, config: dict, model_config: dict) -> dict:
    return {
        "tool": "unionsparse",
        "tool_version": tool_version(),
        "source": {"model": source, "fingerprint": fp},
        "config": config,
        "model_config": model_config,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
