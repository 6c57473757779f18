"""Quantize one pruned linear layer from its calibration statistics: the per-layer step of ``compress``.

``--quant`` modes: ``w4a16`` (4-bit weights, fp16 activations), ``w4a4`` / ``w2a4`` and ``w4a8`` / ``w2a8``
(4- or 2-bit weights, per-token 4- or 8-bit activations). Weights are round-to-nearest by default, with ``clip_search``
per-group clip ratios scored on the layer's H, with ``gptq`` GPTQ error feedback (both combine).
The activation clip ratio is calibrated per layer on a token sample of the layer's inputs, and
``keep_outliers`` N keeps the N most active input channels at 8 bits (Atom; :mod:`.outliers`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ...formats.arithmetic.activations import activation_scheme
from ...formats.arithmetic.linears import FakeQuantLinear
from ...formats.arithmetic.outlier_side import OutlierSide, dequantize_layer, split_outliers
from ...formats.arithmetic.weights import QuantizedWeight
from ..calibrate.statistics import TOKENS_PER_BATCH, InputTaps, TokenSampler
from ..errors import UserError
from .act_clip import ACT_CLIP_GRID, act_clip_errors, best_clip
from .modes import FP16_ACTIVATIONS, quant_mode
from .outliers import permute_hessian, select_outlier_channels
from .weights import quantize_weight


@dataclass
class QuantSpec:
    """What to do to every layer."""

    weight_bits: int
    act_bits: int  # 4 or 8, or FP16_ACTIVATIONS for weight-only
    group_size: int = 128
    gptq: bool = False
    clip_search: bool = False
    act_clip: bool = True  # calibrate the activation clip ratio (else 1.0)
    keep_outliers: int = 0
    act_order: bool = False
    percdamp: float = 0.01

    @classmethod
    def from_mode(cls, mode: str, **kw) -> QuantSpec:
        """The spec of a ``--quant`` mode that quantizes weights (not ``none``)."""
        bits = quant_mode(mode)
        if bits.weight_bits is None:
            raise UserError(f"--quant {mode} quantizes nothing: no QuantSpec (use w4a4, w2a4, w4a8, w2a8 or w4a16)")
        spec = cls(bits.weight_bits, bits.act_bits, **kw)
        if spec.keep_outliers and not bits.quantizes_activations:
            raise UserError(f"outlier channels need quantized activations (w4a4, w2a4, w4a8 or w2a8), not {mode}")
        return spec

    @property
    def needs_hessian(self) -> bool:
        return self.gptq or self.clip_search

    @property
    def needs_tokens(self) -> bool:
        return self.act_bits != FP16_ACTIVATIONS and self.act_clip


@dataclass
class QuantizedLayer:
    qweight: QuantizedWeight  # codes in the (outlier-)permuted column order when outliers is set
    activations: dict  # the activation scheme record (act_quant.activation_scheme)
    outliers: OutlierSide | None = None
    report: dict = field(default_factory=dict)

    def module(self, bias: torch.Tensor | None = None) -> FakeQuantLinear:
        return FakeQuantLinear.from_quantized(self.qweight, self.activations, bias, self.outliers)

    def dequantize(self) -> np.ndarray:
        """float32 [M, K] weight in the original column order (main part and 8-bit side together)."""
        deq = self.qweight.dequantize()
        return deq if self.outliers is None else dequantize_layer(deq, self.outliers)


def quantize_layer(
    weight: torch.Tensor,
    spec: QuantSpec,
    *,
    mask: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    x_sq_norm: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> QuantizedLayer:
    """Quantize a (pruned) weight [M, K]; ``mask`` True = kept, ``h`` = 2/n Σ x xᵀ, ``tokens`` [N, K]."""
    t0 = time.perf_counter()
    w = torch.as_tensor(weight).float()
    k = w.shape[1]
    implicit_mask = mask is None  # then w * mask == w: quantize_weight need not apply it
    if mask is None:
        mask = w != 0
    if spec.needs_hessian and h is None:
        raise UserError("GPTQ and clip search need the layer's calibration Hessian")
    side = None
    channels = None
    if spec.keep_outliers:
        if x_sq_norm is None and h is not None:  # diag H = 2/n sum x_k^2: the same ranking (SparseGPT stats)
            x_sq_norm = torch.diagonal(torch.as_tensor(h))
        if x_sq_norm is None:
            raise UserError("outlier channels are chosen from x_sq_norm (or diag H); none given")
        channels = select_outlier_channels(x_sq_norm, spec.keep_outliers)
        w, side = split_outliers(w * mask, channels)
        p = torch.from_numpy(side.perm.astype(np.int64)).to(w.device)
        mask = mask.to(w.device)[:, p].clone()
        mask[:, k - channels.size :] = False
        if h is not None:
            h = permute_hessian(h, side.perm)
        if tokens is not None:
            tokens = tokens.to(w.device)[:, p].clone()
            tokens[:, k - channels.size :] = 0.0
    q = quantize_weight(w, spec.weight_bits, spec.group_size, gptq=spec.gptq, clip_search=spec.clip_search,
                        h=h, mask=None if implicit_mask and side is None and not spec.gptq else mask,
                        act_order=spec.act_order, percdamp=spec.percdamp)
    report: dict = {}
    clip = 1.0
    if spec.needs_tokens and tokens is not None:
        errs, energy = act_clip_errors(tokens.to(w.device), w * mask.to(w.device), q.dequantize(),
                                       spec.act_bits, q.group_size, ACT_CLIP_GRID)
        clip = best_clip(errs)
        report["act_clip_rel_error"] = errs
        report["act_clip_energy"] = energy  # ||X Wᵀ||²: weighs this layer in a clip shared with its siblings
    acts = activation_scheme(spec.act_bits, q.group_size, clip,
                             None if channels is None else channels.tolist())
    report["seconds"] = time.perf_counter() - t0
    return QuantizedLayer(q, acts, side, report)


def spec_from_config(cfg, in_features: int) -> QuantSpec | None:
    """The QuantSpec of a CompressConfig for a layer of ``in_features`` input channels (None for ``--quant
    none``); ``--keep-outliers auto`` resolves per layer (``CompressConfig.outliers_for``)."""
    if cfg.quant == "none":
        return None
    return QuantSpec.from_mode(cfg.quant, group_size=cfg.group_size, gptq=cfg.gptq,
                               clip_search=cfg.clip_search, keep_outliers=cfg.outliers_for(in_features))


def hessian_kind(kind: str | None) -> str | None:
    """The statistics kind that also holds H (for GPTQ / clip search), from the pruning method's kind."""
    return {"wanda": "both", "sparsegpt": "sparsegpt", "both": "both"}.get(kind or "", kind)


class TokenTap(InputTaps):
    """A token sample of every linear's input over all ``blocks``, from the first pass that reaches it:
    :meth:`pop` hands a layer's sample over and stops tapping it. ``compress`` asks the block stream for the
    same sample instead (``layerwise.calibrated_blocks(tokens=True)``); benchmarks/bench_quant.py uses this."""

    def __init__(self, blocks, linears_of, prefix: str, per_batch: int = TOKENS_PER_BATCH, seed: int = 0):
        super().__init__()
        for i, block in enumerate(blocks):
            for sub, mod in linears_of(block):
                self.add(f"{prefix}.{i}.{sub}", mod, TokenSampler(per_batch, seed))

    def pop(self, name: str) -> torch.Tensor | None:
        samplers = self.remove(name)
        return samplers[0].tokens() if samplers else None
