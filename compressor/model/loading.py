"""Loading a causal LM (local folder, .gguf file or hub id) and finding the layers to compress."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .hub import hub_local_only

# Where the decoder blocks live, per architecture family (first match wins).
BLOCK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")


@dataclass
class LoadedModel:
    model: nn.Module
    source: str  # what the user passed
    kind: str  # "folder" | "gguf" | "hub"
    fingerprint: str  # sha256 over file names, sizes and head/tail bytes of the weight files
    config: dict


def classify_source(source: str) -> str:
    p = Path(source)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UserError(f"MODEL: GGUF file {source} does not exist")
        return "gguf"
    if p.exists():
        if not p.is_dir():
            raise UserError(f"MODEL: {source} is neither a model folder nor a .gguf file")
        if not (p / "config.json").is_file():
            raise UserError(f"MODEL: folder {source} has no config.json (not a Hugging Face model folder)")
        return "folder"
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise UserError(f"MODEL: {source} does not exist (give a model folder, a .gguf file or a hub id)")
    return "hub"


def check_source(source: str) -> str:
    """Classify MODEL and check its headers without loading weights (fails fast, before any work)."""
    kind = classify_source(source)
    if kind == "gguf":
        _check_gguf_header(Path(source))
    elif kind == "folder":
        files = sorted(Path(source).glob("*.safetensors"))
        if not files:
            raise UserError(f"MODEL: folder {source} holds no *.safetensors weights")
        _check_safetensors_headers(files)
    else:
        hub_local_only(source)
    return kind


def fingerprint(paths: list[Path], chunk: int = 4 << 20) -> str:
    """Fast content fingerprint: sha256 over each file's name, size, first and last 4 MiB."""
    h = hashlib.sha256()
    for p in sorted(paths):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(chunk))
            if size > chunk:
                f.seek(max(size - chunk, chunk))
                h.update(f.read(chunk))
    return h.hexdigest()


def load_model(source: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a causal LM for compression. Errors become one-line UserErrors naming MODEL."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF conversion bars; compress shows its own progress
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kind = classify_source(source)
    try:
        if kind == "gguf":
            p = Path(source).resolve()
            _check_gguf_header(p)
            model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
            files = [p]
        elif kind == "folder":
            p = Path(source)
            files = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin"))
            if not files:
                raise UserError(f"MODEL: folder {source} holds no *.safetensors weights")
            _check_safetensors_headers(files)
            model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, use_safetensors=True)
            files = files + [p / "config.json"]
        else:
            local = hub_local_only(source)  # offline or unreachable: the cache, or one line at once
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local)
            files = []
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"MODEL: cannot load {source}: {_first_line(e)}") from None
    except (ValueError, KeyError, RuntimeError, TypeError, struct.error, EOFError) as e:
        raise UserError(f"MODEL: {source} is not a loadable causal LM: {_first_line(e)}") from None
    model.eval()
    fp = fingerprint(files) if files else f"hub:{source}"
    return LoadedModel(model, source, kind, fp, json.loads(model.config.to_json_string()))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _check_gguf_header(p: Path) -> None:
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"MODEL: {p} is not a GGUF file (bad magic {magic!r})")


def _check_safetensors_headers(files: list[Path]) -> None:
    """A safetensors file starts with an 8-byte little-endian header length and a JSON header."""
    for f in files:
        if f.suffix != ".safetensors":
            continue
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or n > min(size - 8, 100 << 20):
                    raise ValueError("header length out of range")
                json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"MODEL: {f} has a broken safetensors header") from None
        except OSError as e:  # permissions, a dangling link, a folder named *.safetensors
            raise UserError(f"MODEL: {f} is not readable ({e.strerror or type(e).__name__})") from None


def find_blocks(model: nn.Module) -> tuple[nn.ModuleList, str]:
    """The decoder blocks and their module path (LLaMA, Mistral, Qwen2, OPT, GPT-NeoX, ...)."""
    for path in BLOCK_PATHS:
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj, path
    raise UserError(f"MODEL: unsupported architecture {type(model).__name__}: no decoder blocks found")


def block_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """nn.Linear modules of one block, in module order."""
    return [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def dense_tensors(model: nn.Module, compressed: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and buffer that is not a compressed weight, and the tied aliases.

    Returns (name -> tensor) with each storage once, and (alias -> stored name) for tied weights.
    """
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[int, str] = {}
    state = model.state_dict(keep_vars=False)
    for name, t in state.items():
        if name in compressed:
            continue
        if not t.is_floating_point():
            continue  # integer buffers (position ids) are rebuilt from the config
        key = t.data_ptr()
        if key in seen and t.numel() > 0:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach()
    return tensors, tied
