"""A calibration stream: windows running through the decoder blocks one block at a time.

Block i's inputs are the outputs of blocks 0..i-1 as they were when the stream passed them (in ``compress``:
already pruned and quantized, as both reference codes do). Only one block's activations are held (``inps`` and
``outs``, each ``[n, seqlen, hidden]``). Whatever needs the inputs of one block's layers on one stream taps the
same forward pass (``statistics.InputTaps``): a block is run once for its statistics (the block as it is
before it is compressed) and once to advance the stream (the compressed block), and that second run also
serves the activation-sparsity thresholds when they calibrate on the same windows.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import LoadWeights, capture_block_inputs, non_block_weights, run_block
from .statistics import LayerStats, collect_block_stats


class BlockStream:
    """Calibration windows ``samples`` ([n, seqlen] token ids) at the decoder blocks of ``model``.

    ``load``: as in ``layerwise.calibrated_blocks`` (streaming: the embedding part is filled in while block 0's
    inputs are caught). Per block: :meth:`statistics` (optional), :meth:`run` (the outputs), :meth:`advance`.
    """

    def __init__(self, model: nn.Module, samples: torch.Tensor, device: str | torch.device = "cpu",
                 load: LoadWeights | None = None) -> None:
        with non_block_weights(model, load):
            self.inps, self.kwargs = capture_block_inputs(model, samples, torch.device(device))
        self.outs = torch.empty_like(self.inps)
        self.ran = False  # the current block's outputs are in ``outs``

    @torch.no_grad()
    def statistics(self, block: nn.Module, kind: str, tokens: bool = False,
                   outputs: bool = False) -> dict[str, LayerStats]:
        """Statistics of every linear's input in ``block`` (``statistics.collect_block_stats``); with
        ``outputs`` the same forward pass also gives the block's outputs (a block that stays as it is)."""
        stats = collect_block_stats(block, None, self.inps, self.kwargs, kind, self.outs if outputs else None,
                                    tokens=tokens)
        self.ran = outputs
        return stats

    @torch.no_grad()
    def run(self, block: nn.Module) -> None:
        """``block``'s outputs for the current inputs, into ``outs``; taps on its layers see their inputs."""
        run_block(block, self.inps, self.kwargs, self.outs)
        self.ran = True

    def advance(self) -> None:
        """The current block's outputs become the next block's inputs."""
        self.inps, self.outs = self.outs, self.inps
        self.ran = False

    def close(self) -> None:
        self.inps = self.outs = None
