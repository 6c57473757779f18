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
