"""What unionsparse may delete (docs/cli.md, "Guarantees"): only its own stores.

An artifact (or ``OUT.zarr.partial``) is recognised by its root ``zarr.json`` carrying the marker and by holding
nothing but zarr nodes and the manifest; ``-o`` may only replace such a store, a partial is reused only when it
is this configuration's (same recipe, same source fingerprint), and every deletion goes through
:func:`remove_tree`, which refuses links and anything that is not a unionsparse store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError
from .layout import MANIFEST, MARKER, TOKENIZER_DIR

ZARR_TEMP = re.compile(r"(zarr|\d+)\.[0-9a-f]{32}\.partial")  # zarr's atomic-write temporary file (metadata, chunk)

MAX_ROOT_META = 64 << 20  # a root zarr.json larger than this is not ours



def store_attrs(path: Path) -> dict | None:
    """Root attributes of a unionsparse store (finished or partial) at ``path``, else None."""
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
    """Entries of ``path``, at any depth, that no unionsparse store holds (a user's files, links), as paths
    relative to ``path``.

    A store holds its root ``zarr.json``, the manifest, the ``tokenizer/`` folder of plain files, and zarr nodes:
    folders with a ``zarr.json`` holding nodes, an array's ``c/`` tree of chunk files (numeric names), and zarr's
    temporary files. When the manifest lists the files, any other file is foreign too. A new kind of file in the
    artifact must be added here, or ``--overwrite`` refuses it.
    """
    root = Path(path)
    out: list[str] = []
    try:
        for p in sorted(root.iterdir()):
            if p.name in ("zarr.json", MANIFEST) and _plain_file(p):
                continue
            if p.name == TOKENIZER_DIR and p.is_dir() and not p.is_symlink() and _plain_files(p):
                continue
            out += _foreign_in_node(p, p.name, top=True)
    except OSError as e:
        return out + [f"(unreadable: {e.strerror or type(e).__name__})"]
    if not out:
        listed = _manifest_files(root)
        if listed is not None:
            out = [rel for rel in _all_files(root) if rel != MANIFEST and rel not in listed]
    return out


def _plain_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _foreign_in_node(p: Path, rel: str, top: bool = False) -> list[str]:
    """What under ``p`` (an entry of a zarr node) no store holds."""
    if ZARR_TEMP.fullmatch(p.name) and _plain_file(p):  # zarr's, left by a killed write
        return []
    if p.is_symlink() or not p.is_dir():  # a node's metadata, or the one chunk of a 0-d array
        return [] if not top and p.name in ("zarr.json", "c") and _plain_file(p) else [rel]
    if p.name == "c" and not top and not (p / "zarr.json").exists():
        return _foreign_in_chunks(p, rel)
    if not _plain_file(p / "zarr.json"):
        # a node a killed run had created but not yet described: empty, or holding only zarr's temporary files
        if not top and not (p / "zarr.json").exists() and all(
                ZARR_TEMP.fullmatch(q.name) and _plain_file(q) for q in p.iterdir()):
            return []
        return [rel]
    out = []
    for q in sorted(p.iterdir()):
        out += _foreign_in_node(q, f"{rel}/{q.name}")
    return out


def _foreign_in_chunks(p: Path, rel: str) -> list[str]:
    """An array's chunk tree: folders and files with numeric names only (``c/0/1``)."""
    out = []
    for q in sorted(p.iterdir()):
        name = f"{rel}/{q.name}"
        if ZARR_TEMP.fullmatch(q.name) and _plain_file(q):
            continue
        if q.is_symlink() or not q.name.isdigit() or not (q.is_dir() or q.is_file()):
            out.append(name)
        elif q.is_dir():
            out += _foreign_in_chunks(q, name)
    return out


def _all_files(root: Path) -> list[str]:
    return [Path(d, f).relative_to(root).as_posix() for d, _, files in os.walk(root) for f in files]


def _manifest_files(root: Path) -> set[str] | None:
    """The file list of the store's manifest (its JSON first line), or None when there is none to read."""
    m = root / MANIFEST
    try:
        if not _plain_file(m) or m.stat().st_size > MAX_ROOT_META:
            return None
        files = json.loads(m.read_text(encoding="utf-8").split("\n", 1)[0]).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


def remove_zarr_temporaries(store: Path) -> int:
    """Delete the temporary files zarr writes (``zarr.<uuid hex>.partial``, ``<chunk>.<uuid hex>.partial``,
    renamed into place when a write completes) that a killed run left in our own partial store; links are never
    followed. Returns how many."""
    n = 0
    for dirpath, _, files in os.walk(store):
        for f in files:
            q = Path(dirpath) / f
            if ZARR_TEMP.fullmatch(f) and q.is_file() and not q.is_symlink():
                q.unlink()  # zarr's own temporary file inside this run's partial
                n += 1
    return n



def _plain_files(folder: Path) -> bool:
    """True when ``folder`` holds regular files only (no links, no folders)."""
    try:
        return all(q.is_file() and not q.is_symlink() for q in folder.iterdir())
    except OSError:
        return False


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
