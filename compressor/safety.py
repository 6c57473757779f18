"""What `compress` may delete, and what it checks before any work (docs/cli.md, "Guarantees").

- Output: ``-o`` may only replace a unionsparse artifact (root ``zarr.json`` with the marker, nothing but
  zarr nodes and the manifest inside), never a file, a folder of other files or the input model; an
  existing ``OUT.zarr.partial`` is reused or replaced only when it is this configuration's (same recipe,
  same source fingerprint), else it is left alone and the run refused.
- Deletion goes through :func:`remove_tree`, which refuses links and anything that is not a unionsparse store.
- Environment: the output folder must be writable and hold the estimated artifact size; a full disk or a
  read-only file system met while writing is bad input (exit 2), not an internal error.
- Input: NaN/inf in kept tensors, fp16 scale overflow, ``--seqlen`` beyond the model's context, calibration
  memory beyond what the machine has, and hub ids that cannot be reached are refused in one line.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from .errors import UserError

FP16_MAX = 65504.0
MAX_SEQLEN = 1 << 20  # no model has a longer context; larger values are typos
MAX_ROOT_META = 64 << 20  # a root zarr.json larger than this is not ours
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
ENV_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)


# ------------------------------------------------------------------------------ recognising our stores


def store_attrs(path: Path) -> dict | None:
    """Root attributes of a unionsparse store (finished or partial) at ``path``, else None."""
    from .artifact import MARKER

    meta = Path(path) / "zarr.json"
    try:
        if Path(path).is_symlink() or meta.is_symlink() or not meta.is_file():
            return None
        if meta.stat().st_size > MAX_ROOT_META:
            return None
        doc = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    attrs = doc.get("attributes")
    if doc.get("node_type") != "group" or not isinstance(attrs, dict) or attrs.get(MARKER) is not True:
        return None
    return attrs


def foreign_entries(path: Path) -> list[str]:
    """Top-level entries of ``path`` that no unionsparse store holds (a user's files, links).

    A store holds its root ``zarr.json``, the manifest and zarr groups (folders with a ``zarr.json``);
    a new kind of top-level file in the artifact must be added here, or ``--overwrite`` refuses it.
    """
    from .artifact import MANIFEST

    out = []
    try:
        entries = sorted(Path(path).iterdir())
    except OSError as e:
        return [f"(unreadable: {e.strerror or type(e).__name__})"]
    for p in entries:
        if p.name in ("zarr.json", MANIFEST) and p.is_file() and not p.is_symlink():
            continue
        if p.is_dir() and not p.is_symlink() and (p / "zarr.json").is_file():
            continue
        out.append(p.name)
    return out


def is_unionsparse_store(path: Path) -> bool:
    """True when ``path`` is a real folder holding a unionsparse store and nothing else."""
    p = Path(path)
    return not p.is_symlink() and p.is_dir() and store_attrs(p) is not None and not foreign_entries(p)


def check_replaceable(out: Path) -> None:
    """``--overwrite`` may replace ``out`` only when it is a unionsparse artifact (nothing is deleted here)."""
    why = _not_ours(out)
    if why:
        raise UserError(f"-o: {out} {why}; --overwrite replaces only a unionsparse artifact (nothing was deleted)")


def _not_ours(p: Path) -> str | None:
    if p.is_symlink():
        return "is a symbolic link"
    if not p.exists():
        return None
    if not p.is_dir():
        return "is a file, not a unionsparse artifact"
    if store_attrs(p) is None:
        return "is a folder that is not a unionsparse artifact"
    extra = foreign_entries(p)
    if extra:
        return f"holds {len(extra)} entr{'y' if len(extra) == 1 else 'ies'} no artifact has (e.g. {extra[0]!r})"
    return None


def remove_tree(path: Path, store: bool = True) -> None:
    """Delete ``path`` (a folder) if it is a unionsparse store; refuse links and anything else.

    ``store=False`` is for a folder inside a store of ours (an incomplete layer group): only links are refused.
    """
    p = Path(path)
    if p.is_symlink():
        raise UserError(f"{p}: is a symbolic link; unionsparse does not delete through links")
    if not p.exists():
        return
    if store:
        why = _not_ours(p)
        if why:
            raise UserError(f"{p} {why}; unionsparse deletes only its own artifacts (nothing was deleted)")
    shutil.rmtree(p)


def remove_artifact(path: Path) -> bool:
    """For scripts: delete ``path`` only if it is a unionsparse store; returns whether it was deleted."""
    p = Path(path)
    if p.is_symlink() or not is_unionsparse_store(p):
        return False
    shutil.rmtree(p, ignore_errors=True)
    return True


def replace_artifact(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` must (still) be an artifact.

    The old artifact is moved aside first and deleted last, so a failure never loses both.
    """
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    check_replaceable(out)  # again: something else may have appeared at -o during the run
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------ output checks


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


def check_partial(partial: Path, config: dict | None, fingerprint: str | None, resume: bool) -> bool:
    """An existing ``OUT.zarr.partial`` must be this configuration's (recipe and, when given, source
    fingerprint); returns True then. Anything else is refused and left as it is."""
    flag = "--resume" if resume else "-o"
    why = _not_ours(partial)
    if why:
        raise UserError(f"{flag}: {partial} {why}, not a partial artifact of unionsparse; it was left alone "
                        "(remove it or choose another -o)")
    attrs = store_attrs(partial) or {}
    old = attrs.get("config")
    if config is not None and old != config:
        diff = _diff_keys(old if isinstance(old, dict) else {}, config)
        raise UserError(f"{flag}: {partial} belongs to another run (written with a different configuration: "
                        f"{diff}); it was left alone (rerun that command with --resume, or remove it)")
    stored_fp = (attrs.get("source") or {}).get("fingerprint") if isinstance(attrs.get("source"), dict) else None
    if fingerprint is not None and stored_fp != fingerprint:
        raise UserError(f"{flag}: {partial} belongs to another run (a different source model: its weights "
                        "changed); it was left alone (remove it to start over)")
    return True


def _diff_keys(old: Mapping, new: Mapping) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    parts = [f"{k} {old.get(k)!r} vs {new.get(k)!r}" for k in keys[:3]]
    return ", ".join(parts) + (", ..." if len(keys) > 3 else "") if parts else "unreadable recipe"


def is_environment_error(e: OSError, out: Path) -> bool:
    """A full disk, a quota, a read-only file system, or permissions on ``out``: bad input, not a bug."""
    if e.errno in ENV_ERRNOS:
        return True
    name = getattr(e, "filename", None)
    return e.errno in ACCESS_ERRNOS and bool(name) and _inside(Path(str(name)).resolve(), out.parent.resolve())


# -------------------------------------------------------------------------------------- disk space


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
                            sparsity: float, group_size: int, areas: int, fmt: str) -> int:
    """About how many bytes the artifact takes (a little more, never much less).

    Per weight: values (IE-BME stores all ``areas`` codes of a union position, so the kept fraction is
    1 - sparsity^areas; Tiled-CBC stores the nonzeros), one bitmap bit, fp16 scales per group; dense
    tensors in fp16; 10% and 1 MiB of margin for padding and metadata.
    """
    keep = 1.0 - sparsity ** (areas if fmt == "ie-bme" else 1)
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


# ----------------------------------------------------------------------------------- finite tensors


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


# -------------------------------------------------------------------------- context and memory bounds


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
            from gguf import GGUFReader

            reader = GGUFReader(str(p))
            for name, field in reader.fields.items():
                if name.endswith(".context_length") and field.data:
                    return int(field.parts[field.data[0]][0])
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the model checks themselves
        return None
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


# ---------------------------------------------------------------------------------------- the hub


def _offline_env() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=8)
def hub_unreachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """Why ``endpoint`` (the hub's URL) cannot be reached within ``timeout`` seconds, or None."""
    from urllib.parse import urlparse

    u = urlparse(endpoint)
    host = u.hostname or "huggingface.co"
    port = u.port or (80 if u.scheme == "http" else 443)
    box: dict = {}

    def resolve() -> None:
        try:
            box["addr"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            box["err"] = e

    t = threading.Thread(target=resolve, daemon=True)  # getaddrinfo has no timeout of its own
    t.start()
    t.join(timeout)
    if "addr" not in box:
        e = box.get("err")
        return f"{host} does not resolve" + (f": {e.strerror or e}" if e else f" within {timeout:.0f} s")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"no connection to {host}:{port} ({e.strerror or type(e).__name__})"
    return None


def _cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id or cache: not cached
        return False


def hub_local_only(source: str, what: str = "MODEL") -> bool:
    """For a hub id: True when it must come from the local cache (offline); UserError at once when it
    cannot come from anywhere, instead of the hub client's retries."""
    if _offline_env():
        if _cached(source):
            return True
        raise UserError(f"{what}: {source} is no local path and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                        "is set; give a model folder or a .gguf file")
    reason = hub_unreachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if reason is None:
        return False
    if _cached(source):
        return True
    raise UserError(f"{what}: {source} is no local path and the Hugging Face hub is unreachable ({reason}); "
                    "give a model folder or a .gguf file")


# ------------------------------------------------------------------------------ compress, once loaded


def model_reference(model: str) -> str:
    """What an artifact records as its source: the absolute path of a local model, a hub id as given."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


def check_loaded_model(cfg, out: Path, loaded, blocks, prefix: str) -> None:
    """Checks that need the model's config and shapes but no weights of the blocks, before the layer loop:
    ``--seqlen`` against the context, calibration memory, free disk space, finite dense tensors."""
    from .model_io import block_linears
    from .streaming import model_dense_tensors

    model = loaded.model
    calibrating = cfg.needs_calibration or (cfg.prune != "none" and cfg.sparsity_profile == "owl")
    if calibrating:
        check_seqlen("--seqlen", cfg.seqlen, model_context(loaded.config), cfg.model)
        if cfg.device == "cpu":
            check_calibration_memory(cfg.nsamples, cfg.seqlen, loaded.config.get("hidden_size"))
    linears = {f"{prefix}.{i}.{n}.weight": tuple(lin.weight.shape)
               for i, b in enumerate(blocks) for n, lin in block_linears(b)}
    total = sum(p.numel() for p in model.parameters())
    ra, ca = cfg.area_grid
    need = estimate_artifact_bytes(linears.values(), total - sum(m * k for m, k in linears.values()), cfg.bits,
                                   cfg.requested_sparsity, cfg.group_size, ra * ca, cfg.format)
    partial = out.with_name(out.name + ".partial")
    check_disk_space(out, need, tree_bytes(partial) if cfg.resume and partial.is_dir() else 0)
    dense, _ = model_dense_tensors(loaded, set(linears))
    for name, t in dense.items():  # streaming: one tensor read at a time
        check_finite(f"dense tensor {name}", t)


def check_eval_args(source: str, seqlen: int, max_windows: int | None) -> None:
    """``eval``'s numbers, and ``--seqlen`` against the context of the model or the artifact's stored config,
    before anything is loaded (a window beyond the context only costs memory: attention is quadratic)."""
    if seqlen < 2:
        raise UserError(f"--seqlen must be >= 2, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be >= 1, got {max_windows}")
    attrs = store_attrs(Path(source))
    context = model_context(attrs.get("model_config")) if attrs is not None else source_context(str(source))
    check_seqlen("--seqlen", seqlen, context, str(source))
