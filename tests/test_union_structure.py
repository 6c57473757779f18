"""--structure union: masks that prune IE-BME union positions whole, so the stored bytes follow the sparsity."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_runtime import source  # noqa: F401  (module fixture)
from unionsparse.compressor.config import CompressConfig
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.pruning import methods as pruning
from unionsparse.compressor.pruning.dispatch import prune_layer
from unionsparse.compressor.pruning.union import union_mask
from unionsparse.formats import iebme

TILE, AREAS = (16, 64), (2, 2)


def _encoded(mask: torch.Tensor, seed: int = 0) -> iebme.IEBMEMatrix:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 8, mask.shape, generator=g, dtype=torch.int8) * mask
    return iebme.encode(codes.numpy(), bits=4, tile=TILE, areas=AREAS)


def _brute_force(metric: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The definition, one row set and one union position at a time (independent of the reshapes)."""
    m, k = metric.shape
    h, w = TILE[0] // AREAS[0], TILE[1] // AREAS[1]
    keep = torch.ones(m, k, dtype=torch.bool)
    for r0, i in itertools.product(range(0, m, TILE[0]), range(h)):
        rows = [r0 + a * h + i for a in range(AREAS[0]) if r0 + a * h + i < m]
        if not rows:
            continue
        groups = []  # (summed metric, tile column, j, columns)
        for c0, j in itertools.product(range(0, k, TILE[1]), range(w)):
            cols = [c0 + b * w + j for b in range(AREAS[1])]
            real = [c for c in cols if c < k]
            total = float("inf") if len(real) < len(cols) else sum(float(metric[r, c]) for r in rows for c in real)
            groups.append((total, c0, j, real))
        for _, _, _, cols in sorted(groups, key=lambda t: (t[0], t[1], t[2]))[: int(k * sparsity) // AREAS[1]]:
            for r in rows:
                keep[r, cols] = False
    return keep


@pytest.mark.parametrize("shape", [(32, 128), (40, 200), (16, 64)])
@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_union_mask_is_its_definition_and_every_row_keeps_the_same_count(shape, sparsity):
    metric = torch.rand(shape, generator=torch.Generator().manual_seed(shape[1]))
    got = union_mask(metric, sparsity, TILE, AREAS)
    assert torch.equal(got, _brute_force(metric, sparsity))
    if shape[1] % TILE[1] == 0:
        assert (got.sum(1) == shape[1] - int(shape[1] * sparsity) // AREAS[1] * AREAS[1]).all()


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_the_union_holds_one_minus_sparsity_of_the_positions(sparsity):
    """What the structure is for: an unstructured mask's union covers almost every position (1 - s^4), a union
    mask's exactly 1 - s, and the stored bits follow."""
    metric = torch.rand(256, 1024, generator=torch.Generator().manual_seed(1))
    union = iebme.statistics(_encoded(union_mask(metric, sparsity, TILE, AREAS)))
    plain = iebme.statistics(_encoded(pruning.magnitude(metric, sparsity)))
    assert union["union_density"] == pytest.approx(1 - sparsity, abs=2 / 1024)
    assert plain["union_density"] > 1 - sparsity**4 - 0.02
    assert union["bits_per_weight"] < plain["bits_per_weight"] * (0.62 if sparsity == 0.5 else 0.55)


@pytest.mark.parametrize("density", [0.6, 0.7, 1.0])
def test_a_relaxed_union_keeps_that_many_positions_and_each_row_its_best_weights_there(density):
    """--union-density: the union holds ``density`` of the positions (the strict mask's choice, widened), and each
    row keeps its K/2 highest metrics among them."""
    metric = torch.rand(64, 256, generator=torch.Generator().manual_seed(4))
    got = union_mask(metric, 0.5, TILE, AREAS, density)
    allowed = _brute_force(metric, 1 - density)
    assert (got.sum(1) == 128).all() and not (got & ~allowed).any()
    for r in range(64):  # the kept are the row's top metrics among the allowed columns
        inside = metric[r][allowed[r]]
        assert metric[r][got[r]].min() >= inside.sort(descending=True).values[127]
    stored = iebme.statistics(_encoded(got))["union_density"]
    assert stored <= density + AREAS[1] / 256 and (density == 1.0 or stored > density - 0.05)  # whole groups
    assert torch.equal(union_mask(metric, 0.5, TILE, AREAS, 0.5), union_mask(metric, 0.5, TILE, AREAS))


def test_wanda_and_magnitude_take_the_structure_and_sparsegpt_refuses_it():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(32, 128, generator=g)
    x_sq_norm = torch.rand(128, generator=g) * 10
    want = union_mask(W.abs() * x_sq_norm.sqrt(), 0.5, TILE, AREAS)
    assert torch.equal(pruning.wanda(W, x_sq_norm, 0.5, union=(TILE, AREAS)), want)
    assert not torch.equal(want, union_mask(W.abs(), 0.5, TILE, AREAS))  # the metric matters
    w, mask = prune_layer("magnitude", W, 0.5, union=(TILE, AREAS))
    assert torch.equal(mask, union_mask(W.abs(), 0.5, TILE, AREAS)) and torch.equal(w, W * mask)
    with pytest.raises(UserError, match="magnitude or wanda"):
        prune_layer("sparsegpt", W, 0.5, None, None, union=(TILE, AREAS))
    with pytest.raises(UserError, match="exclusive"):
        pruning.magnitude(W, 0.5, nm="2:4", union=(TILE, AREAS))


def test_the_mask_follows_the_tile_and_areas_it_is_given():
    metric = torch.rand(32, 128, generator=torch.Generator().manual_seed(3))
    for tile, areas in (((16, 64), (2, 2)), ((32, 64), (4, 1)), ((16, 128), (1, 4))):
        mask = union_mask(metric, 0.5, tile, areas)
        enc = iebme.encode((mask.to(torch.int8) * 3).numpy(), bits=4, tile=tile, areas=areas)
        assert iebme.statistics(enc)["union_density"] == pytest.approx(0.5)


@pytest.mark.parametrize("extra, message", [
    (["--format", "tiled-cbc", "--quant", "none"], "no union bitmap"),
    (["--prune", "sparsegpt"], "magnitude or wanda"),
    (["--nm", "2:4"], "exclusive"),
    (["--quant", "w4a4"], "--keep-outliers 0"),
    (["--union-density", "0.4"], "must lie in"),
    (["--structure", "unstructured", "--union-density", "0.7"], "needs --structure union"),
])
def test_config_refuses_what_the_structure_cannot_be(extra, message):
    opts = {"prune": "wanda", "quant": "w4a16", "structure": "union"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        key = flag.removeprefix("--").replace("-", "_")
        opts[key] = float(value) if key == "union_density" else value
    with pytest.raises(UserError, match=message):
        CompressConfig(model="m", output="o", **opts).validate_options()


def test_config_takes_the_structure_with_its_geometry():
    cfg = CompressConfig(model="m", output="o", prune="wanda", quant="w4a4", keep_outliers=0, structure="union",
                         tile="32x64", areas="4x1", union_density=0.7)
    cfg.validate_options()
    assert cfg.union == ((32, 64), (4, 1), 0.7)
    assert CompressConfig(model="m", output="o").union is None


def test_compress_writes_a_union_structured_artifact(source, run_cli):  # noqa: F811
    """The whole path: compress a tiny model with --structure union; every stored layer's union holds half its
    positions (an unstructured run's holds almost all), and the artifact verifies."""
    from unionsparse.compressor.artifact.store import Artifact

    dens = {}
    for structure in ("union", "unstructured"):
        out = source / f"{structure}.zarr"
        r = run_cli("compress", source / "model", "-o", out, "--quiet", "--prune", "magnitude", "--quant", "w4a16",
                    "--structure", structure)
        assert r.code == 0, r.err
        art = Artifact(out)
        dens[structure] = [iebme.statistics(art.read_layer(n).encoding)["union_density"] for n in art.layer_names]
    assert dens["union"] and all(d == pytest.approx(0.5, abs=0.02) for d in dens["union"])
    assert min(dens["unstructured"]) > 0.85
    assert run_cli("verify", source / "union.zarr").code == 0
