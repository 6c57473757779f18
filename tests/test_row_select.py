"""The fast paths of the streaming hot loop give exactly what the reference formulas give."""

from __future__ import annotations

import pytest
import torch
from unionsparse.compressor.pruning import methods as pruning
from unionsparse.compressor.pruning.row_select import prune_lowest_mask
from unionsparse.formats.arithmetic import weights as quant


def sort_mask(metric: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: stable sort, prune the first k of every row."""
    idx = torch.sort(metric, dim=1, stable=True)[1][:, :k]
    mask = torch.ones(metric.shape, dtype=torch.bool)
    mask.scatter_(1, idx, False)
    return mask


@pytest.mark.parametrize("kind", ["random", "ties", "fp16", "zeros"])
@pytest.mark.parametrize("shape,k", [((7, 13), 6), ((5, 64), 1), ((5, 64), 63), ((33, 100), 50)])
def test_selection_equals_stable_sort(kind, shape, k):
    g = torch.Generator().manual_seed(0)
    m = torch.rand(shape, generator=g)
    if kind == "ties":
        m = (m * 4).floor()
    elif kind == "fp16":  # magnitudes of fp16 weights: many exact ties
        m = (torch.randn(shape, generator=g) * 0.02).half().float().abs()
    elif kind == "zeros":
        m = torch.zeros(shape)
        m[0, 3] = 1
    assert torch.equal(torch.from_numpy(prune_lowest_mask(m.numpy(), k)), sort_mask(m, k))


def test_non_finite_metric_falls_back_to_sort():
    m = torch.rand(4, 16)
    m[1, 2] = float("nan")
    assert prune_lowest_mask(m.numpy(), 8) is None
    assert torch.equal(pruning._row_mask(m, 0.5), sort_mask(m, 8))


@pytest.mark.parametrize("k", [256, 200])  # whole groups (broadcast path) and a ragged last group
def test_rtn_codes_equal_repeated_scales(k):
    w = torch.randn(16, k) * 0.05
    scales = quant.scales_from_absmax(quant.group_absmax(w, 64), 4)
    s = scales.repeat_interleave(64, dim=1)[:, :k]
    ref = torch.clamp(torch.round(w / s), -8, 7).to(torch.int8)
    assert torch.equal(quant.quantize_with_scales(w, scales, 4, 64), ref)
    padded = torch.zeros(16, scales.shape[1] * 64)
    padded[:, :k] = w
    assert torch.equal(quant.group_absmax(w, 64), padded.abs().reshape(16, -1, 64).amax(dim=2))
