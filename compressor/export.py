"""`unionsparse export`: an artifact as a folder other tools load (SPEC section 9).

* :func:`export_hf`: a Hugging Face folder (config.json, safetensors shards, generation config, tokenizer)
  whose weights are the artifact's decoded values in fp16 (exact zeros where pruned, ``code · scale``,
  outlier side matrices folded back), built by :func:`.model.rebuild.rebuild_model` without activation quantization.
* :func:`export_compressed_tensors`: the same model with every integer-coded layer in compressed-tensors'
  ``pack-quantized`` layout (``weight_packed`` int32, ``weight_scale``, ``weight_shape``), written by the
  ``compressed-tensors`` package itself and read back through it: the codes and scales must equal the
  artifact's bit for bit. Layers it cannot hold (outlier channels, a ragged last group) stay dense fp16 and are
  named in ``ignore``.

Both write ``DIR.partial`` and rename it to ``DIR`` at the end, with a sidecar ``unionsparse.json`` (what was
exported, what the target cannot express, the files written). ``--overwrite`` replaces only a folder whose
sidecar lists every file in it. The tokenizer and generation config are copied from the artifact's source model
when it is a local folder or .gguf file; the network is never used.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..formats.errors import FormatError
from .artifact.store import Artifact, tool_version
from .errors import UserError
from .files import environment_errors, file_mode
from .output_lock import output_lock

SIDECAR = "unionsparse.json"
SIDECAR_KEY = "unionsparse_export"
TARGETS = ("hf", "compressed-tensors")
DEFAULT_SHARD_SIZE = "5GB"
# Files of a Hugging Face model folder that describe the tokenizer (copied byte for byte when present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    """What an export wrote and what it could not carry over."""

    out: Path
    target: str
    files: list[str]
    not_expressed: list[str]  # one line per feature of the artifact the target cannot hold
    notes: list[str] = field(default_factory=list)  # tokenizer / generation config: copied or why not
    dense_layers: dict[str, str] = field(default_factory=dict)  # compressed-tensors: layer -> why it is fp16
    packing: list[dict] = field(default_factory=list)  # compressed-tensors: bits, group size, layers per scheme

    def to_json(self) -> dict:
        return {"output": str(self.out), "target": self.target, "files": self.files,
                "not_expressed": self.not_expressed, "notes": self.notes, "dense_layers": self.dense_layers,
                "packing": self.packing}


# ------------------------------------------------------------------------------------------ targets


def export_hf(artifact: str | Path | Artifact, out_dir: str | Path, *, overwrite: bool = False,
              max_shard_size: str | int = DEFAULT_SHARD_SIZE, verify: bool = True) -> ExportResult:
    """Write ``out_dir`` as a Hugging Face folder of the artifact's decoded fp16 weights (``verify``: its files
    checked against its manifest as they are read)."""
    art = _open(artifact, verify)
    shard = _shard_bytes(max_shard_size)
    out = Path(out_dir)
    with _output_folder(out, overwrite) as tmp:
        with _stage("decoding the layers into an fp16 model"):
            model = _fp16_model(art)
        with _stage("writing safetensors"):
            _save_pretrained(model, tmp, shard)
        notes = _copy_tokenizer(art, tmp)
        lost = _not_expressed(art, "hf")
        return _finish(tmp, out, art, "hf", lost, notes, {})


def export_compressed_tensors(artifact: str | Path | Artifact, out_dir: str | Path, *, overwrite: bool = False,
                              max_shard_size: str | int = DEFAULT_SHARD_SIZE, verify: bool = True) -> ExportResult:
    """Write ``out_dir`` as a compressed-tensors ``pack-quantized`` checkpoint of an integer-coded artifact."""
    art = _open(artifact, verify)
    shard = _shard_bytes(max_shard_size)
    plan = _pack_plan(art)
    _require_compressed_tensors()
    out = Path(out_dir)
    with _output_folder(out, overwrite) as tmp:
        with _stage("decoding the layers into an fp16 model"):
            model = _fp16_model(art)
        with _stage("packing with compressed-tensors"):
            compressor = _compress(model, art, plan)
        with _stage("writing safetensors"):
            _save_pretrained(model, tmp, shard)
            compressor.update_config(str(tmp))
        with _stage("reading the checkpoint back through compressed-tensors"):
            _check_packed(tmp, art, plan)
        notes = _regroup_notes(plan) + _copy_tokenizer(art, tmp)
        lost = _not_expressed(art, "compressed-tensors", plan.dense)
        return _finish(tmp, out, art, "compressed-tensors", lost, notes, plan.dense, _packing(plan))


EXPORTERS: dict[str, Callable[..., ExportResult]] = {"hf": export_hf, "compressed-tensors": export_compressed_tensors}


# ---------------------------------------------------------------------------------------- the model


@contextlib.contextmanager
def _stage(description: str) -> Iterator[None]:
    """One INFO line per finished stage (``--log-level info``), as the other commands' stages give."""
    t0 = time.perf_counter()
    yield
    log.info("%s in %.1f s", description, time.perf_counter() - t0)


def _open(artifact: str | Path | Artifact, verify: bool = True) -> Artifact:
    return artifact if isinstance(artifact, Artifact) else Artifact(artifact, verify=verify)


def _fp16_model(art: Artifact) -> nn.Module:
    """The artifact's model in fp16 with plain linears holding the dequantized weights (``eval``'s weights)."""
    from .model.rebuild import rebuild_model

    try:
        model = rebuild_model(art, act_quant=False, dtype=torch.float16)
    except FormatError as e:
        raise UserError(f"{art.path}: {e} (run `unionsparse verify`)") from None
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise UserError(f"{art.path}: tensor {name} holds values beyond fp16's range; an fp16 export cannot "
                            "hold them")
    return model


def _shard_bytes(size: str | int) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    text = str(size).strip()
    try:
        n = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise UserError(f"--max-shard-size: expected a size such as 5GB, 500MB or 2GiB, got {size!r}")
    return n


def _save_pretrained(model: nn.Module, folder: Path, shard: int) -> None:
    """``save_pretrained``; safetensors' I/O errors (raised as SafetensorError) come back as the OSError they are."""
    import re

    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder), max_shard_size=shard)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        n = int(code.group(1))
        raise OSError(n, os.strerror(n), str(folder)) from None


# ------------------------------------------------------------------------------ compressed-tensors


MIN_EXPORT_GROUP = 32  # the smallest group size the export picks (vLLM's 4-bit kernels take 32, 64, 128)


@dataclass
class PackPlan:
    """Which layers go into which pack-quantized scheme, and which stay dense (and why)."""

    schemes: dict[tuple[int, int], list[str]]  # (bits, group size; 0 = one scale per output row) -> layers
    dense: dict[str, str]
    stored_group: dict[str, int] = field(default_factory=dict)  # layer -> the artifact's group size
    regrouped: list[dict] = field(default_factory=list)  # schemes whose group size is smaller than the artifact's

    def scales(self, name: str, stored: np.ndarray, k: int) -> np.ndarray:
        """The exported scales of ``name``: the stored ones, each repeated over the smaller exported groups it
        covers (the same weights: every exported group lies inside one stored group)."""
        g = self.stored_group[name]
        size = next(size for (_, size), names in self.schemes.items() if name in names) or g  # 0: per channel
        return np.ascontiguousarray(stored[:, np.arange(-(-k // size)) * size // g])


def export_group(g: int, ks: list[int]) -> int | None:
    """The group size a scheme is exported with: the artifact's ``g`` when it divides every K, else the largest
    ``g / 2^i`` (at least :data:`MIN_EXPORT_GROUP`) that does, which also divides ``g``; None when none does."""
    e = g
    while e >= MIN_EXPORT_GROUP:
        if all(k % e == 0 for k in ks):
            return e
        if e % 2:
            break
        e //= 2
    return None


def _pack_plan(art: Artifact) -> PackPlan:
    """Group the artifact's layers by pack-quantized scheme; UserError when none can be packed. A group size that
    does not divide some K is exported as the largest smaller one that divides every K (:func:`export_group`)."""
    requested = (art.attrs.get("config") or {}).get("group_size")
    grouped: dict[tuple[int, int], list[tuple[str, int]]] = {}
    plan = PackPlan({}, {})
    for name in art.layer_names:
        a = art.layer_attrs(name)
        bits, (_, k) = a.get("bits"), a["shape"]
        if bits is None:
            raise UserError(f"--to compressed-tensors: {art.path} holds fp16 values (quant "
                            f"{a.get('quant', 'none')}), not integer codes; use --to hf")
        g = min(int(a["group_size"]), k)
        plan.stored_group[name] = g
        if (a.get("activations") or {}).get("outlier_channels"):
            plan.dense[name] = "outlier channels (8-bit side matrix)"
        elif g == k and isinstance(requested, int) and requested > k:  # clamped to K: compressed-tensors' "channel"
            plan.schemes.setdefault((int(bits), 0), []).append(name)
        else:
            grouped.setdefault((int(bits), g), []).append((name, k))
    for (bits, g), members in grouped.items():
        e = export_group(g, [k for _, k in members])
        if e is None:  # no common group size: the layers whose K it divides keep it, the others stay dense
            e = g
            for name, k in members:
                if k % g:
                    plan.dense[name] = f"ragged last group (K={k} is not a multiple of group size {g})"
        elif e != g:
            ks = sorted({k for _, k in members if k % g})
            plan.regrouped.append({"bits": bits, "group_size": e, "artifact_group_size": g, "layers": len(members),
                                   "k": ks})
        names = [n for n, _ in members if n not in plan.dense]
        if names:
            plan.schemes.setdefault((bits, e), []).extend(names)
    if not plan.schemes:
        first = next(iter(plan.dense.values()), "no layers")
        raise UserError(f"--to compressed-tensors: no layer of {art.path} can be packed ({len(plan.dense)} layers: "
                        f"{first}); use --to hf")
    return plan


def _packing(plan: PackPlan) -> list[dict]:
    """The schemes written, for the sidecar: bits, group size (``channel``: one scale per row), layers, and the
    artifact's group size where the export's is smaller."""
    out = []
    for (bits, size), names in plan.schemes.items():
        stored = sorted({plan.stored_group[n] for n in names})
        out.append({"bits": bits, "group_size": size or "channel", "layers": len(names),
                    "artifact_group_size": stored[0] if len(stored) == 1 else stored})
    return out


def _regroup_notes(plan: PackPlan) -> list[str]:
    return [f"group size {r['group_size']} instead of the artifact's {r['artifact_group_size']} for {r['layers']} "
            f"{r['bits']}-bit layers (K = {', '.join(map(str, r['k']))} is not a multiple of "
            f"{r['artifact_group_size']}): each stored scale is written {r['artifact_group_size'] // r['group_size']} "
            "times, the same weights" for r in plan.regrouped]


def _require_compressed_tensors() -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise UserError("--to compressed-tensors needs the compressed-tensors package: "
                        "pip install 'unionsparse[export]'") from None


def _schemes(plan: PackPlan) -> dict:
    """One config group per scheme; a single scheme targets every ``Linear`` (what vLLM expects)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    out = {}
    for i, ((bits, g), names) in enumerate(plan.schemes.items()):
        args = (QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=g) if g
                else QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel"))
        targets = ["Linear"] if len(plan.schemes) == 1 else names
        out[f"group_{i}"] = QuantizationScheme(targets=targets, weights=args, format="pack-quantized")
    return out


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """compressed-tensors draws tqdm bars on stderr: drop them, pass its other messages on."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if line.strip() and "\r" not in line and "it/s]" not in line:
                print(line, file=sys.stderr)


def _compress(model: nn.Module, art: Artifact, plan: PackPlan):
    """Attach the schemes and the artifact's scales, then let compressed-tensors pack the weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    packed = {n for names in plan.schemes.values() for n in names}
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in packed]
    qconfig = QuantizationConfig(config_groups=_schemes(plan), ignore=ignore, format="pack-quantized")
    with _no_progress_bars():
        apply_quantization_config(model, qconfig)
        for name in packed:
            lin = model.get_submodule(name)
            rec = art.read_layer(name)
            scales = torch.from_numpy(plan.scales(name, rec.scales, rec.encoding.shape[1]))
            if getattr(lin, "weight_scale", None) is None or lin.weight_scale.shape != scales.shape:
                raise RuntimeError(f"compressed-tensors made no weight_scale of shape {tuple(scales.shape)} "
                                   f"for {name}")
            lin.weight_scale.data.copy_(scales)
        compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
        compressor.compress_model(model)
    return compressor


def _saved_tensors(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            where.update({k: f for k in sf.keys()})
    return where


def _check_packed(folder: Path, art: Artifact, plan: PackPlan) -> None:
    """Read the written checkpoint back through compressed-tensors: codes and scales the artifact's, bit for
    bit, and the package's decompression equal to the artifact's dequantized weights in fp16."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    from ..formats.arithmetic.weights import dequantize

    where = _saved_tensors(folder)
    schemes = _schemes(plan)
    for scheme, names in zip(schemes.values(), plan.schemes.values(), strict=True):
        bits = scheme.weights.num_bits
        for name in names:
            keys = [f"{name}.weight_packed", f"{name}.weight_scale", f"{name}.weight_shape"]
            if any(k not in where for k in keys):
                raise RuntimeError(f"compressed-tensors did not write {keys} for {name}")
            t = {}
            for k in keys:
                with safe_open(str(where[k]), "pt") as sf:
                    t[k.rsplit(".", 1)[1]] = sf.get_tensor(k)
            rec = art.read_layer(name)
            codes = rec.encoding.decode()
            got = unpack_from_int32(t["weight_packed"], bits, torch.Size(t["weight_shape"].tolist()))
            if not np.array_equal(got.numpy(), codes):
                raise RuntimeError(f"{name}: packed codes differ from the artifact's")
            scales = plan.scales(name, rec.scales, codes.shape[1])
            if t["weight_scale"].dtype != torch.float16 or not np.array_equal(t["weight_scale"].numpy(), scales):
                raise RuntimeError(f"{name}: weight_scale differs from the artifact's scales")
            w = PackedQuantizationCompressor.decompress(t, scheme)["weight"]
            want = torch.from_numpy(dequantize(codes, rec.scales, int(rec.attrs["group_size"]))).half()
            if not torch.equal(w, want):
                raise RuntimeError(f"{name}: compressed-tensors decompresses to other weights than the artifact's")


# ------------------------------------------------------------------------- what the target cannot hold


def _not_expressed(art: Artifact, target: str, dense: dict[str, str] | None = None) -> list[str]:
    """One line per feature of the artifact that the exported folder does not carry."""
    acts: dict[str, int] = {}
    outliers = thresholds = perms = 0
    for name in art.layer_names:
        a = art.layer_attrs(name)
        act = a.get("activations") or {}
        if act.get("bits"):
            key = f"{act['bits']}-bit inputs per token in groups of {act.get('group_size')}"
            acts[key] = acts.get(key, 0) + 1
        outliers += bool(act.get("outlier_channels"))
        thresholds += a.get("dp_threshold") is not None
        perms += art.store.is_array(f"layers/{name}/perm")
    lines = [f"activation quantization ({k}) on {n} layers: not applied, the exported model takes fp16 inputs "
             "(weight-only quantization)" for k, n in acts.items()]
    if thresholds:
        lines.append(f"dynamic-sparsity thresholds (dp_threshold) on {thresholds} layers: not applied, every input "
                     "is used")
    if target == "compressed-tensors":
        if outliers:
            lines.append(f"outlier channels (8-bit side matrix) on {outliers} layers: these layers are written "
                         "dense fp16 and listed in ignore")
        ragged = [n for n, why in (dense or {}).items() if why.startswith("ragged")]
        if ragged:
            ks = sorted({art.layer_attrs(n)["shape"][1] for n in ragged})
            fit = min(k & -k for k in ks)  # the largest power of two dividing every such K ...
            requested = (art.attrs.get("config") or {}).get("group_size")
            while isinstance(requested, int) and fit > requested:  # ... and at most the group size asked for
                fit //= 2
            hint = f"; compress with --group-size {fit} to pack them" if fit >= 32 else ""
            lines.append(f"ragged last weight group on {len(ragged)} layers (K = {', '.join(map(str, ks))}; "
                         "compressed-tensors needs K divisible by the group size): written dense fp16 and listed "
                         f"in ignore{hint}")
        if perms:
            lines.append(f"per-tile row permutations (IE-BME reordering) on {perms} layers: dropped, codes are "
                         "written in original row order")
    return lines


# --------------------------------------------------------------------------- tokenizer and configs


def _source_model(art: Artifact) -> Path | None:
    src = (art.attrs.get("source") or {}).get("model")
    if not isinstance(src, str) or not src:
        return None
    p = Path(src).expanduser()
    return p if p.exists() else None


def _source_changed(art: Artifact, src: Path) -> bool:
    """True when the source model's weight files no longer have the fingerprint compress recorded."""
    from .model.loading import fingerprint

    want = (art.attrs.get("source") or {}).get("fingerprint")
    files = [src] if src.is_file() else sorted(src.glob("*.safetensors")) + [src / "config.json"]
    if not isinstance(want, str) or not all(f.is_file() for f in files) or len(files) < (1 if src.is_file() else 2):
        return False  # nothing to compare (no fingerprint, or not a safetensors folder)
    return fingerprint(files) != want


def _copy_tokenizer(art: Artifact, dst: Path) -> list[str]:
    """Copy the tokenizer (and generation config) stored in the artifact, or for an older artifact without one,
    its local source model's; lines saying what happened. Never downloads: a source that is not a local folder
    or .gguf file gives a note instead."""
    from .artifact.tokenizer import extract_tokenizer, has_tokenizer

    if has_tokenizer(art):  # stored in the artifact by compress: exactly what it was compressed with
        extract_tokenizer(art, dst)
        return []
    src_name = (art.attrs.get("source") or {}).get("model")
    src = _source_model(art)
    fix = f"copy the tokenizer files into {dst.name.removesuffix('.partial')} yourself"
    if src is None:
        return [f"tokenizer: not copied, the source model {src_name!r} is not a local folder or .gguf file here "
                f"(export never downloads); {fix}"]
    changed = ([f"tokenizer: {src}'s weights differ from those compressed (fingerprint); check that its tokenizer "
                "is the right one"] if _source_changed(art, src) else [])
    return _tokenizer_from(src, dst, fix) + changed


def _tokenizer_from(src: Path, dst: Path, fix: str) -> list[str]:
    if src.is_file() and src.suffix == ".gguf":
        from transformers import AutoTokenizer

        try:
            with _no_progress_bars():
                tok = AutoTokenizer.from_pretrained(str(src.resolve().parent), gguf_file=src.name,
                                                    local_files_only=True)
            tok.save_pretrained(str(dst))
        except Exception as e:  # GGUF files whose tokenizer transformers cannot convert
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            return [f"tokenizer: not copied, transformers cannot read the tokenizer of {src}: {first}; {fix}"]
        return [f"tokenizer: converted from {src}"]
    if not src.is_dir():
        return [f"tokenizer: not copied, the source model {src} is neither a folder nor a .gguf file; {fix}"]
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    for f in copied:
        shutil.copyfile(src / f, dst / f)
    notes = [f"tokenizer: copied {', '.join(copied)} from {src}" if copied else
             f"tokenizer: not copied, {src} holds no tokenizer files; {fix}"]
    if (src / GENERATION_CONFIG).is_file():
        shutil.copyfile(src / GENERATION_CONFIG, dst / GENERATION_CONFIG)
    return notes


# ------------------------------------------------------------------------------------ output folder


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def _read_sidecar(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and SIDECAR_KEY in meta else None


def _check_replaceable(out: Path) -> None:
    """``--overwrite``: ``out`` must be an earlier export holding only the files that export wrote."""
    meta = _read_sidecar(out)
    if meta is None or not meta.get("complete"):
        raise UserError(f"--overwrite: {out} was not written by unionsparse export (no {SIDECAR} of an export); "
                        "refusing to replace it")
    listed = set(meta.get("files") or []) | {SIDECAR}
    extra = [f for f in _files(out) if f not in listed]
    if extra:
        raise UserError(f"--overwrite: {out} holds {len(extra)} file(s) the export did not write, e.g. {extra[0]}; "
                        "move them away first")


@contextlib.contextmanager
def _output_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Checks ``out``, yields a fresh ``out.partial`` (marked by a sidecar stub); removes it on any error. One
    export at a time per ``out`` (``out.lock``); a full disk or a read-only file system is one line (UserError)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"-o: {out} exists and is not a folder")
    if not out.parent.is_dir():
        raise UserError(f"-o: folder {out.parent} does not exist")
    with output_lock(out, "-o"):
        if out.is_dir() and any(out.iterdir()):
            if not overwrite:
                raise UserError(f"-o: {out} exists and is not empty (pass --overwrite to replace an earlier export)")
            _check_replaceable(out)
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists() or tmp.is_symlink():
            if not tmp.is_dir() or _read_sidecar(tmp) is None:
                raise UserError(f"-o: {tmp} exists and was not left by unionsparse export; remove it first")
            shutil.rmtree(tmp)  # an interrupted export's leftover (no export runs now: we hold the lock)
        with environment_errors("-o", out):
            tmp.mkdir()
            try:
                (tmp / SIDECAR).write_text(json.dumps({SIDECAR_KEY: 1, "complete": False}) + "\n")
                yield tmp
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # the partial this export made
                raise


def _finish(tmp: Path, out: Path, art: Artifact, target: str, lost: list[str], notes: list[str],
            dense: dict[str, str], packing: list[dict] | None = None) -> ExportResult:
    """Write the sidecar, then move ``tmp`` to ``out`` (an earlier export there is replaced, nothing else)."""
    mode = file_mode()  # transformers writes safetensors files 0600; give every file the usual mode
    for f in tmp.rglob("*"):
        if f.is_file():
            f.chmod(mode)
    files = [f for f in _files(tmp) if f != SIDECAR]
    meta = {SIDECAR_KEY: 1, "tool_version": tool_version(), "target": target, "artifact": str(art.path.resolve()),
            "source": art.attrs.get("source"), "recipe": art.attrs.get("config"), "not_expressed": lost,
            "notes": notes, "dense_layers": dense, **({"packing": packing} if packing else {}), "files": files,
            "complete": True}
    (tmp / SIDECAR).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        os.replace(out, old)  # rename(2) onto an empty folder of ours
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return ExportResult(out, target, files, lost, notes, dense, packing or [])
