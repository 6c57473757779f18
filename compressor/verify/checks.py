"""`verify`: prove an artifact right, layer by layer; report every failure, not only the first.

Checks, per artifact: the manifest (size and crc32c of every file, missing or extra files). Per layer:
arrays readable (crc32c codec), structure (offsets against bitmap popcounts, lengths, permutations),
decode, re-encode from the decoded codes and compare every array byte for byte, codes in range, scales
positive and finite, and the layer's matmul through the CPU reference of the kernel arithmetic (and the
GPU kernel when one is there) against the dense dequantized matmul on random activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...formats import iebme, registry, tiled_cbc
from ...formats.bitpack import code_range
from ..artifact.store import MANIFEST, Artifact, LayerRecord, check_manifest
from ..errors import UserError


@dataclass
class VerifyResult:
    backend: str
    checked_layers: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def reencode(rec: LayerRecord, codes: np.ndarray) -> registry.Matrix:
    return registry.of(rec.encoding).reencode(rec.encoding, codes)


def compare_arrays(rec: LayerRecord, again) -> list[str]:
    fresh = LayerRecord(rec.name, again, rec.scales, rec.attrs, rec.outliers).arrays()
    out = []
    for k, v in rec.arrays().items():
        w = fresh.get(k)
        if w is None or w.dtype != v.dtype or w.shape != v.shape or not np.array_equal(w, v):
            out.append(f"layer {rec.name}: array '{k}' differs from a fresh encoding of its decoded codes")
    return out


def kernel_checks(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    """Run the layer's kernels (CPU reference, and the GPU kernels for backend 'cupy') on random inputs."""
    return _KERNEL_CHECKS[rec.format](rec, rng, ns, backend)


def _tiled_cbc_checks(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    from ...kernels.tiled_cbc_check import check_tiled_cbc_layer

    gs, tau = rec.attrs.get("group_size"), rec.attrs.get("dp_threshold")
    return check_tiled_cbc_layer(rec.encoding, rec.scales, gs, tau, ns, backend, rng)


def _iebme_checks(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    from ...kernels.iebme_check import check_iebme_layer

    e = rec.encoding
    act = rec.attrs.get("activations") or {}
    # W4A16 layers have no integer kernel yet: their arrays are still checked through the W4A4 path
    gpu_geometry = (e.tile, e.areas) == ((16, 64), (2, 2))  # the GPU kernel's geometry
    be = backend if gpu_geometry else "cpu"
    out = check_iebme_layer(e, rec.scales, int(rec.attrs["group_size"]), act.get("bits") or 4, ns, be, rng,
                            rec.name)
    if rec.outliers is not None and not out:  # Y = main IE-BME product + 8-bit side product, vs dense
        from ...kernels.outlier_check import check_outlier_layer

        out += check_outlier_layer(e, rec.scales, int(rec.attrs["group_size"]), act, rec.outliers, ns, be, rng,
                                   rec.name)
    return out


_KERNEL_CHECKS = {iebme.NAME: _iebme_checks, tiled_cbc.NAME: _tiled_cbc_checks}  # the kernels of each format


def verify_layer(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    e = rec.encoding
    codes = e.decode()
    problems = compare_arrays(rec, reencode(rec, codes))
    if e.bits is not None:
        lo, hi = code_range(e.bits)
        if codes.size and (codes.min() < lo or codes.max() > hi):
            problems.append(f"layer {rec.name}: codes outside the {e.bits}-bit range")
        s = rec.scales.astype(np.float32)
        if not (np.isfinite(s).all() and (s > 0).all()):
            problems.append(f"layer {rec.name}: scales are not all positive and finite")
    if rec.outliers is not None:
        problems += outlier_problems(rec, codes)
    if not problems:
        problems += kernel_checks(rec, rng, ns, backend)
    return problems


def outlier_problems(rec: LayerRecord, codes: np.ndarray) -> list[str]:
    """The side matrix against its layer: scales positive and finite, main columns of the outliers empty."""
    side, out = rec.outliers, []
    s = side.scales.astype(np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
        out.append(f"layer {rec.name}: outlier_scales are not all positive and finite")
    n = side.channels.size
    if np.count_nonzero(codes[:, codes.shape[1] - n :]):
        out.append(f"layer {rec.name}: the main matrix holds codes in the {n} outlier columns (must be zero)")
    act = rec.attrs.get("activations") or {}
    if act.get("bits") == 16 or int(act.get("outlier_bits", 0)) != side.bits:
        out.append(f"layer {rec.name}: activation record does not describe {side.bits}-bit outlier inputs")
    return out


def resolve_backend(backend: str) -> tuple[str, str | None]:
    """'auto' picks cupy when a GPU is usable; returns (backend, note)."""
    from ...kernels import available as gpu_available

    if backend == "cpu":
        return "cpu", None
    if gpu_available():
        return "cupy", None
    if backend == "cupy":
        raise UserError("--backend cupy: CuPy or a CUDA device is not available here (use --backend cpu)")
    return "cpu", "no GPU here: ran the CPU reference of the kernels only"


def verify(path: str, backend: str = "auto", ns: list[int] | None = None, seed: int = 0,
           on_layer=None) -> VerifyResult:
    backend, note = resolve_backend(backend)
    res = VerifyResult(backend)
    if note:
        res.notes.append(note)
    root = Path(path)
    if (root / MANIFEST).is_file():  # a store of ours: corruption is a failed check, not bad input
        res.failures += check_manifest(root)
    try:
        art = Artifact(path)
    except UserError as e:
        if not res.failures:
            raise
        res.failures.append(str(e))
        return res
    rng = np.random.default_rng(seed)
    ns = ns or [1, 8]
    for name in art.layer_names:
        try:
            rec = art.read_layer(name)
            res.failures += verify_layer(rec, rng, ns, backend)
        except Exception as e:  # corruption can surface as any decode or zarr error: report, go on
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            res.failures.append(f"layer {name}: {msg[:300]}")
        res.checked_layers += 1
        if on_layer:
            on_layer(name)
    for name in art.dense_names:
        try:
            a = art.read_dense(name)
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                res.failures.append(f"dense {name}: holds NaN or inf")
        except Exception as e:
            res.failures.append(f"dense {name}: unreadable ({type(e).__name__})")
    return res
