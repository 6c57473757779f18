"""The tokenizer, generation config and chat template stored inside an artifact (folder ``tokenizer/``).

``compress`` stores them so that ``generate`` and ``eval`` need nothing but the artifact. ``tokenizer/`` holds
the files themselves, byte for byte, as a Hugging Face model folder would (docs/format.md); the manifest covers
them like every other file. Sources:

* a model folder: its tokenizer files (``TOKENIZER_FILES``) and ``generation_config.json``, as they are, if
  transformers loads them;
* a ``.gguf`` file: the tokenizer transformers builds from it, saved with ``save_pretrained``, and a
  generation config made of the model config's bos / eos / pad ids;
* a hub id: the same through ``from_pretrained`` (``compress`` of a hub id is online anyway).

Reading never goes online and never follows links: the files are copied to a temporary folder (with the
stored model config, so transformers picks the tokenizer class as in the model folder) and loaded with
``local_files_only=True``. An artifact without ``tokenizer/`` still loads; :func:`load_tokenizer` then raises
one ``UserError`` saying so, and nothing is looked up from what the artifact records.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from ..errors import UserError
from .layout import TOKENIZER_DIR
from .store import Artifact

MAX_FILE_BYTES = 256 << 20  # a stored tokenizer file larger than this is refused
# Files of a Hugging Face model folder that describe the tokenizer and its chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                   "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _generation_config_bytes(model_config: dict | None) -> bytes | None:
    """A generation config holding the model config's special token ids (None if it records none)."""
    ids = {k: (model_config or {}).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    ids = {k: v for k, v in ids.items() if v is not None}
    if not ids:
        return None
    from transformers import GenerationConfig

    return GenerationConfig(**ids).to_json_string().encode()


def _saved_files(tok, gen: bytes | None) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        files = {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
    if gen is not None and GENERATION_CONFIG not in files:
        files[GENERATION_CONFIG] = gen
    return files


def tokenizer_files(source: str, model_config: dict | None = None) -> tuple[dict[str, bytes], str]:
    """(file name -> bytes, one line saying what was found) for MODEL ``source``; no files when it has no
    tokenizer that transformers reads (the line says why)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    p = Path(source).expanduser()
    gen = _generation_config_bytes(model_config)
    if p.suffix == ".gguf" and p.is_file():
        try:
            tok = AutoTokenizer.from_pretrained(str(p.resolve().parent), gguf_file=p.name, local_files_only=True)
        except Exception as e:  # GGUF tokenizers transformers cannot convert
            return {}, f"tokenizer not stored: transformers cannot read the tokenizer of {p.name}: {_first_line(e)}"
        return _saved_files(tok, gen), f"tokenizer stored, converted from {p.name}"
    if p.is_dir():
        files = {f: (p / f).read_bytes() for f in (*TOKENIZER_FILES, GENERATION_CONFIG) if (p / f).is_file()}
        if not any(f in files for f in TOKENIZER_FILES):
            return {}, f"tokenizer not stored: {p} holds no tokenizer files"
        if GENERATION_CONFIG not in files and gen is not None:
            files[GENERATION_CONFIG] = gen
        config = (p / "config.json").read_bytes() if (p / "config.json").is_file() else None
        try:  # only what loads is stored
            _load(files, config)
        except Exception as e:
            return {}, f"tokenizer not stored: the tokenizer files of {p} do not load: {_first_line(e)}"
        return files, f"tokenizer stored: {', '.join(sorted(files))}"
    try:  # a hub id: compress of one is online anyway
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        return {}, f"tokenizer not stored: cannot load the tokenizer of {source}: {_first_line(e)}"
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(source).to_json_string().encode()
    except Exception:  # no generation_config.json: the model config's ids
        pass
    return _saved_files(tok, gen), f"tokenizer stored, from {source}"


def write_tokenizer_files(store: str | Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``store``/tokenizer/ (a store being written; an older folder there is replaced)."""
    from .ownership import remove_tree

    for name in files:
        if not _SAFE_NAME.match(name):
            raise UserError(f"tokenizer file name {name!r} is not a plain file name")
    d = Path(store) / TOKENIZER_DIR
    remove_tree(d, store=False)  # a folder inside our own store (refuses links)
    _write_files(files, d)


def store_tokenizer(store: str | Path, source: str, model_config: dict | None = None) -> str:
    """Store MODEL's tokenizer, generation config and chat template in the store being written at ``store``;
    returns one line saying what was stored, or why nothing."""
    files, line = tokenizer_files(source, model_config)
    if files:
        write_tokenizer_files(store, files)
    return line


def _artifact(artifact: Artifact | str | Path) -> Artifact:
    return artifact if isinstance(artifact, Artifact) else Artifact(artifact)


def stored_files(artifact: Artifact | str | Path) -> dict[str, bytes]:
    """The files of the artifact's ``tokenizer/`` folder (empty when it has none), read through its store (no
    links; checked against the manifest when the artifact was opened so). Only plain names count; a subfolder,
    or a file larger than ``MAX_FILE_BYTES``, is refused."""
    art = _artifact(artifact)
    prefix = f"{TOKENIZER_DIR}/"
    out = {}
    for rel, size in art.store.files.items():
        if not rel.startswith(prefix):
            continue
        name = rel[len(prefix):]
        if "/" in name:
            raise UserError(f"{art.path}: {TOKENIZER_DIR}/{name.split('/')[0]} is not a regular file (refused)")
        if not _SAFE_NAME.match(name):
            continue
        if size > MAX_FILE_BYTES:
            raise UserError(f"{art.path}: {TOKENIZER_DIR}/{name} is larger than {MAX_FILE_BYTES >> 20} MiB")
        out[name] = art.store.read(rel)
    return out


def has_tokenizer(artifact: Artifact | str | Path) -> bool:
    """True when the artifact stores a tokenizer (not only a generation config)."""
    return any(f in TOKENIZER_FILES for f in stored_files(artifact))


def _write_files(files: dict[str, bytes], dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (dst / name).write_bytes(data)
    return sorted(files)


def extract_tokenizer(artifact: Artifact | str | Path, dst: str | Path) -> list[str]:
    """Write the stored tokenizer files into folder ``dst`` (e.g. an export); returns their names."""
    return _write_files(stored_files(artifact), Path(dst))


def _load(files: dict[str, bytes], config: bytes | None):
    """AutoTokenizer over ``files`` in a temporary folder, offline; ``config`` (the model's config.json) lets
    transformers pick the tokenizer class as it would in the model folder."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    with tempfile.TemporaryDirectory() as d:
        _write_files(files, Path(d))
        if config is not None:
            (Path(d) / "config.json").write_bytes(config)
        return AutoTokenizer.from_pretrained(d, local_files_only=True)


def load_tokenizer(artifact: Artifact | str | Path):
    """The transformers tokenizer stored in the artifact, loaded offline; ``UserError`` if it has none."""
    art = _artifact(artifact)
    files = stored_files(art)
    if not any(f in TOKENIZER_FILES for f in files):
        raise UserError(f"{art.path}: the artifact holds no tokenizer (written before unionsparse stored one, or "
                        "its model had none); compress the model again to store it")
    mc = art.attrs.get("model_config")
    try:
        return _load(files, json.dumps(mc).encode() if isinstance(mc, dict) and mc.get("model_type") else None)
    except Exception as e:
        raise UserError(f"{art.path}: the stored tokenizer does not load: {_first_line(e)}") from None


def load_generation_config(artifact: Artifact | str | Path):
    """The stored ``GenerationConfig``, or None when the artifact has none."""
    from transformers import GenerationConfig

    art = _artifact(artifact)
    data = stored_files(art).get(GENERATION_CONFIG)
    if data is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / GENERATION_CONFIG).write_bytes(data)
        try:
            return GenerationConfig.from_pretrained(d, local_files_only=True)
        except Exception as e:
            raise UserError(f"{art.path}: the stored generation config does not load: {_first_line(e)}") from None
