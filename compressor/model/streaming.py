"""Streaming model loading: a meta-device skeleton plus tensors read lazily from safetensors shards.

``compress`` on a safetensors folder never holds the model: the module tree is built on the meta device
from ``config.json`` (no weight memory), each linear layer's weight is read from its shard when its turn
comes (``safe_open``, memory-mapped, opened per tensor so no mapping outlives the read) and released once
encoded, and the dense tensors (embeddings, norms, lm_head) are copied one by one straight from the
shards to ``dense/``. Peak memory therefore follows the largest layer, not the model.

Calibrated runs (Wanda, SparseGPT, GPTQ / clip search, activation clipping, dynamic-pruning thresholds,
the OWL pass) stream too: the skeleton keeps its buffers real, and :func:`loaded_weights` fills in one
module at a time (the embeddings while block 0's inputs are caught, then each decoder block while it is
calibrated, pruned and run on the calibration activations) and empties it again afterwards.

GGUF files and hub ids are loaded fully through transformers (it dequantizes GGUF), as are models whose
checkpoint names do not map one to one onto the module tree (transformers renames them on load).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .loading import LoadedModel, _first_line, classify_source, fingerprint, load_model

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; no-op elsewhere).

    Between layers the process frees gigabytes of large arrays; glibc's adaptive mmap threshold would
    serve the next ones from per-thread heaps that never shrink, so RSS would creep towards the sum of
    several layers. A fixed threshold plus ``malloc_trim`` keeps it at one layer.
    """
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


class ShardedWeights:
    """Name -> shard map of a safetensors folder; tensors are read on demand, one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = sorted(self.folder.glob("*.safetensors"))
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():
                        if k in self.where:
                            raise UserError(f"MODEL: tensor {k} is in both {self.where[k].name} and {f.name}")
                        self.where[k] = f
                        self.shapes[k] = tuple(sf.get_slice(k).get_shape())
            except UserError:
                raise
            except Exception as e:  # safetensors raises its own error type for broken headers
                raise UserError(f"MODEL: {f} has a broken safetensors header ({_first_line(e)})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Read one tensor (a private copy in ``dtype``); the shard is unmapped again afterwards."""
        from safetensors import safe_open

        f = self.where[name]
        try:
            with safe_open(str(f), framework="pt") as sf:
                t = sf.get_tensor(name)
        except Exception as e:
            raise UserError(f"MODEL: cannot read tensor {name} from {f} ({_first_line(e)})") from None
        return t.to(dtype) if t.dtype != dtype else t.clone()


@dataclass
class StreamingModel:
    """What ``compress`` needs of a model without loading it: a meta skeleton and a weight reader."""

    model: nn.Module  # every parameter on the meta device
    source: str
    weights: ShardedWeights
    fingerprint: str
    config: dict
    kind: str = "folder"
    aliases: dict[str, str] = field(default_factory=dict)  # state_dict name -> checkpoint name


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters go to the meta device as modules register them; buffers stay real.

    What ``accelerate.init_empty_weights(include_buffers=False)`` does: the rotary ``inv_freq`` and other
    non-persistent buffers are computed by the modules' constructors exactly as ``from_pretrained`` does,
    while each parameter's (uninitialised, untouched) storage is dropped as soon as it is registered.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(folder: Path, forward: bool = False) -> nn.Module:
    """The model's module tree with every parameter on the meta device, built from config.json alone.

    ``forward=True`` (calibrated runs) keeps the buffers real and the parameters float32, as
    ``model_io.load_model`` loads them, so blocks whose weights are filled in can run forward passes.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
        if forward:
            with _parameters_on_meta():
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(f"MODEL: {folder} is not a loadable causal LM: {_first_line(e)}") from None
    return model.eval()


def _persistent_float_entries(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(state_dict name, tensor, is_parameter) for every floating entry, duplicates (tied) included."""
    params = {id(p) for p in model.parameters()}
    state = model.state_dict(keep_vars=True)
    return [(n, t, id(t) in params) for n, t in state.items() if t.is_floating_point()]


def open_streaming(source: str, forward: bool = False) -> StreamingModel | None:
    """A streaming view of a safetensors folder, or None when the model must be loaded fully.

    Shapes that disagree with config.json are bad input (UserError); names that do not map one to one
    (a checkpoint transformers would rename on load) return None so the caller loads it fully.
    ``forward=True``: a skeleton whose blocks can run once :func:`loaded_weights` fills them in.
    """
    if classify_source(source) != "folder":
        return None
    folder = Path(source)
    if not any(folder.glob("*.safetensors")):
        return None
    weights = ShardedWeights(folder)
    model = skeleton(folder, forward)
    aliases: dict[str, str] = {}
    by_id: dict[int, list[str]] = {}
    for name, t, is_param in _persistent_float_entries(model):
        by_id.setdefault(id(t), []).append(name)
        if name in weights:
            want, got = tuple(t.shape), weights.shapes[name]
            if want != got:
                raise UserError(f"MODEL: tensor {name} has shape {list(got)} in {weights.where[name].name} "
                                f"but config.json implies {list(want)}")
            aliases[name] = name
        elif not is_param:
            continue  # a persistent buffer the checkpoint does not hold: rebuilt from the config
    for names in by_id.values():  # tied parameters: any stored alias serves them all
        stored = next((n for n in names if n in weights), None)
        for n in names:
            if n not in aliases and stored is not None:
                aliases[n] = stored
    missing = [n for n, _, is_param in _persistent_float_entries(model) if is_param and n not in aliases]
    if missing:
        return None
    files = weights.files + [folder / "config.json"]
    config = json.loads(model.config.to_json_string())
    return StreamingModel(model, source, weights, fingerprint(files), config, aliases=aliases)


def open_model(source: str, streaming: bool = True, forward: bool = False) -> StreamingModel | LoadedModel:
    """The streaming view where possible (and wanted), else the fully loaded model.

    ``forward``: the run needs calibration forward passes (see :func:`open_streaming`).
    """
    if streaming:
        s = open_streaming(source, forward)
        if s is not None:
            return s
    return load_model(source)


def source_weight(loaded: StreamingModel | LoadedModel, full: str, lin: nn.Linear) -> torch.Tensor:
    """A linear layer's weight in the source model, float32 (read from its shard when streaming and not loaded).

    A weight already in memory (a loaded model, or a block that :func:`loaded_weights` filled in) is
    returned as is, as the layer-wise engine needs it in place.
    """
    if isinstance(loaded, StreamingModel):
        release_freed_memory()  # the previous layer's buffers
        if lin.weight.is_meta:
            return loaded.weights.get(loaded.aliases.get(f"{full}.weight", f"{full}.weight"))
    return lin.weight.detach().float()


@contextlib.contextmanager
def loaded_weights(loaded: StreamingModel, module: nn.Module, path: str) -> Iterator[nn.Module]:
    """Fill ``module``'s meta parameters (``path`` = its state_dict prefix) from the shards while open.

    On exit the original meta parameters are put back (object identity kept, so tied-weight detection
    still works) and the float32 copies are freed: a calibrated streaming run holds one block at a time.
    """
    saved = []
    try:
        for sub_name, sub in module.named_modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                full = ".".join(x for x in (path, sub_name, name) if x)
                t = loaded.weights.get(loaded.aliases.get(full, full), torch.float32)
                saved.append((sub, name, p))
                sub._parameters[name] = nn.Parameter(t, requires_grad=False)
        yield module
    finally:
        for sub, name, p in reversed(saved):
            sub._parameters[name] = p
        saved.clear()
        release_freed_memory()


def block_loader(loaded: StreamingModel | LoadedModel):
    """``load(module, path)`` context for ``layerwise.calibrated_blocks`` (None when the model is loaded)."""
    if not isinstance(loaded, StreamingModel):
        return None
    return lambda module, path: loaded_weights(loaded, module, path)


class LazyTensors(Mapping):
    """name -> tensor, each read from the shards only when asked for (so ``items()`` streams)."""

    def __init__(self, loaded: StreamingModel, names: list[str]):
        self.loaded = loaded
        self.names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.loaded.weights.get(self.loaded.aliases[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def model_dense_tensors(loaded: StreamingModel | LoadedModel, compressed: set[str]):
    """Every tensor that is not a compressed weight and the tied aliases, like ``model_io.dense_tensors``.

    Streaming: the tensors are a lazy mapping read shard by shard; tied parameters are stored once under
    their first state_dict name, as the in-memory path does.
    """
    from .loading import dense_tensors

    if not isinstance(loaded, StreamingModel):
        return dense_tensors(loaded.model, compressed)
    names: list[str] = []
    tied: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t, _ in _persistent_float_entries(loaded.model):
        if name in compressed or name not in loaded.aliases:
            continue
        if id(t) in first and t.numel() > 0:
            tied[name] = first[id(t)]
            continue
        first[id(t)] = name
        names.append(name)
    return LazyTensors(loaded, names), tied
