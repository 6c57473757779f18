"""Weight and activation quantization: RTN, clip search, GPTQ, activation quantizer, outliers, fake quant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from unionsparse.compressor.model.modules import replace_linear
from unionsparse.compressor.quantize.act_clip import calibrate_act_clip
from unionsparse.compressor.quantize.clip_search import diagonal_blocks, gram, search_clip
from unionsparse.compressor.quantize.gptq import gptq, layer_error
from unionsparse.compressor.quantize.outliers import select_outlier_channels
from unionsparse.compressor.quantize.weights import quantize_weight
from unionsparse.formats.arithmetic.activations import activation_scheme, dequantize_activations, quantize_activations
from unionsparse.formats.arithmetic.grouped import grouped_int_matmul
from unionsparse.formats.arithmetic.linears import FakeQuantLinear
from unionsparse.formats.arithmetic.outlier_side import column_permutation, side_bytes, split_outliers
from unionsparse.formats.arithmetic.weights import rtn

RANGES = {2: (-2, 1), 4: (-8, 7), 8: (-128, 127)}


def correlated_problem(m=96, k=320, n=1024, sparsity=0.5, seed=0):
    """Weight, mask, calibration inputs: channels correlated, unevenly scaled; K not a multiple of 128."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(n, k, generator=g) @ mix) * (0.2 + 3 * torch.rand(k, generator=g))
    mask = torch.rand(m, k, generator=g) >= sparsity
    w = torch.randn(m, k, generator=g) * mask
    return w, mask, x, 2.0 / n * x.T @ x


def block_error(w, deq, h, group):
    """Sum over (row, group) of e^T H_jj e: the objective clip search minimises."""
    e = (w - torch.as_tensor(deq)).numpy().astype(np.float64)
    blocks = diagonal_blocks(torch.as_tensor(h), group).numpy().astype(np.float64)
    total = 0.0
    for j in range(blocks.shape[0]):
        a, b = j * group, min((j + 1) * group, w.shape[1])
        total += np.einsum("mi,ij,mj->", e[:, a:b], blocks[j, : b - a, : b - a], e[:, a:b])
    return total


# ---------------------------------------------------------------- activations


def reference_act_quant(x: np.ndarray, bits: int, group: int, clip: float):
    """The documented rule, element by element in numpy float32 scalars."""
    lo, hi = RANGES[bits]
    n, k = x.shape
    ng = -(-k // group)
    codes = np.zeros((n, k), np.int8)
    scales = np.zeros((n, ng), np.float16)
    tiny = np.finfo(np.float16).tiny
    for r in range(n):
        for j in range(ng):
            seg = x[r, j * group : (j + 1) * group].astype(np.float32)
            s32 = np.float32(np.abs(seg).max()) * np.float32(clip) / np.float32((1 << (bits - 1)) - 0.5)
            s = max(np.float16(max(s32, np.float32(tiny))), np.float16(tiny))
            scales[r, j] = s
            q = np.rint(seg / np.float32(s))
            codes[r, j * group : (j + 1) * group] = np.clip(q, lo, hi)
    return codes, scales


@pytest.mark.parametrize("bits,group,clip", [(4, 128, 1.0), (4, 64, 0.8), (8, 128, 1.0), (2, 32, 0.9)])
def test_activation_quantizer_follows_documented_rule(bits, group, clip):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 300)) * rng.uniform(0.01, 20, 300)).astype(np.float32)
    x[3] = 0.0  # an all-zero token
    codes, scales = quantize_activations(x, bits, group, clip)
    ref_codes, ref_scales = reference_act_quant(x, bits, group, clip)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scales, ref_scales)
    lo, hi = RANGES[bits]
    assert codes.dtype == np.int8 and codes.min() >= lo and codes.max() <= hi
    assert scales.dtype == np.float16 and np.isfinite(scales).all() and (scales > 0).all()
    assert (codes[3] == 0).all()


def test_activation_dequantization_error_is_half_a_step():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 256)) * 5).astype(np.float32)
    codes, scales = quantize_activations(x, 4, 128)
    err = np.abs(dequantize_activations(codes, scales, 128) - x)
    step = np.repeat(scales.astype(np.float32), 128, axis=1)
    # half a step, plus the fp16 rounding of the scale (2^-11 relative) at the clamped extreme (7.5 steps)
    assert (err <= (0.5 + 7.5 * 2.0**-11) * step).all()
    # both extremes of the grid are used
    assert codes.min() == -8 and codes.max() == 7


def test_act_clip_calibration_never_worse_than_no_clip():
    w, _, x, _ = correlated_problem()
    x = x.clone()
    x[:, 5] *= 40  # a heavy channel: clipping the others' groups should help somewhere
    q = rtn(w, 4, 128)
    best, errs = calibrate_act_clip(x[:256], w, q.dequantize(), 4, 128)
    assert 0.6 <= best <= 1.0 and errs[best] <= errs[1.0]
    rec = activation_scheme(4, 128, best)
    assert rec["scheme"] == "per-token-symmetric" and rec["clip"] == best and rec["outlier_channels"] is None


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("method", ["rtn", "clip", "gptq", "gptq+clip", "gptq-act-order"])
def test_weight_codes_scales_and_pruned_zeros(bits, method):
    w, mask, _, h = correlated_problem(seed=bits)
    q = quantize_weight(w, bits, 128, gptq=method.startswith("gptq"), clip_search="clip" in method, h=h,
                        mask=mask, act_order=method == "gptq-act-order")
    lo, hi = RANGES[bits]
    assert q.codes.shape == tuple(w.shape) and q.codes.dtype == np.int8
    assert q.codes.min() >= lo and q.codes.max() <= hi
    assert q.scales.shape == (w.shape[0], 3) and q.scales.dtype == np.float16
    assert np.isfinite(q.scales).all() and (q.scales > 0).all()
    assert (q.codes[~mask.numpy()] == 0).all(), "a pruned weight got a nonzero code"
    # the kept weights are actually quantized, not flushed to zero (2 bits round many small ones to 0)
    assert (q.codes[mask.numpy()] != 0).mean() > (0.3 if bits == 2 else 0.8)


def test_rtn_dequantization_error_bounded():
    w, _, _, _ = correlated_problem()
    q = rtn(w, 4, 128)
    step = np.repeat(q.scales.astype(np.float32), 128, axis=1)[:, : w.shape[1]]
    assert (np.abs(q.dequantize() - w.numpy()) <= (0.5 + 7.5 * 2.0**-11) * step).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_clip_search_beats_rtn_on_its_objective(bits):
    w, mask, _, h = correlated_problem()
    r = rtn(w, bits, 128)
    c = quantize_weight(w, bits, 128, clip_search=True, h=h, mask=mask)
    assert block_error(w, c.dequantize(), h, 128) < block_error(w, r.dequantize(), h, 128)
    clip = search_clip(w, h, bits, 128)
    assert clip.shape == (w.shape[0], 3) and (clip <= 1.0).all() and (clip >= 0.5).all()
    # with the identity as H it reduces to weight MSE
    c_mse = quantize_weight(w, bits, 128, clip_search=True, h=None)
    assert ((c_mse.dequantize() - w.numpy()) ** 2).sum() <= ((r.dequantize() - w.numpy()) ** 2).sum()
    assert torch.allclose(gram(torch.eye(3)), torch.eye(3))


@pytest.mark.parametrize("masked", [False, True])
def test_gptq_layer_error_below_rtn(masked):
    w, mask, _, h = correlated_problem(seed=3)
    if not masked:
        w = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
        mask = None
    r = rtn(w, 4, 128)
    g = gptq(w, h, 4, 128, mask=mask)
    assert layer_error(w, g.dequantize(), h) < 0.95 * layer_error(w, r.dequantize(), h)
    ga = gptq(w, h, 4, 128, mask=mask, act_order=True)
    assert layer_error(w, ga.dequantize(), h) < layer_error(w, r.dequantize(), h)


def test_gptq_propagating_pruned_error_beats_reapplying_the_mask():
    w, mask, _, h = correlated_problem(seed=5)
    prop = gptq(w, h, 4, 128, mask=mask, pruned="propagate")
    reap = gptq(w, h, 4, 128, mask=mask, pruned="reapply")
    assert (reap.codes[~mask.numpy()] == 0).all() and (prop.codes[~mask.numpy()] == 0).all()
    assert layer_error(w, prop.dequantize(), h) < layer_error(w, reap.dequantize(), h)


def test_gptq_dead_inputs_and_bad_shapes():
    w, _, x, _ = correlated_problem()
    x = x.clone()
    x[:, 7] = 0.0
    h = x.T @ x
    q = gptq(w, h, 4, 128)
    assert (q.codes[:, 7] == 0).all()
    with pytest.raises(ValueError, match="H must be"):
        gptq(w, h[:10, :10], 4, 128)
    with pytest.raises(ValueError, match="GPTQ needs"):
        quantize_weight(w, 4, 128, gptq=True)


# ---------------------------------------------------------------- outliers


def test_outlier_selection_and_split():
    rng = np.random.default_rng(0)
    stats = rng.uniform(0, 1, 200)
    stats[[3, 50, 199]] = [10, 20, 30]
    ch = select_outlier_channels(stats, 3)
    np.testing.assert_array_equal(ch, [3, 50, 199])
    perm = column_permutation(200, ch)
    assert sorted(perm.tolist()) == list(range(200)) and perm[-3:].tolist() == [3, 50, 199]
    w = torch.randn(16, 200, generator=torch.Generator().manual_seed(1))
    main, side = split_outliers(w, ch)
    assert (main[:, -3:] == 0).all()
    torch.testing.assert_close(main[:, :-3], w[:, perm[:-3].astype(np.int64)])
    assert side.codes.shape == (16, 3) and side.scales.shape == (16, 1)
    # per row: half a step, plus the fp16 rounding of the scale at the clamped extreme (127.5 steps)
    bound = (0.5 + 127.5 * 2.0**-11) * side.scales.astype(np.float32)
    assert (np.abs(side.dequantize() - w[:, ch].numpy()) <= bound).all()
    assert side_bytes(16, 200, 3) == {"outlier_codes": 48, "outlier_scales": 32, "outlier_channels": 12}
    with pytest.raises(ValueError):
        select_outlier_channels(stats, 200)


# ---------------------------------------------------------------- fake quant


def independent_reference(x, w_codes, w_scales, bits_x, group, clip, side=None):
    """float64 output from int64 partial sums, by explicit loops over groups (fp16 at the end)."""
    xq, sx = reference_act_quant(x, bits_x, group, clip)
    n, k = x.shape
    y = np.zeros((n, w_codes.shape[0]), np.float64)
    for j in range(-(-k // group)):
        sl = slice(j * group, (j + 1) * group)
        p = xq[:, sl].astype(np.int64) @ w_codes[:, sl].astype(np.int64).T
        y += p * (sx[:, j : j + 1].astype(np.float64) * w_scales[:, j].astype(np.float64)[None, :])
    if side is not None:
        xs, codes, scales = side
        oq, osx = reference_act_quant(xs, 8, xs.shape[1], 1.0)
        p = oq.astype(np.int64) @ codes.astype(np.int64).T
        y += p * (osx.astype(np.float64) * scales[:, 0].astype(np.float64)[None, :])
    return y


def test_grouped_int_matmul_partials_are_exact():
    rng = np.random.default_rng(3)
    xq = rng.integers(-8, 8, (9, 384)).astype(np.int8)
    wq = rng.integers(-8, 8, (11, 384)).astype(np.int8)
    xq[:, :128] = -8
    wq[:, :128] = -8  # the largest partial sum, 128 * 64
    ones_x, ones_w = torch.ones(9, 3), torch.ones(11, 3)
    got = grouped_int_matmul(torch.from_numpy(xq), ones_x, torch.from_numpy(wq), ones_w, 128)
    want = xq.astype(np.int64) @ wq.astype(np.int64).T
    np.testing.assert_array_equal(got.numpy().astype(np.int64), want)


@pytest.mark.parametrize("bits_x", [4, 8])
@pytest.mark.parametrize("bits_w", [4, 2])
def test_fake_quant_linear_equals_integer_computation(bits_w, bits_x):
    w, mask, x, h = correlated_problem(m=40, k=320, n=64, seed=bits_w)
    q = quantize_weight(w, bits_w, 128, gptq=True, h=h, mask=mask)
    act = activation_scheme(bits_x, 128, 0.9)
    layer = FakeQuantLinear.from_quantized(q, act)
    got = layer(x).detach()
    assert got.dtype == torch.float32  # model dtype kept, values are fp16
    want = independent_reference(x.numpy(), q.codes, q.scales, bits_x, 128, 0.9)
    want16 = torch.from_numpy(want).half().float()
    # fp32 accumulation of at most 3 scaled groups vs float64: equal after fp16 rounding up to one ulp
    ulp = torch.abs(want16) * 2.0**-10 + 2.0**-24
    assert (torch.abs(got - want16) <= ulp).all()
    assert (got == want16).float().mean() > 0.95


def test_fake_quant_with_outliers_matches_reference_and_helps():
    w, mask, x, h = correlated_problem(m=40, k=320, n=128, seed=7)
    x = x.clone()
    hot = [11, 200, 301]
    x[:, hot] *= 50
    ch = select_outlier_channels((x**2).mean(0), 3)
    assert ch.tolist() == hot
    main, side = split_outliers(w, ch)
    q = rtn(main, 4, 128)
    act = activation_scheme(4, 128, 1.0, outlier_channels=ch.tolist())
    layer = FakeQuantLinear.from_quantized(q, act, outliers=side)
    got = layer(x).detach()
    xp = x.numpy()[:, side.perm]
    xmain = xp.copy()
    xmain[:, -3:] = 0
    side_ref = (xp[:, -3:], side.codes, side.scales)
    want = independent_reference(xmain, q.codes, q.scales, 4, 128, 1.0, side=side_ref)
    want16 = torch.from_numpy(want).half().float()
    assert (torch.abs(got - want16) <= torch.abs(want16) * 2.0**-10 + 2.0**-24).all()
    plain = FakeQuantLinear.from_quantized(rtn(w, 4, 128), activation_scheme(4, 128, 1.0))(x).detach()
    ref = x @ w.T
    assert ((got - ref) ** 2).sum() < 0.5 * ((plain - ref) ** 2).sum()


def test_fake_quant_w4a16_and_module_swap():
    w, _, x, _ = correlated_problem(m=24, k=256, n=16)
    q = rtn(w, 4, 128)
    layer = FakeQuantLinear.from_quantized(q, activation_scheme(16, 128), bias=torch.ones(24))
    got = layer(x.reshape(2, 8, 256)).detach().reshape(16, 24)
    want = (x.half().double() @ torch.from_numpy(q.dequantize()).double().T).half().float() + 1
    assert (torch.abs(got - want) <= torch.abs(want) * 2.0**-10 + 1e-6).all()
    model = torch.nn.Sequential(torch.nn.Linear(256, 24))
    replace_linear(model, "0", layer)
    assert model[0] is layer
    with pytest.raises(ValueError, match="outlier"):
        FakeQuantLinear.from_quantized(q, activation_scheme(16, 128), outliers=split_outliers(w, [1])[1])


# ---------------------------------------------------------------- compress pipeline


def test_compress_gptq_clip_search_records_activation_scheme(llama_with_tokenizer, tmp_path, run_cli):
    from unionsparse.compressor.artifact.store import Artifact

    model, calib = llama_with_tokenizer
    out = tmp_path / "q.zarr"
    r = run_cli("compress", model, "-o", out, "--quiet", "--prune", "wanda", "--calib", calib,
                "--nsamples", "4", "--seqlen", "64", "--quant", "w4a4", "--gptq", "--clip-search",
                "--reorder", "none")
    assert r.code == 0, r.err
    art = Artifact(out)
    for name in art.layer_names:
        rec = art.read_layer(name)
        act = rec.attrs["activations"]
        assert act["scheme"] == "per-token-symmetric" and act["bits"] == 4 and 0.6 <= act["clip"] <= 1.0
        codes = rec.encoding.decode()
        assert codes.min() >= -8 and codes.max() <= 7
        assert abs((codes == 0).mean() - 0.5) < 0.1  # Wanda 50 %, few kept weights round to 0 at 4 bits
    assert art.attrs["config"]["gptq"] is True and art.attrs["config"]["clip_search"] is True
    r = run_cli("verify", out, "--backend", "cpu")
    assert r.code == 0, r.out + r.err


def test_compress_refuses_unsupported_quant_options(llama_with_tokenizer, tmp_path, run_cli):
    model, calib = llama_with_tokenizer
    out = tmp_path / "o.zarr"
    r = run_cli("compress", model, "-o", out, "--prune", "wanda", "--calib", calib, "--keep-outliers", "16",
                "--quant", "w4a16")
    assert r.code == 2 and "--keep-outliers" in r.err and not out.exists()
    r = run_cli("compress", model, "-o", out, "--prune", "magnitude", "--gptq")
    assert r.code == 2 and "--gptq" in r.err and not out.exists()


def test_shared_act_clip_minimises_the_stacked_output_error():
    """One clip for layers reading one input: relative errors weighted by each layer's output energy."""
    from unionsparse.compressor.quantize.act_clip import shared_act_clip

    errors = [{1.0: 0.1, 0.9: 0.2}, {1.0: 0.5, 0.9: 0.1}]
    assert shared_act_clip(errors, [1.0, 3.0]) == 0.9  # (0.1 + 1.5) / 4 = 0.4 against (0.2 + 0.3) / 4
    assert shared_act_clip(errors, [10.0, 1.0]) == 1.0  # (1 + 0.5) / 11 against (2 + 0.1) / 11
    assert shared_act_clip([{1.0: 0.2, 0.9: 0.2}], [1.0]) == 1.0  # ties: the larger clip


def test_quant_mode_bits_have_one_table():
    """--quant's bits come from quantize/modes.py alone, with one "not quantized" convention (activations: 16)
    that the configuration, the per-layer spec and verify's recipe check all read."""
    import re
    from pathlib import Path

    from unionsparse.compressor.config import CompressConfig
    from unionsparse.compressor.quantize.layer import QuantSpec
    from unionsparse.compressor.quantize.modes import FP16_ACTIVATIONS, QUANT_MODES

    root = Path(__file__).resolve().parent.parent / "compressor"
    allowed = {"quantize/modes.py", "bench/e2e.py"}  # bench/e2e.py: its peer kinds, named like the modes
    literal = re.compile(r"""["']w[24]a(4|16)["']\s*:""")
    copies = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if str(p.relative_to(root)) not in allowed
              for i, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line.split("#")[0])]
    assert not copies, f"a second table of --quant modes: {copies}"
    for name, mode in QUANT_MODES.items():
        cfg = CompressConfig(model="m", output="o.zarr", quant=name)
        assert (cfg.bits, cfg.act_bits) == (mode.weight_bits, mode.act_bits)
        assert mode.quantizes_activations == (mode.act_bits != FP16_ACTIVATIONS)
        if mode.weight_bits is not None:
            spec = QuantSpec.from_mode(name)
            assert (spec.weight_bits, spec.act_bits) == (mode.weight_bits, mode.act_bits)
