"""The grouped integer product every W4A4 / W2A4 layer computes (docs/kernels.md):

    out[n, m] += sum over groups j, in increasing j, of  (s_w[m, j] * s_x[n, j]) * P[n, m, j],
    P[n, m, j] = sum_{k in group j} q_x[n, k] * q_w[m, k]          (an integer)

with the scale product and the accumulation in float32 (each product rounded, then the add: no fused
multiply-add). The integer partial sums are taken as float32 matrix products of the codes, which is exact:
every partial sum is an integer far below 2^24 for the group sizes and bits used (the callers check the bound).
The fake-quant layers, the runtime's reference kernels and the outlier side product all call this one function.
"""

from __future__ import annotations

import torch

from .weights import n_groups


def grouped_int_matmul(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out += sum_j (s_w[:, j] * s_x[:, j]) * (q_x[:, g_j] @ q_w[:, g_j]^T), float32 [N, M], groups in order.

    ``xq`` [N, K] and ``wq`` [M, K] are codes (any dtype holding integers exactly), ``sx`` [N, G] and
    ``sw`` [M, G] scales.
    """
    n, k = xq.shape
    m = wq.shape[0]
    if out is None:
        out = torch.zeros(n, m, dtype=torch.float32, device=xq.device)
    xf, wf = xq.float(), wq.float()
    sxf, swf = sx.float(), sw.float()
    for j in range(n_groups(k, group_size)):
        a, b = j * group_size, min((j + 1) * group_size, k)
        partial = xf[:, a:b] @ wf[:, a:b].T
        out += (sxf[:, j : j + 1] * swf[:, j].unsqueeze(0)) * partial
    return out


#: float32 elements of group products a batched call holds at once (512 MB); more rows are taken in chunks
BATCHED_ELEMENTS = 1 << 27


def grouped_int_matmul_batched(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, group_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`grouped_int_matmul` with every group's product in one batched matmul and the scaled groups summed by
    one reduction, whose order is not the groups' order: equal to it up to float32 summation order. A handful of
    launches on a GPU instead of four per group (the runtime's IE-BME prompts, ``kernels/iebme_decode.py``)."""
    n, k = xq.shape
    m = wq.shape[0]
    g = n_groups(k, group_size)
    pad = g * group_size - k
    if out is None:
        out = torch.zeros(n, m, dtype=torch.float32, device=xq.device)
    wf = torch.nn.functional.pad(wq.float(), (0, pad)).view(m, g, group_size).permute(1, 2, 0)  # [G, gs, M]
    swt = sw.float().T[:, None, :]  # [G, 1, M]
    rows = max(1, BATCHED_ELEMENTS // (g * max(m, group_size)))
    for a in range(0, n, rows):
        xf = torch.nn.functional.pad(xq[a : a + rows].float(), (0, pad)).view(-1, g, group_size).transpose(0, 1)
        p = torch.bmm(xf, wf)  # [G, r, M]: exact integers
        p *= sx[a : a + rows].float().T[:, :, None] * swt  # (s_x * s_w) * P, each product rounded
        out[a : a + rows] += p.sum(0)
    return out
