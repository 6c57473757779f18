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
from typing import Any, Protocol

import numpy as np

from .errors import FormatError


class Matrix(Protocol):
    """An encoded matrix of a registered format: what the code above formats/ may rely on."""

    shape: tuple[int, int]
    bits: int | None
    tile: tuple[int, int]

    def decode(self) -> np.ndarray: ...  # the codes (int8) or float16 values, [M, K]

    def validate(self) -> None: ...  # FormatError when the arrays are inconsistent


ArrayGetter = Callable[[str, bool], "np.ndarray | None"]  # (name, required) -> stored array


@dataclass(frozen=True)
class Format:
    """One encoding. ``holds_fp16``: it can store float16 values (not only b-bit codes); ``reorders_rows``:
    it takes per-tile row permutations; ``activation_sparsity``: its decode kernel skips inactive inputs
    (TEAL thresholds); ``outlier_side``: its kernel takes b-bit activations and an 8-bit outlier side product
    (Atom); ``extra_geometry``: the attrs beyond shape/bits/tile that describe a matrix (IE-BME: ``areas``), passed
    to the encoder and the geometry check by name; ``statistics``: the figures of docs/format.md, "Statistics";
    ``kernel_ops``: the names of the runtime ops its kernels provide (``kernels/runtime_ops.py``), which ``verify``
    and ``bench`` look their kernel checks and benchmarks up by (empty: no kernel of its own; the runtime then
    computes it from the decoded weight); ``stacker``: stacks matrices by rows, each padded to whole tiles
    (``formats.stacking``; None: the format cannot).

    A format module defines its matrix type and calls :func:`register` on import (``formats/__init__.py``
    imports the shipped ones, IE-BME first: the default)."""

    name: str
    matrix_type: type
    default_tile: tuple[int, int]
    arrays: tuple[str, ...]
    holds_fp16: bool
    reorders_rows: bool
    activation_sparsity: bool
    outlier_side: bool
    extra_geometry: tuple[str, ...]
    encoder: Callable[..., Any]  # (values, bits, tile, extra geometry, perm) -> matrix
    rebuilder: Callable[..., Any]  # (shape, bits, tile, extra geometry, array getter) -> matrix
    geometry_check: Callable[..., None]  # (tile, extra geometry, bits, group size) -> None or FormatError
    statistics: Callable[..., dict]  # (matrix, group size or None) -> figures
    kernel_ops: tuple[str, ...] = ()
    stacker: Callable[..., Any] | None = None  # (matrices of this format) -> their rows in one matrix

    @property
    def takes_quantized_activations(self) -> bool:
        """Whether a kernel of this format multiplies b-bit activation codes (the runtime op ``iebme_spmm``); without
        one, quantized activations run only on the CPU path."""
        return "iebme_spmm" in self.kernel_ops

    def _geometry(self, given: Mapping) -> dict:
        """The format's extra geometry out of ``given`` (None where not given); other keys are not its own."""
        return {k: given.get(k) for k in self.extra_geometry}

    def encode(self, values: np.ndarray, *, bits: int | None, tile: tuple[int, int], perm: np.ndarray | None = None,
               **geometry) -> Matrix:
        """Encode codes (``bits`` set) or float16 values (``bits`` None, formats that hold fp16); ``geometry``:
        values of the format's ``extra_geometry`` by name (others are ignored), ``perm`` for formats that
        reorder rows."""
        if bits is None and not self.holds_fp16:
            raise FormatError(f"{self.name} stores b-bit integer codes; float16 values need another format")
        return self.encoder(values, bits, tile, self._geometry(geometry), perm if self.reorders_rows else None)

    def check_geometry(self, tile: tuple[int, int], *, bits: int | None, group_size: int | None = None,
                       **geometry) -> None:
        """FormatError when the format cannot take this geometry (before any encoding work)."""
        if bits is None and not self.holds_fp16:
            raise FormatError(f"{self.name} stores b-bit integer codes, not float16 values")
        self.geometry_check(tile, self._geometry(geometry), bits, group_size)

    def reencode(self, m: Matrix, values: np.ndarray) -> Matrix:
        """Encode ``values`` with the geometry (and permutations) of ``m``."""
        return self.encode(values, bits=m.bits, tile=m.tile, perm=getattr(m, "perm", None),
                           **{k: getattr(m, k) for k in self.extra_geometry})

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
        """Figures of ``m`` (``group_size`` adds the fp16 scale bytes of b-bit codes; 128 when not given)."""
        out = self.statistics(m, group_size)
        out["format"] = self.name
        return out


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    if fmt.name in _REGISTRY:
        raise FormatError(f"format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def names() -> tuple[str, ...]:
    """Registered format names, in registration order (the first is the default)."""
    return tuple(_REGISTRY)


def names_with(capability: str) -> tuple[str, ...]:
    """Registered formats that have ``capability`` (a Format flag such as ``holds_fp16``), for messages."""
    return tuple(n for n, f in _REGISTRY.items() if getattr(f, capability))


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

