"""The one-launch activation quantizer of IE-BME inputs (kernels/act_quant.cu) against the formats' rule: its
CPU reference everywhere, the CUDA kernel bit for bit where CuPy and a GPU are present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from unionsparse.formats.arithmetic.activations import quantize_activations
from unionsparse.formats.arithmetic.outlier_side import quantize_inputs_torch
from unionsparse.kernels import available
from unionsparse.kernels.act_quant import quantize_inputs_reference

CASES = [  # (N, K, kp, bits, group, clip, outliers, side group)
    (1, 576, 576, 4, 128, 1.0, 0, None),
    (3, 100, 128, 4, 32, 0.9, 0, None),
    (1, 1536, 1536, 2, 64, 1.0, 0, None),
    (5, 576, 576, 4, 128, 1.0, 8, None),
    (2, 200, 256, 4, 64, 0.85, 16, 8),
    (1, 4096, 4096, 4, 128, 1.0, 128, 128),
]


def _inputs(n: int, k: int, n_side: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.linspace(0.1, 3.0, k)
    x[:, ::17] *= 20  # outliers
    x[0, :7] = 0.0  # a group with zeros
    perm = None
    if n_side:
        chans = torch.randperm(k, generator=g)[:n_side].sort().values
        rest = torch.tensor([c for c in range(k) if c not in set(chans.tolist())])
        perm = torch.cat([rest, chans])
    return x.half().float(), perm


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_formats_rule_padded(case):
    n, k, kp, bits, group, clip, n_side, side_group = case
    x, perm = _inputs(n, k, n_side)
    xq, sx, oq, osx = quantize_inputs_reference(x, bits, group, clip, kp, perm, n_side, 8, side_group)
    assert xq.shape == (n, kp) and xq.dtype == torch.int8 and sx.dtype == torch.float32
    assert not xq[:, k:].any()  # padding codes are zero
    if n_side:
        act = {"bits": bits, "group_size": group, "clip": clip, "outlier_group_size": side_group}
        want = quantize_inputs_torch(x, perm, n_side, act)
        assert torch.equal(xq[:, :k], want[0]) and torch.equal(oq, want[2])
        assert not xq[:, k - n_side:k].any()  # outlier channels leave the main input
        assert torch.equal(osx, want[3].float())
    else:
        codes, scales = quantize_activations(x.numpy(), bits, group, clip)
        assert np.array_equal(xq[:, :k].numpy(), codes) and np.array_equal(sx.numpy(), scales.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_bit_for_bit(case, dtype):
    import cupy as cp
    from unionsparse.kernels.act_quant import quantize_inputs

    n, k, kp, bits, group, clip, n_side, side_group = case
    x, perm = _inputs(n, k, n_side, seed=1)
    want = quantize_inputs_reference(x, bits, group, clip, kp, perm, n_side, 8, side_group)
    xd = cp.asarray(x.to(dtype).numpy())
    pd = None if perm is None else cp.asarray(perm.numpy().astype(np.int32))
    got = quantize_inputs(xd, bits, group, clip, kp, pd, n_side, 8, side_group)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            assert np.array_equal(cp.asnumpy(g), w.numpy())
