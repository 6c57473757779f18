"""`verify`: prove an artifact right, layer by layer; report every failure, not only the first.

Checks, in order:

1. The store: no links or special files (refused, nothing read), and the manifest (path, size and SHA-256 of
   every file; missing, extra or changed files). When files differ from a valid manifest, verify stops there:
   nothing in a store whose bytes are not the signed ones is decoded. A missing or old (crc32c) manifest is a
   failure too, but the checks below still run.
2. The root: marker, ``format_version`` (equal to the manifest's), complete; every zarr.json a well-formed
   node; the layer and dense indexes against the groups and arrays stored; tied names; ``model_config``
   builds (on the meta device) a model whose every tensor is stored with that shape.
3. Per layer: arrays readable (exact chunk sizes, CRC-32C), structure (offsets against bitmap popcounts,
   lengths, permutations), decode, re-encode from the decoded codes and compare every array byte for byte,
   codes in range, scales positive and finite; the figures ``inspect`` reports (``stats``, ``baselines``,
   reorder union counts, the root index entry) recomputed from the decoded layer and compared; format,
   bits and activation record against the stored recipe; and the
   layer's matmul through the CPU reference of the kernel arithmetic (and the GPU kernel when one is there)
   against the dense dequantized matmul on random activations.
4. The root ``summary`` recomputed from the layers; dense tensors readable and finite.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...formats import baselines, registry, stats
from ...formats.bitpack import code_range
from ..artifact.layout import MANIFEST
from ..artifact.scan import Store, StoreError
from ..artifact.store import Artifact, LayerRecord, _jsonable, check_manifest
from ..errors import UserError
from ..layer_rules import layer_options
from ..quantize.modes import QUANT_MODES
from ..quantize.outliers import add_side_figures


@dataclass
class VerifyResult:
    backend: str
    checked_layers: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    digest: str | None = None  # SHA-256 of the manifest file when it checks out: pins the artifact's bytes

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
    """Run the layer's kernels (CPU reference, and the GPU kernels for backend 'cupy') on random inputs: the checks
    of the runtime ops its format names (``Format.kernel_ops``; none for a format without kernels of its own)."""
    ops = registry.get(rec.format).kernel_ops
    return next((_KERNEL_CHECKS[op](rec, rng, ns, backend) for op in ops if op in _KERNEL_CHECKS), [])


def _tiled_cbc_checks(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    from ...kernels.tiled_cbc_check import check_tiled_cbc_layer

    gs, tau = rec.attrs.get("group_size"), rec.attrs.get("dp_threshold")
    return check_tiled_cbc_layer(rec.encoding, rec.scales, gs, tau, ns, backend, rng)


def _iebme_checks(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str) -> list[str]:
    from ...kernels.iebme_check import check_iebme_layer

    e = rec.encoding
    act = rec.attrs.get("activations") or {}
    gpu_geometry = (e.tile, e.areas) == ((16, 64), (2, 2))  # the GPU kernel's geometry
    be = backend if gpu_geometry else "cpu"
    bits = int(act.get("bits") or 4)
    if bits == 16:  # W4A16 / W2A16: the float16-activation kernel (and the arrays through the integer path)
        from ...kernels import iebme_spmm
        from ...kernels.iebme_check import check_iebme_float_layer

        be16 = be if iebme_spmm.FLOAT16_ACTIVATIONS else "cpu"  # the GPU kernel only where the runtime uses it
        out = check_iebme_float_layer(e, rec.scales, int(rec.attrs["group_size"]), ns, be16, rng, rec.name)
        return out + check_iebme_layer(e, rec.scales, int(rec.attrs["group_size"]), 4, ns, "cpu", rng, rec.name)
    out = check_iebme_layer(e, rec.scales, int(rec.attrs["group_size"]), bits, ns, be, rng, rec.name)
    if rec.outliers is not None and not out:  # Y = main IE-BME product + 8-bit side product, vs dense
        from ...kernels.outlier_check import check_outlier_layer

        out += check_outlier_layer(e, rec.scales, int(rec.attrs["group_size"]), act, rec.outliers, ns, be, rng,
                                   rec.name)
    return out


_KERNEL_CHECKS = {"iebme_spmm": _iebme_checks, "spmspv": _tiled_cbc_checks}  # by runtime op (Format.kernel_ops)


def verify_layer(rec: LayerRecord, rng: np.random.Generator, ns: list[int], backend: str,
                 codes: np.ndarray | None = None) -> list[str]:
    e = rec.encoding
    codes = e.decode() if codes is None else codes
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
    problems += figure_problems(rec, codes)
    if not problems:
        problems += kernel_checks(rec, rng, ns, backend)
    return problems


def _same(a: object, b: object) -> bool:
    """JSON values equal (ints and floats compare as numbers, exactly: the figures are recomputed with the
    same arithmetic; bools apart)."""
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _differences(name: str, key: str, stored: object, want: dict) -> list[str]:
    """One message per top-level entry of ``key`` where the stored attribute differs from ``want``."""
    if not isinstance(stored, dict):
        return [f"layer {name}: attribute '{key}' is missing or not an object"]
    bad = sorted(k for k in want.keys() | stored.keys() if not _same(stored.get(k), want.get(k)))
    return [f"layer {name}: {key}.{k} is {stored.get(k)!r} in the attributes, {want.get(k)!r} from the arrays"[:300]
            for k in bad]


def layer_figures(rec: LayerRecord, codes: np.ndarray) -> dict:
    """``stats`` and ``baselines`` as compress records them, recomputed from the decoded layer."""
    e = rec.encoding
    gs = rec.attrs.get("group_size") if e.bits is not None else None
    out = {"stats": stats(e, group_size=gs), "baselines": baselines(codes != 0, e.bits or 16, gs)}
    if rec.outliers is not None:
        add_side_figures(out, rec.outliers, e.bits)
    return _jsonable(out)


def identity_union_positions(codes: np.ndarray, tile: tuple[int, int], areas: tuple[int, int]) -> int:
    """Union-mask positions of an IE-BME matrix's codes with every tile's rows in their original order."""
    (hl, kl), (ra, ca) = tile, areas
    m, k = codes.shape
    mask = np.zeros((-(-m // hl) * hl, -(-k // kl) * kl), dtype=bool)
    mask[:m, :k] = codes != 0
    t = mask.reshape(mask.shape[0] // hl, ra, hl // ra, mask.shape[1] // kl, ca, kl // ca)
    return int(t.any(axis=(1, 4)).sum())


def figure_problems(rec: LayerRecord, codes: np.ndarray) -> list[str]:
    """What ``inspect`` reports of the layer (stats, baselines, reorder union counts) against its arrays."""
    want = layer_figures(rec, codes)
    a, name = rec.attrs, rec.name
    out = _differences(name, "stats", a.get("stats"), want["stats"])
    out += _differences(name, "baselines", a.get("baselines"), want["baselines"])
    r = a.get("reorder")
    if r is not None:
        e = rec.encoding
        if not registry.of(e).reorders_rows or not isinstance(r, dict):
            return out + [f"layer {name}: attribute 'reorder' does not describe a layer with row permutations"]
        g = e.geometry
        slots = g.n_tiles * g.h * g.w
        before, after = identity_union_positions(codes, e.tile, e.areas), want["stats"]["union_positions"]
        figures = {"union_positions_before": before, "union_positions_after": after, "union_slots": slots,
                   "union_density_before": before / slots if slots else 0.0,
                   "union_density_after": after / slots if slots else 0.0}
        out += _differences(name, "reorder", {k: r.get(k) for k in figures}, figures)
    return out


def recipe_problems(rec: LayerRecord, config: object) -> list[str]:
    """The layer against the stored recipe: format, weight bits, prune/quant names, activation record."""
    from ...formats.arithmetic.activations import activation_scheme
    from ..quantize.act_clip import ACT_CLIP_GRID

    if config is None:
        return [f"layer {rec.name}: the recipe's per-layer rules keep this linear dense, yet it is compressed"]
    quant = config.get("quant") if isinstance(config, dict) else None
    if not isinstance(quant, str) or quant not in QUANT_MODES:
        return [f"layer {rec.name}: the stored recipe (config) names no known --quant"]
    a, name, out = rec.attrs, rec.name, []
    mode = QUANT_MODES[quant]
    wbits, abits = mode.weight_bits, mode.act_bits
    if rec.format != config.get("format") or rec.encoding.bits != wbits:
        out.append(f"layer {name}: {rec.format} with {rec.encoding.bits}-bit values, the recipe says "
                   f"{config.get('format')!r} {quant}")
    out += [f"layer {name}: attribute '{k}' is {a.get(k)!r}, the recipe says {config.get(k)!r}"
            for k in ("prune", "quant") if a.get(k) != config.get(k)]
    act = a.get("activations")
    if not mode.quantizes_activations:  # float16 activations: compress stores no activation record
        if act is not None:
            out.append(f"layer {name}: an activation record on a {quant} layer")
    elif not isinstance(act, dict) or act.get("clip") not in (1.0, *ACT_CLIP_GRID):
        out.append(f"layer {name}: activation record missing or its clip is not one compress calibrates")
    else:
        channels = None if rec.outliers is None else [int(c) for c in rec.outliers.channels]
        if not _same(act, _jsonable(activation_scheme(abits, a.get("group_size"), act["clip"], channels))):
            out.append(f"layer {name}: activation record differs from the {quant} scheme")
    return out


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


def _open_store(path: str) -> Store | str:
    """The scanned store, or the one line refusing it (a link or special file). Not ours: UserError."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"{path}: no such artifact")
    if not root.is_dir() or not any(os.path.lexists(root / n) for n in ("zarr.json", MANIFEST)):
        raise UserError(f"{path}: not a unionsparse artifact (no zarr.json)")
    try:
        return Store(root)
    except StoreError as e:
        return str(e)


def model_problems(art: Artifact) -> list[str]:
    """``model_config`` builds (on the meta device) a model whose every tensor is stored with its shape."""
    import torch

    from ..model.rebuild import check_model_fits, model_config

    try:
        check_model_fits(art, model_config(art), torch.float32)
    except UserError as e:
        return [str(e)]
    return []


def root_problems(art: Artifact, manifest_version: object) -> list[str]:
    """The root attributes against the manifest and the groups and arrays stored; every node well-formed."""
    out = art.store.node_problems()
    fv = art.attrs.get("format_version")
    if manifest_version is not None and manifest_version != fv:
        out.append(f"root: format_version {fv!r} differs from the manifest's {manifest_version!r}")
    for key, kind, folder in (("layers", dict, "layers"), ("dense", list, "dense")):
        index = art.attrs.get(key)
        if not isinstance(index, kind):
            out.append(f"root: attribute '{key}' (the {folder} index) is missing or malformed")
            continue
        stored = set(art.group_names(folder))
        out += [f"{folder} {n}: stored but not in the root index" for n in sorted(stored - set(index))]
        if key == "dense":
            out += [f"dense {n}: in the root index but not stored" for n in index if n not in stored]
    tied = art.attrs.get("tied", {})
    dense = art.attrs.get("dense")
    if not isinstance(tied, dict) or not all(isinstance(dense, list) and v in dense for v in tied.values()):
        out.append("root: attribute 'tied' names tensors that are not stored")
    return out


def index_problems(art: Artifact, rec: LayerRecord) -> list[str]:
    """The layer's entry in the root index (format, shape, bits) against the layer itself."""
    entry = (art.attrs.get("layers") or {}).get(rec.name) if isinstance(art.attrs.get("layers"), dict) else None
    want = {"format": rec.format, "shape": list(rec.encoding.shape), "bits": rec.encoding.bits}
    if entry != want:
        return [f"layer {rec.name}: root index entry {entry!r} differs from the layer {want!r}"[:300]]
    return []


def summary_problems(art: Artifact, figures: dict[str, dict]) -> list[str]:
    """The root ``summary`` (all but ``seconds``) against the sums of the layers' recomputed figures."""
    from ..pipeline.compress import LayerTotals

    stored = art.attrs.get("summary")
    if stored is None:
        return []
    totals = LayerTotals()
    for name, attrs in figures.items():
        totals.add(name, attrs)
    rules = art.attrs.get("layer_rules") or {}
    for name, rule in rules.items() if isinstance(rules, dict) else ():  # linears the rules kept dense
        if rule == {"dense": True}:
            meta = art.store.array_meta(f"dense/{name}.weight")
            totals.add_dense(name, tuple(meta.shape))
    want = _jsonable(totals.summary())
    if not isinstance(stored, dict):
        return ["root: attribute 'summary' is not an object"]
    keys = sorted((want.keys() | stored.keys()) - {"seconds"})
    return [f"root: summary.{k} is {stored.get(k)!r}, the layers give {want.get(k)!r}"[:300]
            for k in keys if not _same(stored.get(k), want.get(k))]


def _guarded(what: str, check, *args) -> list[str]:
    """``check(*args)``; an exception on crafted metadata is a failure, not a crash."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - whatever a crafted store triggers is reported, not raised
        return [f"{what}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:300]}"]


def verify(path: str, backend: str = "auto", ns: list[int] | None = None, seed: int = 0,
           on_layer=None) -> VerifyResult:
    """Every check of the module docstring on artifact ``path``; bad input (not an artifact) is UserError."""
    backend, note = resolve_backend(backend)
    res = VerifyResult(backend)
    if note:
        res.notes.append(note)
    store = _open_store(path)
    if isinstance(store, str):  # a link or special file: refused, nothing read
        res.failures.append(store)
        return res
    m = check_manifest(store)
    if m.newer:
        raise UserError(f"{path}: written by a newer unionsparse (format_version {m.format_version!r}); "
                        "upgrade unionsparse")
    res.failures += m.problems
    if m.present and not m.legacy and m.problems:
        return res  # the bytes are not the ones the manifest lists: nothing is decoded
    res.digest = m.digest
    try:
        art = Artifact(path, store=store, verify=False)
    except UserError as e:
        if not m.present:
            raise
        res.failures.append(str(e))
        return res
    try:
        names = art.layer_names
        dense_names = art.dense_names
    except StoreError as e:
        res.failures.append(str(e))
        return res
    res.failures += _guarded("root", root_problems, art, m.format_version if m.present and not m.legacy else None)
    res.failures += _guarded("root", model_problems, art)
    rng = np.random.default_rng(seed)
    ns = ns or [1, 8]
    figures: dict[str, dict] | None = {}
    for name in names:
        try:
            rec = art.read_layer(name)
            codes = rec.encoding.decode()
            problems = verify_layer(rec, rng, ns, backend, codes)
            problems += _guarded(f"layer {name}", index_problems, art, rec)
            problems += _guarded(f"layer {name}", recipe_problems, rec, layer_options(art.attrs.get("config"), name))
            if figures is not None and not problems:
                figures[name] = {**layer_figures(rec, codes), "format": rec.format, "bits": rec.encoding.bits,
                                 "reorder": rec.attrs.get("reorder")}
            res.failures += problems
        except Exception as e:  # corruption can surface as any decode or store error: report, go on
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            res.failures.append(msg[:300] if msg.startswith(f"layer {name}") else f"layer {name}: {msg[:300]}")
        if name not in (figures or {}):
            figures = None  # a layer failed: the summary cannot be recomputed
        res.checked_layers += 1
        if on_layer:
            on_layer(name)
    if figures is not None:
        res.failures += _guarded("root", summary_problems, art, figures)
    for name in dense_names:
        try:
            a = art.read_dense(name)
            if a.dtype.kind != "f":
                res.failures.append(f"dense {name}: dtype {a.dtype} is not a float type")
            elif not np.isfinite(a).all():
                res.failures.append(f"dense {name}: holds NaN or inf")
        except Exception as e:
            res.failures.append(f"dense {name}: unreadable ({str(e).strip()[:200] or type(e).__name__})")
    return res
