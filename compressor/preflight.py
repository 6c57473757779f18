"""What `compress` and `eval` check before any work (docs/cli.md, "Guarantees").

- Output: ``-o`` ends in .zarr, its folder exists and is writable and holds the estimated artifact size, it is
  not the input model nor inside it, and it replaces only a unionsparse artifact (``artifact.ownership``).
- Environment: a full disk or a read-only file system met while writing is bad input (exit 2), not a bug
  (``files.is_environment_error``).
- Input: NaN/inf in kept tensors, fp16 scale overflow, ``--seqlen`` beyond the model's context, calibration
  memory beyond what the machine has, and hub ids that cannot be reached are refused in one line.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from .artifact.ownership import check_partial, check_replaceable, store_attrs
from .errors import UserError

FP16_MAX = 65504.0

MAX_SEQLEN = 1 << 20  # no model has a longer context; larger values are typos

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")



def _inside(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies under it (both resolved)."""
    return a == b or b in a.parents



def check_not_input(out: Path, model: str) -> None:
    """``-o`` (and its partial) must not be the model, a folder holding it, or a path inside its folder."""
    m = Path(model).expanduser()
    if not m.exists():
        return  # a hub id
    m = m.resolve()
    for p in (out, out.with_name(out.name + ".partial")):
        r = p.expanduser().resolve()
        if _inside(m, r):
            what = "is the input model" if r == m else "holds the input model"
            raise UserError(f"-o: {p} {what} ({model}); choose another output path")
        if m.is_dir() and _inside(r, m):
            raise UserError(f"-o: {p} lies inside the input model's folder ({model}); choose another output path")



def check_writable(folder: Path) -> None:
    """``folder`` accepts new files (permissions, read-only file systems): a probe file is made and removed."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"-o: folder {folder} is not writable (permission denied)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".unionsparse-probe-", dir=folder)
    except OSError as e:
        raise UserError(f"-o: folder {folder} is not writable ({e.strerror or type(e).__name__})") from None
    os.close(fd)
    os.unlink(probe)  # the probe file this function just made



def check_output(out: Path, model: str, overwrite: bool, resume: bool, config: dict) -> None:
    """Everything about ``-o`` that can be checked before loading the model; raises UserError."""
    if not out.name.endswith(".zarr"):
        raise UserError(f"-o: {out} must end in .zarr")
    parent = out.parent
    if not parent.exists():
        raise UserError(f"-o: folder {parent} does not exist")
    if not parent.is_dir():
        raise UserError(f"-o: {parent} is a file, not a folder")
    check_not_input(out, model)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UserError(f"-o: {out} already exists (remove it or pass --overwrite)")
        check_replaceable(out)
    partial = out.with_name(out.name + ".partial")
    if partial.exists() or partial.is_symlink():
        check_partial(partial, config, None, resume)
    check_writable(parent)



def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free



def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total



def estimate_artifact_bytes(linear_shapes: Iterable[tuple[int, int]], dense_elements: int, bits: int | None,
                            sparsity: float, group_size: int, areas: int) -> int:
    """About how many bytes the artifact takes (a little more, never much less).

    Per weight: values (a format with an area grid, IE-BME, stores all ``areas`` codes of a union position, so
    the kept fraction is 1 - sparsity^areas; ``areas`` 1 for a format that stores the nonzeros), one bitmap
    bit, fp16 scales per group; dense tensors in fp16; 10% and 1 MiB of margin for padding and metadata.
    """
    keep = 1.0 - sparsity ** areas
    per_weight = (bits or 16) / 8 * keep + 1 / 8 + (2 / group_size if bits else 0.0)
    weights = sum(m * k for m, k in linear_shapes)
    return int(1.1 * (weights * per_weight + 2 * dense_elements)) + (1 << 20)



def check_disk_space(out: Path, needed: int, already: int = 0) -> None:
    """The output folder must hold ``needed`` bytes (less ``already`` written by a resumed partial)."""
    free = free_bytes(out.parent)
    want = max(0, needed - already)
    if free < want:
        raise UserError(f"-o: {out.parent} has {_size(free)} free, the artifact needs about {_size(want)} "
                        "(estimated); free some space or choose another folder")



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"



def check_finite(what: str, values) -> None:
    """NaN or inf in a tensor the artifact keeps is bad input naming it (``what``: 'dense X', 'layer Y')."""
    a = values.detach().float().numpy() if hasattr(values, "detach") else np.asarray(values)
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise UserError(f"MODEL: {what} holds NaN or inf values; fix the checkpoint (verify would reject it)")



def check_scales(name: str, scales: np.ndarray | None, quant: str, what: str = "scales") -> None:
    """Quantization scales must be finite fp16: a weight beyond ~65504 x the largest code overflows them."""
    if scales is None:
        return
    s = np.asarray(scales).astype(np.float32)
    if not np.isfinite(s).all():
        raise UserError(f"MODEL: layer {name} has weights too large for --quant {quant}: its {what} overflow "
                        f"float16 (> {FP16_MAX:.0f}); verify would reject the artifact")



def model_context(config: Mapping | None) -> int | None:
    """The longest sequence the model takes, from its config (text_config too), or None if it says none."""
    if not isinstance(config, Mapping):
        return None
    for key in CONTEXT_KEYS:
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return model_context(config.get("text_config"))



def source_context(source: str) -> int | None:
    """The context length of a local MODEL (config.json, or a GGUF's ``*.context_length``) without loading it."""
    p = Path(source).expanduser()
    try:
        if p.is_dir() and (p / "config.json").is_file():
            return model_context(json.loads((p / "config.json").read_text(encoding="utf-8")))
        if p.suffix == ".gguf" and p.is_file():
            st = p.stat()
            return _gguf_context(str(p.resolve()), st.st_mtime_ns, st.st_size)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the model checks themselves
        return None
    return None


@functools.lru_cache(maxsize=8)
def _gguf_context(path: str, _mtime_ns: int, _size: int) -> int | None:
    """A GGUF's ``*.context_length``, read once per file version (parsing the metadata of a GGUF with a large
    vocabulary takes seconds, and a calibrating compress asks twice: the CLI's checks and the pipeline's)."""
    from gguf import GGUFReader

    for name, field in GGUFReader(path).fields.items():
        if name.endswith(".context_length") and field.data:
            return int(field.parts[field.data[0]][0])
    return None



def check_seqlen(flag: str, seqlen: int, context: int | None, source: str) -> None:
    """``seqlen`` positive, not absurd, and within the model's context (when known)."""
    if seqlen > MAX_SEQLEN:
        raise UserError(f"{flag} {seqlen} is beyond any model's context (at most {MAX_SEQLEN})")
    if context is not None and seqlen > context:
        raise UserError(f"{flag} {seqlen} exceeds the context of {source} ({context} tokens); "
                        f"use {flag} {context} or less")



def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None



def check_calibration_memory(nsamples: int, seqlen: int, hidden: int | None) -> None:
    """Calibration holds two ``[nsamples, seqlen, hidden]`` float32 activation buffers; they must fit in memory."""
    avail = available_memory()
    if not hidden or avail is None:
        return
    need = 2 * nsamples * seqlen * int(hidden) * 4
    if need > avail:
        raise UserError(f"--nsamples {nsamples} x --seqlen {seqlen}: calibration activations need about "
                        f"{_size(need)}, more than the {_size(avail)} of memory available; lower either")



def model_reference(model: str) -> str:
    """What an artifact records as its source: the absolute path of a local model, a hub id as given."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model



def check_loaded_model(cfg, out: Path, loaded, blocks, prefix: str) -> None:
    """Checks that need the model's config and shapes but no weights of the blocks, before the layer loop:
    ``--seqlen`` against the context, calibration memory, free disk space, finite dense tensors."""
    from .model.loading import block_linears
    from .model.streaming import model_dense_tensors

    model = loaded.model
    calibrating = cfg.needs_calibration or (cfg.prune != "none" and cfg.sparsity_profile == "owl")
    if calibrating:
        check_seqlen("--seqlen", cfg.seqlen, model_context(loaded.config), cfg.model)
        if cfg.device == "cpu":
            check_calibration_memory(cfg.nsamples, cfg.seqlen, loaded.config.get("hidden_size"))
    linears = {f"{prefix}.{i}.{n}.weight": tuple(lin.weight.shape)
               for i, b in enumerate(blocks) for n, lin in block_linears(b)}
    total = sum(p.numel() for p in model.parameters())
    ra, ca = cfg.area_grid if "areas" in cfg.fmt.extra_geometry else (1, 1)
    need = estimate_artifact_bytes(linears.values(), total - sum(m * k for m, k in linears.values()), cfg.bits,
                                   cfg.requested_sparsity, cfg.group_size, ra * ca)
    partial = out.with_name(out.name + ".partial")
    check_disk_space(out, need, tree_bytes(partial) if cfg.resume and partial.is_dir() else 0)
    dense, _ = model_dense_tensors(loaded, set(linears))
    for name, t in dense.items():  # streaming: one tensor read at a time
        check_finite(f"dense tensor {name}", t)



def check_eval_args(source, seqlen: int, max_windows: int | None, verify: bool = True) -> None:
    """``eval``'s numbers, and ``--seqlen`` against the context of the model or the artifact's stored config (a path,
    or the Artifact the command opened), before anything is loaded (a window beyond the context only costs memory:
    attention is quadratic)."""
    if seqlen < 2:
        raise UserError(f"--seqlen must be >= 2, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be >= 1, got {max_windows}")
    from .artifact.store import Artifact

    name = str(source.path) if isinstance(source, Artifact) else str(source)
    if isinstance(source, Artifact):
        attrs = source.attrs
    elif (attrs := store_attrs(Path(source))) is not None:  # an artifact: opened through the scanned store
        attrs = Artifact(source, verify=verify).attrs  # its manifest too, unless --no-verify
    context = model_context(attrs.get("model_config")) if attrs is not None else source_context(name)
    check_seqlen("--seqlen", seqlen, context, name)


def read_user_text(flag: str, path: str | Path) -> str:
    """The UTF-8 text of a file the user names (``--text``, ``--batch-file``); one line naming what is wrong."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{flag} {path}: file does not exist")
    try:
        return p.read_bytes().decode("utf-8-sig")
    except PermissionError:
        raise UserError(f"{flag} {path}: file is not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise UserError(f"{flag} {path}: not UTF-8 text") from None
