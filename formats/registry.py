"""What a format is, and the registry of them.

A :class:`Format` owns everything the rest of the code needs to know about one encoding: its name and default
geometry, what values it can hold, how a matrix is encoded, which arrays it stores and how it is rebuilt from
them, the attributes that describe its geometry, and its statistics. The artifact, ``verify``, ``inspect``,
the configuration and the benchmarks go through :func:`get` / :func:`of` and never branch on a format's name,
so a third format is one new module that calls :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from . import iebme, tiled_cbc
from .errors import FormatError
from .storage_stats import stats

Matrix = iebme.IEBMEMatrix | tiled_cbc.TiledCBCMatrix
ArrayGetter = Callable[[str, bool], "np.ndarray | None"]  # (name, required) -> stored array


@dataclass(frozen=True)
class Format:
    """One encoding. ``holds_fp16``: it can store float16 values (not only b-bit codes); ``reorders_rows``:
    it takes per-tile row permutations; ``activation_sparsity``: its decode kernel skips inactive inputs
    (TEAL thresholds); ``outlier_side``: its kernel takes b-bit activations and an 8-bit outlier side product
    (Atom); ``extra_geometry``: the attrs beyond shape/bits/tile that describe a matrix; ``stacker``: stacks
    matrices by rows, each padded to whole tiles (``formats.stacking``; None: the format cannot)."""

    name: str
    matrix_type: type
    default_tile: tuple[int, int]
    arrays: tuple[str, ...]
    holds_fp16: bool
    reorders_rows: bool
    activation_sparsity: bool
    outlier_side: bool
    extra_geometry: tuple[str, ...]
    encoder: Callable[..., Matrix]  # (values, bits, tile, extra geometry, perm) -> matrix
    rebuilder: Callable[..., Matrix]  # (shape, bits, tile, extra geometry, array getter) -> matrix
    geometry_check: Callable[..., None]  # (tile, extra geometry, bits, group size) -> None or FormatError
    stacker: Callable[..., Matrix] | None = None  # (matrices of this format) -> their rows in one matrix

    def encode(self, values: np.ndarray, *, bits: int | None, tile: tuple[int, int],
               areas: tuple[int, int] | None = None, perm: np.ndarray | None = None) -> Matrix:
        """Encode codes (``bits`` set) or float16 values (``bits`` None, formats that hold fp16)."""
        if bits is None and not self.holds_fp16:
            raise FormatError(f"{self.name} stores b-bit integer codes; float16 values need another format")
        return self.encoder(values, bits, tile, {"areas": areas}, perm)

    def check_geometry(self, tile: tuple[int, int], *, bits: int | None, group_size: int | None = None,
                       areas: tuple[int, int] | None = None) -> None:
        """FormatError when the format cannot take this geometry (before any encoding work)."""
        if bits is None and not self.holds_fp16:
            raise FormatError(f"{self.name} stores b-bit integer codes, not float16 values")
        self.geometry_check(tile, {"areas": areas}, bits, group_size)

    def reencode(self, m: Matrix, values: np.ndarray) -> Matrix:
        """Encode ``values`` with the geometry (and permutations) of ``m``."""
        return self.encode(values, bits=m.bits, tile=m.tile, areas=getattr(m, "areas", None),
                           perm=getattr(m, "perm", None))

    def to_arrays(self, m: Matrix) -> dict[str, np.ndarray]:
        """The arrays an artifact stores for ``m`` (optional ones only when present)."""
        out = {k: getattr(m, k) for k in self.arrays}
        return {k: v for k, v in out.items() if v is not None}

    def geometry_attrs(self, m: Matrix) -> dict:
        """Attributes that, with the arrays, rebuild ``m``."""
        out = {"format": self.name, "shape": list(m.shape), "bits": m.bits, "tile": list(m.tile)}
        out.update({k: list(getattr(m, k)) for k in self.extra_geometry})
        return out

    def from_arrays(self, attrs: Mapping, arr: ArrayGetter) -> Matrix:
        """Rebuild and validate a matrix from its attrs and stored arrays (FormatError names what is wrong)."""
        try:
            shape, bits, tile = tuple(attrs["shape"]), attrs["bits"], tuple(attrs["tile"])
            extra = {k: tuple(attrs[k]) for k in self.extra_geometry}
        except (KeyError, TypeError) as e:
            raise FormatError(f"attribute {e} is missing or malformed") from None
        return self.rebuilder(shape, bits, tile, extra, arr)

    def stats(self, m: Matrix, group_size: int | None = None) -> dict:
        return stats(m, group_size=group_size)


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    if fmt.name in _REGISTRY:
        raise FormatError(f"format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def names() -> tuple[str, ...]:
    """Registered format names, in registration order (the first is the default)."""
    return tuple(_REGISTRY)


def get(name: str) -> Format:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise FormatError(f"unknown format {name!r} (known: {', '.join(_REGISTRY)})") from None


def of(m: Matrix) -> Format:
    """The format of an encoded matrix."""
    for fmt in _REGISTRY.values():
        if isinstance(m, fmt.matrix_type):
            return fmt
    raise FormatError(f"{type(m).__name__} is not an encoded matrix of a registered format")


def _iebme_geometry(tile, extra, bits, group_size) -> None:
    iebme.Geometry((0, 0), tuple(tile), tuple(extra["areas"] or iebme.DEFAULT_AREAS), 4 if bits is None else bits)
    if group_size is not None and group_size % tile[1]:  # a tile must lie inside one scale group
        raise FormatError(f"group size {group_size} must be a multiple of the tile width {tile[1]}")


register(Format(
    iebme.NAME, iebme.IEBMEMatrix, iebme.DEFAULT_TILE, ("bitmaps", "offsets", "values", "perm"),
    holds_fp16=False, reorders_rows=True, activation_sparsity=False, outlier_side=True, extra_geometry=("areas",),
    encoder=lambda v, bits, tile, extra, perm: iebme.encode(v, bits, tile, extra["areas"] or iebme.DEFAULT_AREAS,
                                                            perm),
    rebuilder=lambda shape, bits, tile, extra, arr: iebme.from_arrays(
        shape, bits, tile, extra["areas"], arr("bitmaps", True), arr("offsets", True), arr("values", True),
        arr("perm", False)),
    geometry_check=_iebme_geometry,
    stacker=iebme.stack_rows,
))
register(Format(
    tiled_cbc.NAME, tiled_cbc.TiledCBCMatrix, tiled_cbc.DEFAULT_TILE, ("bitmap", "colinfo", "tile_offset", "values"),
    holds_fp16=True, reorders_rows=False, activation_sparsity=True, outlier_side=False, extra_geometry=(),
    encoder=lambda v, bits, tile, extra, perm: tiled_cbc.encode(v, tile=tile, bits=bits),
    rebuilder=lambda shape, bits, tile, extra, arr: tiled_cbc.from_arrays(
        shape, tile, bits, arr("bitmap", True), arr("colinfo", True), arr("tile_offset", True),
        arr("values", True)),
    geometry_check=lambda tile, extra, bits, group_size: tiled_cbc.Geometry((0, 0), tuple(tile), bits),
    stacker=tiled_cbc.stack_rows,
))
