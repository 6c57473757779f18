"""Decoder blocks as calibration runs them: catch block 0's inputs (the embedding part run on the windows), run
one block over every window, and hold the weights of the parts outside the blocks while needed (streaming)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..errors import UserError
from ..model.loading import find_blocks

#: ``load(module, path)``: a context manager holding ``module``'s weights (read from the checkpoint) while
#: open; the streaming runs pass ``streaming.loaded_weights``.
LoadWeights = Callable[[nn.Module, str], contextlib.AbstractContextManager]


class _StopForward(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for block 0: stores its input and keyword arguments, then stops the forward pass."""

    def __init__(self, module: nn.Module, inps: torch.Tensor):
        super().__init__()
        self.module = module
        self.inps = inps
        self.count = 0
        self.kwargs: dict | None = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # attributes the model reads off its layers (e.g. Qwen2's attention_type)
            return getattr(super().__getattr__("module"), name)

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise UserError("MODEL: its decoder blocks take positional arguments beyond hidden_states; calibration "
                            "runs blocks with keyword arguments only (LLaMA, Mistral, Qwen2, OPT, ...)")
        self.inps[self.count] = hidden_states[0]
        self.count += 1
        if self.kwargs is None:
            self.kwargs = kwargs
        raise _StopForward


def _base_of(model: nn.Module, prefix: str) -> nn.Module:
    obj = model
    for part in prefix.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, samples: torch.Tensor, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, dict]:
    """Run the embedding part for every sample and return block 0's inputs and keyword arguments.

    ``samples`` is ``LongTensor [n, seqlen]``. Returns ``(inps [n, seqlen, hidden] on device, kwargs)``,
    kwargs being what the model passes to each block (attention_mask, position_ids,
    position_embeddings, ...) for one sample; they are the same for every sample of one length.
    """
    device = torch.device(device)
    blocks, prefix = find_blocks(model)
    base = _base_of(model, prefix)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    first = blocks[0]
    p = next(first.parameters())
    hidden = getattr(model.config, "hidden_size", None) or p.shape[-1]
    inps = torch.zeros(samples.shape[0], samples.shape[1], hidden, dtype=p.dtype, device=device)
    moved = _move_non_blocks(base, blocks, device)
    catcher = _Catcher(first, inps)
    blocks[0] = catcher
    try:
        for j in range(samples.shape[0]):
            try:
                model(samples[j : j + 1].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        blocks[0] = first
        _move_back(moved)
    if catcher.count != samples.shape[0]:
        raise UserError(f"MODEL: {catcher.count} of {samples.shape[0]} calibration windows reached the first decoder "
                        "block; calibration needs every window to pass through the blocks found")
    kwargs = dict(catcher.kwargs or {})
    kwargs.pop("use_cache", None)
    kwargs["use_cache"] = False
    return inps, kwargs


def _move_non_blocks(
    base: nn.Module, blocks: nn.ModuleList, device: torch.device
) -> list[tuple[nn.Module, torch.device]]:
    """Move the base model's parts other than the blocks (embeddings, rotary, norms) to ``device``."""
    moved = []
    for child in base.children():
        if child is blocks:
            continue
        t = next(iter(list(child.parameters()) + list(child.buffers())), None)
        if t is not None and t.device != device:
            moved.append((child, t.device))
            child.to(device)
    return moved


def _move_back(moved: list[tuple[nn.Module, torch.device]]) -> None:
    for child, dev in moved:
        child.to(dev)


def _out(o):
    return o[0] if isinstance(o, (tuple, list)) else o


@torch.no_grad()
def forward_block(
    block: nn.Module, inps: torch.Tensor, kwargs: dict, outs: torch.Tensor | None = None
) -> torch.Tensor:
    """Outputs of ``block`` for every sample of ``inps``, one sample at a time (``outs`` may be reused)."""
    if outs is None:
        outs = torch.empty_like(inps)
    run_block(block, inps, kwargs, outs)
    return outs


@torch.no_grad()
def run_block(block: nn.Module, inps: torch.Tensor, kwargs: dict, outs: torch.Tensor | None = None) -> None:
    """Run ``block`` on every sample of ``inps``, one at a time; ``outs``, when given, receives the outputs."""
    for j in range(inps.shape[0]):
        o = _out(block(inps[j : j + 1], **kwargs))
        if outs is not None:
            outs[j] = o[0]


def device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s first parameter lives (the CPU for a module without any)."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def non_block_weights(model: nn.Module, load: LoadWeights | None) -> contextlib.AbstractContextManager:
    """Weights of the base model's parts other than the blocks (embeddings, norms), loaded while open.

    What ``capture_block_inputs`` needs when the parameters are on the meta device (a no-op when
    ``load`` is None).
    """
    if load is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    blocks, prefix = find_blocks(model)
    base = _base_of(model, prefix)
    base_path = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    for name, child in base.named_children():
        if child is not blocks:
            stack.enter_context(load(child, f"{base_path}.{name}" if base_path else name))
    return stack
