"""Reading an artifact's zarr v3 directory store without trusting it.

Only what :class:`~.store.ArtifactWriter` writes is read: zarr v3 groups and arrays, a regular chunk
grid, chunk keys ``c/i/j``, codecs ``bytes`` (little endian) + ``crc32c``, numeric dtypes. Rules:

- The store is scanned once; a symbolic link or anything that is neither a regular file nor a folder
  refuses the whole store (:class:`StoreError`). The store's own path may be a link (the user chose it).
- Every file is opened relative to the store, one path component at a time with ``O_NOFOLLOW`` (a link
  swapped in after the scan fails to open), must still be a regular file of the size the scan found, and is
  never read past that size.
- An array's declared shape, chunk shape and dtype are checked against its chunk files (each must exist
  with exactly ``prod(chunk) * itemsize + 4`` bytes) before anything is allocated, and every chunk's
  trailing CRC-32C is checked.
- JSON documents are bounded (:data:`MAX_JSON_BYTES`) and must be objects.
- Once :meth:`Store.expect` is given the manifest's digests, every file read must match its SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from ..errors import UserError

MAX_JSON_BYTES = 64 << 20
MAX_NDIM = 4
MAX_DIM = 1 << 40
DTYPES = frozenset({"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                    "float32", "float64"})
_BLOCK = 1 << 20


class StoreError(UserError):
    """The store is unsafe or malformed: a link, a special file, a size its files do not back, bad JSON."""


def check_name(name: object, what: str = "name") -> str:
    """``name`` if it can be one path component of the store (a layer or tensor name), else StoreError."""
    from ..terminal import has_control

    if not isinstance(name, str) or not name or name in (".", "..") or len(name.encode("utf-8", "replace")) > 255:
        raise StoreError(f"{what} {name!r} is not a valid name")
    if "/" in name or "\\" in name or has_control(name):
        raise StoreError(f"{what} {name!r} holds a path separator or a control character (refused)")
    return name


def scan(root: Path) -> dict[str, int]:
    """Every regular file under ``root``: relative POSIX path -> size. A link or special file: StoreError."""
    files: dict[str, int] = {}
    stack = [("", str(root))]
    while stack:
        rel, folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append((f"{rel}{e.name}/", e.path))
                    elif e.is_file(follow_symlinks=False):
                        files[rel + e.name] = e.stat(follow_symlinks=False).st_size
                    elif e.is_symlink():
                        raise StoreError(f"{root}: {rel}{e.name} is a symbolic link (an artifact never holds "
                                         "links; refused)")
                    else:
                        raise StoreError(f"{root}: {rel}{e.name} is neither a regular file nor a folder (refused)")
        except OSError as e:
            raise StoreError(f"{root}: cannot list {rel or '.'} ({e.strerror})") from None
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class ArrayMeta:
    """What an array's zarr.json declares, validated."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    @property
    def chunk_file_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize + 4

    def chunk_keys(self) -> Iterator[tuple[tuple[int, ...], str]]:
        for idx in np.ndindex(*self.grid):
            yield idx, "c" + "".join(f"/{i}" for i in idx)


def _ints(v: object, what: str, lo: int) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise ValueError(f"{what} must be a list of at most {MAX_NDIM} integers")
    if not all(type(x) is int and lo <= x <= MAX_DIM for x in v):
        raise ValueError(f"{what} {v!r} must hold integers in [{lo}, 2^40]")
    return tuple(v)


ARRAY_KEYS = frozenset({"shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs",
                        "attributes", "zarr_format", "node_type", "storage_transformers", "dimension_names"})
GROUP_KEYS = frozenset({"attributes", "zarr_format", "node_type", "consolidated_metadata"})


def parse_array_meta(meta: dict) -> ArrayMeta:
    """Validate an array's zarr.json (ValueError with the reason)."""
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise ValueError("not a zarr v3 array")
    if not meta.keys() <= ARRAY_KEYS or not isinstance(meta.get("fill_value"), (int, float)):
        raise ValueError(f"unexpected keys or fill_value: {sorted(meta)}")
    dt = meta.get("data_type")
    if dt not in DTYPES:
        raise ValueError(f"data_type {dt!r} is not one an artifact uses")
    dtype = np.dtype(dt)
    shape = _ints(meta.get("shape"), "shape", 0)
    grid = meta.get("chunk_grid") or {}
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(grid.get("configuration"), dict):
        raise ValueError("chunk_grid must be regular")
    chunks = _ints(grid["configuration"].get("chunk_shape"), "chunk_shape", 1)
    if len(chunks) != len(shape):
        raise ValueError("chunk_shape and shape differ in length")
    if meta.get("chunk_key_encoding") != {"name": "default", "configuration": {"separator": "/"}}:
        raise ValueError("chunk_key_encoding must be default with '/'")
    codec = {"name": "bytes", "configuration": {"endian": "little"}}
    if meta.get("codecs") not in ([codec, {"name": "crc32c"}], [{"name": "bytes"}, {"name": "crc32c"}]) or (
            dtype.itemsize > 1 and meta["codecs"][0] != codec):
        raise ValueError("codecs must be bytes (little endian) + crc32c")
    if meta.get("storage_transformers") not in (None, []):
        raise ValueError("storage_transformers are not supported")
    return ArrayMeta(shape, chunks, dtype)


class Store:
    """A scanned zarr directory store; all reads are bounded and never follow a link."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._stack: list[tuple[str, int]] = []  # open folders: (name, fd), root first
        self._root_fd: int | None = None
        self.files = scan(self.root)
        self._expected: dict[str, str] | None = None  # path -> SHA-256 every read must give (expect())
        self._children: dict[str, list[str]] = {}
        for rel in self.files:
            if rel.endswith("/zarr.json"):
                parent, _, name = rel[: -len("/zarr.json")].rpartition("/")
                self._children.setdefault(parent, []).append(name)

    def size(self, rel: str) -> int:
        if rel not in self.files:
            raise StoreError(f"{rel}: file missing")
        return self.files[rel]

    def _open(self, rel: str) -> int:
        """A file descriptor of ``rel``, every component opened with O_NOFOLLOW (folders kept open: the
        ancestors of the last file, so reading in path order opens each folder once)."""
        parts = rel.split("/")
        if "" in parts or "." in parts or ".." in parts:
            raise StoreError(f"{rel}: not a path inside the store")
        dirs = parts[:-1]
        k = 0
        while k < min(len(dirs), len(self._stack)) and self._stack[k][0] == dirs[k]:
            k += 1
        for _, fd in self._stack[k:]:
            os.close(fd)
        del self._stack[k:]
        if self._root_fd is None:
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        parent = self._stack[-1][1] if self._stack else self._root_fd
        for p in dirs[k:]:
            parent = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            self._stack.append((p, parent))
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)

    def close(self) -> None:
        """Close the folders kept open (reading again reopens them)."""
        for _, fd in self._stack:
            os.close(fd)
        self._stack.clear()
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def __del__(self) -> None:
        if getattr(self, "_stack", None) is not None:
            self.close()

    def blocks(self, rel: str) -> Iterator[bytes]:
        """The bytes of ``rel`` in blocks of at most 1 MiB; exactly the scanned size, or StoreError."""
        size = self.size(rel)
        try:
            fd = self._open(rel)
        except OSError as e:
            raise StoreError(f"{rel}: cannot open ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise StoreError(f"{rel}: changed while being read")
            left = size  # never more than the scanned size, even if the file grows meanwhile
            while left:
                b = os.read(fd, min(left, _BLOCK))
                if not b:
                    raise StoreError(f"{rel}: changed while being read")
                left -= len(b)
                yield b
        finally:
            os.close(fd)

    def expect(self, digests: dict[str, str], fix: str) -> None:
        """From now on, :meth:`read` returns a file only when its SHA-256 is ``digests[rel]`` (the manifest's);
        anything else is StoreError naming the file and ``fix``."""
        self._expected, self._fix = dict(digests), fix

    def read(self, rel: str, limit: int | None = None) -> bytes:
        """The whole file ``rel`` (at most ``limit`` bytes, else StoreError)."""
        size = self.size(rel)
        if limit is not None and size > limit:
            raise StoreError(f"{rel}: {size} bytes, more than the {limit} allowed")
        data = b"".join(self.blocks(rel))
        if self._expected is not None and hashlib.sha256(data).hexdigest() != self._expected.get(rel):
            raise StoreError(f"{self.root}: {rel} differs from the artifact's manifest ({self._fix})")
        return data

    def sha256(self, rel: str) -> str:
        h = hashlib.sha256()
        for b in self.blocks(rel):
            h.update(b)
        return h.hexdigest()

    def json(self, rel: str) -> dict:
        """A JSON object file (bounded); StoreError when it is not one."""
        raw = self.read(rel, MAX_JSON_BYTES)
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise StoreError(f"{rel}: not valid JSON ({type(e).__name__})") from None
        if not isinstance(doc, dict):
            raise StoreError(f"{rel}: not a JSON object")
        return doc

    def _node(self, path: str) -> str:
        return f"{path}/zarr.json" if path else "zarr.json"

    def group_attrs(self, path: str) -> dict:
        """Attributes of the group at ``path`` ("" = the root)."""
        rel = self._node(path)
        meta = self.json(rel)
        if meta.get("zarr_format") != 3 or meta.get("node_type") != "group":
            raise StoreError(f"{rel}: not a zarr v3 group")
        attrs = meta.get("attributes", {})
        if not isinstance(attrs, dict):
            raise StoreError(f"{rel}: attributes are not an object")
        return attrs

    def node_problems(self) -> list[str]:
        """Every zarr.json of the store that is not a well-formed group or array node (one line each)."""
        out = []
        for rel in self.files:
            if rel != "zarr.json" and not rel.endswith("/zarr.json"):
                continue
            path = rel[: -len("zarr.json")].rstrip("/")
            try:
                meta = self.json(rel)
                if meta.get("node_type") == "array":
                    self.array_meta(path)
                elif (meta.get("node_type") != "group" or meta.get("zarr_format") != 3
                      or not meta.keys() <= GROUP_KEYS or not isinstance(meta.get("attributes", {}), dict)):
                    raise StoreError(f"{rel}: not a zarr v3 group or array")
            except StoreError as e:
                out.append(str(e))
        return out

    def children(self, path: str) -> list[str]:
        """Names of the nodes (groups or arrays) directly under ``path``."""
        return list(self._children.get(path, []))

    def is_array(self, path: str) -> bool:
        rel = self._node(path)
        return rel in self.files and self.json(rel).get("node_type") == "array"

    def array_meta(self, path: str) -> ArrayMeta:
        rel = self._node(path)
        try:
            return parse_array_meta(self.json(rel))
        except ValueError as e:
            raise StoreError(f"{rel}: {e}") from None

    def read_array(self, path: str) -> np.ndarray:
        """The array at ``path``; every chunk file is checked (presence, exact size) before allocating."""
        m = self.array_meta(path)
        want = m.chunk_file_bytes
        n = math.prod(m.grid)
        if n > len(self.files):  # before walking the grid: a huge declared shape fails here
            raise StoreError(f"{path}: declares shape {list(m.shape)} in {n} chunks, more than the store's files")
        for _, key in m.chunk_keys():
            got = self.files.get(f"{path}/{key}")
            if got is None:
                raise StoreError(f"{path}/{key}: chunk file missing")
            if got != want:
                raise StoreError(f"{path}/{key}: {got} bytes, the declared chunk needs {want}")
        out = np.empty(m.shape, dtype=m.dtype)
        le = m.dtype.newbyteorder("<")
        for idx, key in m.chunk_keys():
            raw = self.read(f"{path}/{key}")
            body, tail = raw[:-4], raw[-4:]
            if crc32c.crc32c(body) != int.from_bytes(tail, "little"):
                raise StoreError(f"{path}/{key}: chunk fails its CRC-32C")
            block = np.frombuffer(body, dtype=le).reshape(m.chunks)
            dst = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, m.chunks, m.shape, strict=True))
            out[dst] = block[tuple(slice(0, d.stop - d.start) for d in dst)]
        return out
