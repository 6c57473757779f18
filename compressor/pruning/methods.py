"""Unstructured and N:M pruning masks: magnitude, Wanda, SparseGPT, and OWL per-block sparsities.

Every function takes one linear layer's weight ``W`` of shape ``[M, K]`` (M output rows, K input
columns) and returns a boolean mask with ``True`` = kept.  Wanda and SparseGPT follow the papers'
reference code (``locuslab/wanda`` ``lib/prune.py``, ``IST-DASLab/sparsegpt`` ``sparsegpt.py``); the
few places where this module departs from it are marked "Deviation" and listed in ``docs/pruning.md``.

Sparsity semantics:

* unstructured ``magnitude`` / ``wanda``: in every output row the ``int(K * sparsity)`` entries with
  the lowest metric are pruned (stable sort: among equal metrics the lower column index goes first);
* unstructured ``sparsegpt``: in every block of ``blocksize`` columns, the ``int(M * count * sparsity)``
  entries with the lowest ``w**2 / d**2`` over the whole block are pruned;
* ``nm=(N, M)``: in every group of M consecutive input columns of a row, the N entries with the highest
  metric are kept (so 2:4 is 50 %); ``sparsity`` is then ignored.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

from ..errors import UserError
from .nm import parse_nm
from .union import UnionGeometry, union_mask

__all__ = [
    "magnitude",
    "wanda",
    "sparsegpt",
    "outlier_ratio",
    "owl_sparsities",
]


# --------------------------------------------------------------------------------------------------
# argument checks


def _check_sparsity(sparsity: float) -> float:
    s = float(sparsity)
    if not (0.0 <= s < 1.0) or math.isnan(s):
        raise UserError(f"--sparsity must be in [0, 1), got {sparsity}")
    return s


def _check_nm(nm: Sequence[int] | str | None, k: int) -> tuple[int, int] | None:
    nm_t = parse_nm(nm)
    if nm_t is not None and k % nm_t[1] != 0:
        raise UserError(
            f"N:M pruning {nm_t[0]}:{nm_t[1]} needs the input width ({k}) to be a multiple of {nm_t[1]}"
        )
    return nm_t


# --------------------------------------------------------------------------------------------------
# mask selection from a metric


def _row_mask(metric: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Prune the ``int(K * sparsity)`` lowest entries of every row (stable sort). True = kept."""
    k_prune = int(metric.shape[1] * sparsity)
    if k_prune and metric.device.type == "cpu":  # selection instead of a full sort, same mask
        from .row_select import prune_lowest_mask

        fast = prune_lowest_mask(metric.detach().numpy(), k_prune)
        if fast is not None:
            return torch.from_numpy(fast)
    mask = torch.ones(metric.shape, dtype=torch.bool, device=metric.device)
    if k_prune:
        idx = torch.sort(metric, dim=1, stable=True)[1][:, :k_prune]
        mask.scatter_(1, idx, False)
    return mask


def _nm_mask(metric: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the N highest of every M consecutive columns of each row (stable: ties prune the lower index)."""
    rows, cols = metric.shape
    groups = metric.reshape(rows, cols // m, m)
    prune_idx = torch.sort(groups, dim=2, stable=True)[1][:, :, : m - n]
    mask = torch.ones_like(groups, dtype=torch.bool)
    mask.scatter_(2, prune_idx, False)
    return mask.reshape(rows, cols)


def _select(metric: torch.Tensor, sparsity: float, nm_t: tuple[int, int] | None, union: UnionGeometry) -> torch.Tensor:
    """The mask of ``metric``: N:M, union-structured (``union``: the IE-BME tile and areas) or per row."""
    if nm_t is not None:
        if union is not None:
            raise UserError("--nm and --structure union are exclusive")
        return _nm_mask(metric, *nm_t)
    if union is not None:
        return union_mask(metric, _check_sparsity(sparsity), *union)  # (tile, areas[, density])
    return _row_mask(metric, _check_sparsity(sparsity))


def magnitude(W: torch.Tensor, sparsity: float, nm: Sequence[int] | str | None = None,
              union: UnionGeometry = None) -> torch.Tensor:
    """Magnitude mask: per output row, prune the ``int(K*sparsity)`` smallest ``|W|`` (stable sort); with
    ``union`` (tile, areas), whole IE-BME union positions of lowest summed ``|W|`` (``union.union_mask``).

    Deviation: the Wanda repository's ``prune_magnitude`` thresholds over the whole layer; this one
    uses the same per-row comparison group as Wanda so the two differ only in the metric.
    """
    return _select(W.detach().abs().float(), sparsity, _check_nm(nm, W.shape[1]), union)


def wanda_metric(W: torch.Tensor, x_sq_norm: torch.Tensor) -> torch.Tensor:
    """``|W| * sqrt(x_sq_norm)`` broadcast over rows (float32), as the reference's ``W_metric``."""
    if x_sq_norm.shape != (W.shape[1],):
        raise UserError(f"x_sq_norm must have shape [{W.shape[1]}], got {tuple(x_sq_norm.shape)}")
    return W.detach().abs().float() * torch.sqrt(x_sq_norm.detach().float().to(W.device)).reshape(1, -1)


def wanda(
    W: torch.Tensor, x_sq_norm: torch.Tensor, sparsity: float, nm: Sequence[int] | str | None = None,
    union: UnionGeometry = None,
) -> torch.Tensor:
    """Wanda mask: per output row, prune the ``int(K*sparsity)`` lowest ``|W|·sqrt(x_sq_norm)``; with ``union``
    (tile, areas), whole IE-BME union positions of lowest summed metric (``union.union_mask``).

    ``x_sq_norm[k]`` is the mean over calibration samples of input channel k's squared L2 norm over
    the sample's tokens (``calibrate.statistics.SqNormAccumulator``, the reference's ``scaler_row``).
    """
    return _select(wanda_metric(W, x_sq_norm), sparsity, _check_nm(nm, W.shape[1]), union)


# --------------------------------------------------------------------------------------------------
# SparseGPT


@contextlib.contextmanager
def _cpu_threads(device: torch.device, n: int) -> Iterator[None]:
    """Run CPU torch ops with ``n`` intra-op threads. Measured on the 2-core dev machine (busy): with 2
    threads ``cholesky_inverse`` of a 1536x1536 H took 2.74 s against 0.037 s with 1, and a whole
    576x1536 SparseGPT layer 4.0 s against 0.26 s; the column loop's ops are too small to share."""
    if device.type != "cpu":
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(min(n, old))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def sparsegpt(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity: float,
    blocksize: int = 128,
    percdamp: float = 0.01,
    nm: Sequence[int] | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (OBS with lazy batch updates). Returns ``(W_pruned, mask)``; inputs are not modified.

    Steps as the reference ``fasterprune``: dead inputs (``diag H == 0``) get ``H[i,i]=1`` and
    ``W[:,i]=0``; add ``percdamp·mean(diag H)`` to the diagonal; ``Hinv`` = upper Cholesky factor of
    ``H⁻¹``; per block of ``blocksize`` columns choose the mask over the whole block from
    ``w²/d²`` (d = diag of the block's ``Hinv``), then prune column by column, spreading each column's
    error ``(w-q)/d`` over the block's remaining columns, and apply the block's accumulated error to
    all later columns at once. With ``nm`` the mask of each group of M columns is chosen when the loop
    reaches the group's first column (reference ``prunen``/``prunem``).

    Deviation: the reference prunes ``metric <= sorted[k]`` (k+1 entries, more on ties); this prunes
    exactly the k = ``int(rows·count·sparsity)`` lowest (stable sort), so the sparsity is exact.
    ``W_pruned`` has ``W``'s dtype; the arithmetic runs in ``dtype`` (float32, float64 for tests).
    """
    rows, cols = W.shape
    if H.shape != (cols, cols):
        raise UserError(f"H must be [{cols}, {cols}], got {tuple(H.shape)}")
    nm_t = _check_nm(nm, cols)
    if nm_t is not None and blocksize % nm_t[1] != 0:
        raise UserError(f"blocksize {blocksize} must be a multiple of M={nm_t[1]}")
    s = _check_sparsity(sparsity) if nm_t is None else 0.0

    Wf = W.detach().to(dtype).clone()
    Hf = H.detach().to(device=Wf.device, dtype=dtype).clone()
    dead = torch.diag(Hf) == 0
    Hf[dead, dead] = 1
    Wf[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(Hf))
    diag = torch.arange(cols, device=Hf.device)
    Hf[diag, diag] += damp
    pruned = torch.zeros(rows, cols, dtype=torch.bool, device=Wf.device)  # True = pruned
    with _cpu_threads(Wf.device, 1):
        try:
            L = torch.linalg.cholesky(Hf)
            Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        except torch.linalg.LinAlgError as exc:
            raise UserError(
                f"SparseGPT: the damped Hessian is not positive definite (percdamp={percdamp}); "
                "raise percdamp or use more calibration samples"
            ) from exc
        _obs_blocks(Wf, Hinv, pruned, s, blocksize, nm_t)
    mask = ~pruned
    Wf[pruned] = 0  # exact zeros (Q1 already holds them)
    return Wf.to(W.dtype), mask


def _obs_blocks(
    Wf: torch.Tensor,
    Hinv: torch.Tensor,
    pruned: torch.Tensor,
    s: float,
    blocksize: int,
    nm_t: tuple[int, int] | None,
) -> None:
    """The SparseGPT block / column loop, in place on ``Wf`` and ``pruned``."""
    cols = Wf.shape[1]
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        count = i2 - i1
        W1 = Wf[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d1 = torch.diag(Hinv1)
        mask1 = torch.zeros_like(W1, dtype=torch.bool)
        if nm_t is None:
            k_prune = int(W1.numel() * s)
            if k_prune:
                metric = (W1**2 / d1.reshape(1, -1) ** 2).flatten()
                mask1.view(-1)[torch.sort(metric, stable=True)[1][:k_prune]] = True
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if nm_t is not None and i % nm_t[1] == 0:
                n, m = nm_t
                metric = W1[:, i : i + m] ** 2 / d1[i : i + m].reshape(1, -1) ** 2
                idx = torch.sort(metric, dim=1, stable=True)[1][:, : m - n]
                mask1.scatter_(1, i + idx, True)
            q = w.clone()
            q[mask1[:, i]] = 0
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err1
        Wf[:, i1:i2] = Q1
        pruned[:, i1:i2] = mask1
        Wf[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]


# --------------------------------------------------------------------------------------------------
# OWL: outlier-weighted layer-wise sparsity


def outlier_ratio(metrics: Sequence[torch.Tensor], m: float = 5.0) -> float:
    """Fraction of entries of the block's Wanda metrics that exceed ``m`` times their mean.

    The block's metrics (all its linear layers) are pooled, as OWL's ``check_outlier_mean`` on the
    concatenated ``|W|·sqrt(x_sq_norm)`` and llm-compressor's OWL do.
    """
    total = sum(float(t.double().sum()) for t in metrics)
    numel = sum(t.numel() for t in metrics)
    if numel == 0:
        raise UserError("outlier_ratio: no metric entries")
    thresh = m * total / numel
    count = sum(int((t > thresh).sum()) for t in metrics)
    return count / numel


def owl_sparsities(outlier_ratios: Sequence[float], target: float, lam: float = 0.08) -> list[float]:
    """OWL per-block sparsities with mean ``target``: more outliers -> lower sparsity.

    With ratios r: ``n_i = (r_i - min r) / (max r - min r) · 2λ`` (into [0, 2λ]), density
    ``d_i = n_i - mean(n) + (1 - target)``, sparsity ``s_i = 1 - d_i``. So mean(s) = target exactly and
    max(s) - min(s) = 2λ; every ``s_i`` lies in [target - 2λ, target + 2λ] (within ±λ when the ratios
    are spread symmetrically). Equal ratios give ``target`` everywhere.
    """
    target = _check_sparsity(target)
    if lam < 0:
        raise UserError(f"OWL lambda must be >= 0, got {lam}")
    r = torch.tensor([float(x) for x in outlier_ratios], dtype=torch.float64)
    if r.numel() == 0:
        return []
    span = float(r.max() - r.min())
    if span == 0.0 or lam == 0.0:
        return [target] * r.numel()
    n = (r - r.min()) / span * (2 * lam)
    density = n - n.mean() + (1 - target)
    out = [float(1 - d) for d in density]
    bad = [x for x in out if not (0.0 <= x < 1.0)]
    if bad:
        raise UserError(f"OWL sparsities leave [0, 1) for target {target} and lambda {lam}; lower lambda")
    return out
