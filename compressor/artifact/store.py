"""The zarr v3 artifact (docs/format.md, "The store"): writing layer by layer, atomically, and reading safely.

Layout::

    OUT.zarr/                      root attrs: unionsparse marker, format_version, tool version, source,
                                   config, created, layer index, dense index, tied aliases
      layers/<module path>/        arrays of one encoded layer, attrs (shape, format, bits, stats, ...)
      dense/<tensor name>          every other tensor (embeddings, norms, biases, lm_head)
      unionsparse_manifest.json    path, size and SHA-256 of every other file, and the SHA-256 of that list

Every array carries a crc32c codec, so a flipped byte in a chunk fails on read. The manifest covers the
metadata files too. The store is written as ``OUT.zarr.partial`` and renamed at the end; a layer group
counts only once its ``complete`` attribute is set (written after its arrays). Reading goes through
:mod:`.store` (no links, bounded reads, declared sizes checked before allocating).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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
from ..files import atomic_write
from . import ownership
from .layout import MANIFEST, MARKER
from .scan import MAX_JSON_BYTES, ArrayMeta, Store, StoreError, check_name

FORMAT_VERSION = 1
READS_FORMAT_VERSIONS = (1,)
MANIFEST_VERSION = 2  # 1: crc32c of each file (constant for chunk files); 2: SHA-256 of each file
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
            ownership.remove_zarr_temporaries(self.tmp)  # a write the kill interrupted
            self.root = zarr.open_group(str(self.tmp), mode="r+")
            self._drop_incomplete()
            return
        ownership.remove_tree(self.tmp)  # our own partial, checked above
        try:
            self.root = zarr.open_group(str(self.tmp), mode="w")
            self.root.attrs.update({**root_attrs, MARKER: True, "format_version": FORMAT_VERSION,
                                    "complete": False})
            self.root.create_group("layers")
            self.root.create_group("dense")
        except BaseException:
            self.abort()  # the partial this writer began (a full disk, a read-only file system)
            raise

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


def _file_entries(store: Store) -> dict[str, dict]:
    """SHA-256 and size of every file of the store but the manifest, by relative path."""
    return {rel: {"sha256": store.sha256(rel), "size": size} for rel, size in store.files.items() if rel != MANIFEST}


def _signed(body: str) -> str:
    return body + "\n" + f"sha256 {hashlib.sha256(body.encode()).hexdigest()}\n"


def write_manifest(root: Path) -> None:
    """Write ``unionsparse_manifest.json``: every file's path, size and SHA-256, the root's format_version,
    and the SHA-256 of that body on a last line (see docs/format.md)."""
    store = Store(root)
    try:
        version = store.group_attrs("").get("format_version")
    except StoreError:  # signs whatever is there (tests craft broken stores this way)
        version = None
    body = json.dumps({"manifest": MANIFEST_VERSION, "hash": "sha256", "format_version": version,
                       "files": _file_entries(store)}, sort_keys=True, separators=(",", ":"))
    atomic_write(Path(root) / MANIFEST, _signed(body), "-o")


@dataclass
class ManifestCheck:
    """The outcome of :func:`check_manifest`: problems (one line each), and what the manifest records."""

    problems: list[str] = field(default_factory=list)
    present: bool = True
    legacy: bool = False  # manifest version 1: crc32c per file (constant for chunk files: binds no content)
    newer: bool = False  # a valid manifest of a newer writer (manifest or format version)
    format_version: object = None
    digest: str | None = None  # SHA-256 of the whole manifest file: pins the artifact
    files: dict | None = None  # path -> {"sha256", "size"}, once the signature and versions hold


def _where(rel: str) -> str:
    """``layer NAME: path`` / ``dense NAME: path`` for a file of a layer or dense tensor, else the path."""
    parts = rel.split("/", 2)
    if len(parts) == 3 and parts[0] in ("layers", "dense"):
        return f"{'layer' if parts[0] == 'layers' else 'dense'} {parts[1]}: {parts[2]}"
    return rel


def _compare(files: object, actual: dict[str, object], what: str) -> list[str]:
    if not isinstance(files, dict):
        return [f"{MANIFEST} is corrupt (no file list)"]
    problems = [f"{_where(rel)}: file missing (listed in the manifest)" for rel in files if rel not in actual]
    problems += [f"{_where(rel)}: {what} differs from the manifest"
                 for rel in files if rel in actual and actual[rel] != files[rel]]
    problems += [f"{_where(rel)}: file not in the manifest" for rel in actual if rel not in files]
    return problems


def _check_legacy(store: Store, body: str, want: str) -> ManifestCheck:
    res = ManifestCheck(legacy=True)
    try:
        files = json.loads(body)["files"]
        ok = crc32c.crc32c(body.encode()) == int(want, 16)
    except (ValueError, KeyError, TypeError, RecursionError):
        return ManifestCheck([f"{MANIFEST} is corrupt"], legacy=True)
    if not ok:
        return ManifestCheck([f"{MANIFEST} fails its checksum"], legacy=True)
    actual = {}
    for rel, size in store.files.items():
        if rel != MANIFEST:
            crc = 0
            for b in store.blocks(rel):
                crc = crc32c.crc32c(b, crc)
            actual[rel] = [size, crc]
    res.problems = _compare(files, actual, "size or crc32c")
    res.problems.append(f"{MANIFEST}: an old crc32c manifest, which does not bind the files' content; recompress "
                        "(unionsparse compress --config OLD.zarr -o NEW.zarr) for a SHA-256 manifest")
    return res


def _load_manifest(store: Store, legacy_content: bool = True) -> ManifestCheck:
    """The manifest read and its signature and versions checked, without hashing the files it lists
    (``files``); ``legacy_content``: compare an old crc32c manifest's files too (verify)."""
    if MANIFEST not in store.files:
        return ManifestCheck([f"{MANIFEST} is missing: nothing binds the files' content (every artifact "
                              "unionsparse writes has one)"], present=False)
    raw = store.read(MANIFEST, MAX_JSON_BYTES)
    try:
        body, trailer = raw.decode("utf-8").rstrip("\n").rsplit("\n", 1)
        kind, want = trailer.split(" ")
    except (UnicodeDecodeError, ValueError):
        return ManifestCheck([f"{MANIFEST} is corrupt"])
    if kind == "crc32c":
        return _check_legacy(store, body, want) if legacy_content else ManifestCheck(
            [f"{MANIFEST}: an old crc32c manifest, which does not bind the files' content"], legacy=True)
    if kind != "sha256" or hashlib.sha256(body.encode()).hexdigest() != want:
        return ManifestCheck([f"{MANIFEST} fails its SHA-256 (the manifest itself was changed)"])
    res = ManifestCheck(digest=hashlib.sha256(raw).hexdigest())
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return ManifestCheck([f"{MANIFEST} is corrupt"])
    if not isinstance(doc, dict):
        return ManifestCheck([f"{MANIFEST} is corrupt"])
    res.format_version = doc.get("format_version")
    version = doc.get("manifest")
    if type(version) is int and version > MANIFEST_VERSION or (
            type(res.format_version) is int and res.format_version > FORMAT_VERSION):
        res.newer = True
        return res
    if version != MANIFEST_VERSION or doc.get("hash") != "sha256":
        return ManifestCheck([f"{MANIFEST} is corrupt (unknown version or hash)"])
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and type(e.get("size")) is int
            for e in files.values()):
        return ManifestCheck([f"{MANIFEST} is corrupt (no file list)"])
    res.files = files
    return res


def check_manifest(root: Path | Store) -> ManifestCheck:
    """Every difference between the store's files and its manifest, one message each (empty: all match)."""
    store = root if isinstance(root, Store) else Store(root)
    res = _load_manifest(store)
    if res.files is not None:
        res.problems = _compare(res.files, _file_entries(store), "size or SHA-256")
    return res


def manifest_digests(store: Store, path: object) -> dict[str, str]:
    """For commands that use an artifact: the SHA-256 the manifest records for each file, once the manifest's
    signature holds and the store holds exactly its files at its sizes (nothing hashed here: each file is
    checked as it is read, :meth:`~.scan.Store.expect`). UserError in one line otherwise."""
    fix = f"`unionsparse verify {path}` lists what differs; --no-verify uses it anyway"
    res = _load_manifest(store, legacy_content=False)
    if res.newer:
        raise UserError(f"{path}: its manifest is newer than this unionsparse reads; upgrade unionsparse")
    if res.legacy:
        raise UserError(f"{path}: {res.problems[0]}; recompress it (unionsparse compress --config OLD.zarr -o "
                        "NEW.zarr), or pass --no-verify")
    if res.files is None:
        raise UserError(f"{path}: {res.problems[0]} ({fix})")
    problems = _compare({rel: e["size"] for rel, e in res.files.items()},
                        {rel: size for rel, size in store.files.items() if rel != MANIFEST}, "size")
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise UserError(f"{path}: differs from its manifest: {problems[0]}{more} ({fix})")
    return {rel: e["sha256"] for rel, e in res.files.items()}


# ------------------------------------------------------------------------------------------ reading


def _format_version_problem(path: object, version: object) -> str | None:
    if type(version) is int and version > FORMAT_VERSION:
        return (f"{path}: format_version {version} is newer than this unionsparse reads ({FORMAT_VERSION}); "
                "upgrade unionsparse")
    if type(version) is not int or version not in READS_FORMAT_VERSIONS:
        return f"{path}: format_version {version!r} is not one unionsparse writes"
    return None


class Artifact:
    """Read access to a finished artifact. Opening checks the marker, version and completeness.

    Everything is read through :class:`~.store.Store`: no links, reads bounded by declared and physical sizes.
    With ``verify`` (the default: every command that uses an artifact), the manifest must hold (signature,
    the store's files and sizes) and each file read must have the SHA-256 it records, else UserError; verify,
    inspect and summarize, which report on a store rather than use it, open it with ``verify=False``.
    """

    def __init__(self, path: str | Path, store: Store | None = None, verify: bool = True):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"{path}: no such artifact")
        if not self.path.is_dir():
            raise UserError(f"{path}: not a unionsparse artifact (not a folder)")
        if store is None and not os.path.lexists(self.path / "zarr.json"):
            # before the scan, which would walk any folder (a home directory) and name the first link it meets
            raise UserError(f"{path}: not a unionsparse artifact (no zarr.json)")
        self.store = store if store is not None else Store(self.path)
        if "zarr.json" not in self.store.files:
            raise UserError(f"{path}: not a unionsparse artifact (no zarr.json)")
        self.attrs = self._root_attrs()
        self.verified = verify
        if verify:  # from here on every file read is checked against the manifest, the root's attrs first
            self.store.expect(manifest_digests(self.store, path),
                              f"run `unionsparse verify {path}`; --no-verify uses it anyway")
            self.attrs = self._root_attrs()

    def check_files(self) -> None:
        """Read every file now, so each is checked against the manifest before any work (a command that reads them
        all anyway, e.g. bench); UserError naming the first that differs."""
        for rel in self.store.files:
            if rel != MANIFEST:
                self.store.read(rel)

    def _root_attrs(self) -> dict:
        """The root's attributes: the marker, a format version this reads, and ``complete`` (else UserError)."""
        path = self.path
        try:
            attrs = self.store.group_attrs("")
        except StoreError as e:
            raise UserError(f"{path}: not a readable zarr store ({e})") from None
        if attrs.get(MARKER) is not True:
            raise UserError(f"{path}: not a unionsparse artifact (root attrs lack the marker)")
        problem = _format_version_problem(path, attrs.get("format_version"))
        if problem:
            raise UserError(problem)
        if attrs.get("complete") is not True:
            raise UserError(f"{path}: incomplete artifact (interrupted compress? rerun with --resume)")
        return attrs

    def _names(self, key: str, folder: str) -> list[str]:
        index = self.attrs.get(key)
        if isinstance(index, (dict, list)):
            names = list(index)
        else:
            names = sorted(self.store.children(folder))
        return [check_name(n, f"{self.path}: {folder[:-1] if folder == 'layers' else folder} name") for n in names]

    @property
    def layer_names(self) -> list[str]:
        return self._names("layers", "layers")

    @property
    def dense_names(self) -> list[str]:
        return self._names("dense", "dense")

    def group_names(self, folder: str) -> list[str]:
        """Nodes stored under ``layers`` or ``dense`` (whatever the root index says)."""
        return sorted(self.store.children(folder))

    def layer_attrs(self, name: str) -> dict:
        try:
            check_name(name)
        except StoreError:
            raise UserError(f"--layer: no layer named {name!r} (see `unionsparse inspect`)") from None
        if f"layers/{name}/zarr.json" not in self.store.files:
            raise UserError(f"--layer: no layer named {name} (see `unionsparse inspect`)")
        return self.store.group_attrs(f"layers/{name}")

    def read_layer(self, name: str) -> LayerRecord:
        """Read and structurally validate one layer. Corruption raises FormatError or StoreError."""
        check_name(name, "layer name")
        base = f"layers/{name}"
        if f"{base}/zarr.json" not in self.store.files:
            raise FormatError(f"layer {name}: group missing")
        a = self.store.group_attrs(base)
        present = {k for k in self.store.children(base) if self.store.is_array(f"{base}/{k}")}

        def arr(key: str, required: bool = True) -> np.ndarray | None:
            if key not in present:
                if required:
                    raise FormatError(f"layer {name}: array '{key}' is missing")
                return None
            return self.store.read_array(f"{base}/{key}")

        shape, bits, tile, fmt_name = _layer_geometry(name, a)  # types and ranges, before the arrays
        try:
            enc = registry.get(fmt_name).from_arrays(
                {**a, **{k: list(_int_pair(name, a, k)) for k in registry.get(fmt_name).extra_geometry}}, arr)
        except FormatError as e:
            raise e if str(e).startswith(f"layer {name}:") else FormatError(f"layer {name}: {e}") from None
        scales = arr("scales", required=bits is not None)
        if scales is not None:
            gs = a.get("group_size")
            if type(gs) is not int or gs <= 0:
                raise FormatError(f"layer {name}: bad group_size {gs!r}")
            want = (shape[0], -(-shape[1] // gs))
            if scales.dtype != np.float16 or scales.shape != want:
                raise FormatError(f"layer {name}: scales must be float16 {want}, got {scales.dtype} {scales.shape}")
        act = a.get("activations")
        recorded = act.get("outlier_channels") if isinstance(act, dict) else None
        side = None
        if recorded is not None or "outlier_codes" in present:
            side = side_from_arrays(name, shape, arr("outlier_codes"), arr("outlier_scales"),
                                    arr("outlier_channels"), recorded)
        return LayerRecord(name, enc, scales, a, side)

    def dense_meta(self, name: str) -> ArrayMeta:
        """Declared shape and dtype of a dense tensor (nothing allocated)."""
        check_name(name, "dense tensor name")
        return self.store.array_meta(f"dense/{name}")

    def read_dense(self, name: str) -> np.ndarray:
        check_name(name, "dense tensor name")
        return self.store.read_array(f"dense/{name}")


def _int_pair(name: str, attrs: dict, key: str) -> tuple[int, int]:
    v = attrs.get(key)
    if not isinstance(v, list) or len(v) != 2 or not all(type(x) is int and 0 < x <= 1 << 31 for x in v):
        raise FormatError(f"layer {name}: attribute {key} must be two positive integers, got {v!r}")
    return v[0], v[1]


def _layer_geometry(name: str, a: dict) -> tuple[tuple[int, int], int | None, tuple[int, int], str]:
    """(shape, bits, tile, format) of a layer's attributes, validated (FormatError)."""
    for key in ("shape", "bits", "tile", "format"):
        if key not in a:
            raise FormatError(f"layer {name}: attribute '{key}' is missing")
    fmt, bits = a["format"], a["bits"]
    if fmt not in registry.names():
        raise FormatError(f"layer {name}: unknown format {fmt!r}")
    if bits is not None and (type(bits) is not int or bits not in (2, 4, 8)):
        raise FormatError(f"layer {name}: bad bits {bits!r}")
    return _int_pair(name, a, "shape"), bits, _int_pair(name, a, "tile"), fmt


def new_root_attrs(source: str, fp: str, config: dict, model_config: dict) -> dict:
    return {
        "tool": "unionsparse",
        "tool_version": tool_version(),
        "source": {"model": source, "fingerprint": fp},
        "config": config,
        "model_config": model_config,
    }
