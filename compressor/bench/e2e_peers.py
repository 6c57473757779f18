"""The linear kinds `unionsparse bench --e2e` puts in a model's decoder blocks, each in the same step code.

Every kind maps ``[..., K] -> [..., M]`` and is built per block group (Q/K/V stacked, O, gate/up stacked,
down; ``e2e_models.ModelSpec.groups``):

* ``fp16``: ``nn.Linear`` in float16 (cuBLAS on a GPU);
* ``w4a16``: dense int4 weights, fp16 scales and zeros per group of 128, ``torch._weight_int4pack_mm``
  (torchao's int4 weight-only kernel, tinygemm; float16 activations where this torch's kernel takes them,
  else bfloat16 with the input cast to bf16 and the output back, two more kernels per product, timed and
  reported as ``casts``); the CPU runs ``torch._weight_int4pack_mm_for_cpu`` on the same codes;
* ``iebme-w4a4-50`` / ``iebme-w4a4-0`` (and 70 / 90, ``iebme-w2a4-50-o128``, ``iebme-w4a8-50`` / ``-0`` with
  8-bit activations): the runtime's
  ``CompressedLinear`` (what ``runtime.load`` builds) on a synthetic layer record of random nonzero codes under
  a uniformly random 50% (0%: the dense control) mask, group 128, tile 16x64, no row reordering, and the
  per-token activation record ``compress`` writes; ``-o128``: with 128 outlier channels (at most K / 4) in an
  8-bit side matrix, the configuration that keeps quality; ``-dp``: rows reordered per tile by the exact DP
  (``--reorder dp``: fewer union positions, a permutation per tile);
* ``tcbc-fp16-30+30`` (and ``-50+30``, ``tcbc-int4-50+30`` / ``-50+50`` with 4-bit codes): ``CompressedLinear``
  on random values with that share of zeros (static) and a stored threshold tau at which that share of the
  layer's decode inputs is inactive (dynamic; the spMspV kernel at N = 1).

Encoding a 7B block on the CPU takes seconds, all 32 blocks minutes: a kind encodes ONE record per group and
builds every block's module from it (each an upload of its own, so no block reads another's weights from L2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from ...formats import iebme, tiled_cbc
from ...formats.arithmetic.activations import activation_scheme
from ...formats.arithmetic.outlier_side import OutlierSide, column_permutation
from ...formats.arithmetic.weights import rtn
from ...solvers.reorder import reorder_matrix
from ..artifact.store import LayerRecord
from ..errors import UserError
from ..pruning.union import union_mask

GROUP_SIZE = 128
INNER_K_TILES = 8


@dataclass(frozen=True)
class Kind:
    """A linear kind of the benchmark."""

    name: str
    label: str
    sparsity: float = 0.0            # static (weights)
    dynamic: float = 0.0             # dynamic (activations at decode, N = 1)
    runtime: bool = False            # built through the runtime's CompressedLinear
    bits: int | None = None          # weight code bits (IE-BME: 4 unless said; Tiled-CBC: fp16 values if None)
    outliers: int = 0                # IE-BME: input channels kept at 8 bits (Atom), min(this, K // 4) a layer
    act_bits: int = 4                # IE-BME: bits of the per-token activation codes (4 or 8; 16: float16)
    reorder: bool = False            # IE-BME: rows reordered per tile by the exact DP (--reorder dp)
    union: bool = False              # IE-BME: a union-structured mask (--structure union), else uniformly random

    def as_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "sparsity": self.sparsity, "dynamic_sparsity": self.dynamic,
                "through_runtime": self.runtime}


KINDS = {k.name: k for k in (
    Kind("fp16", "dense fp16 (nn.Linear, cuBLAS)"),
    Kind("w4a16", "dense W4A16 (torch._weight_int4pack_mm, tinygemm)"),
    Kind("iebme-w4a4-50", "IE-BME W4A4, 50% sparse (runtime CompressedLinear)", sparsity=0.5, runtime=True),
    Kind("iebme-w4a4-0", "IE-BME W4A4, 0% sparse: the control (runtime CompressedLinear)", runtime=True),
    Kind("iebme-w4a4-50-o128", "IE-BME W4A4, 50% sparse, 128 outlier channels: the configuration that keeps "
         "quality (runtime CompressedLinear)", sparsity=0.5, runtime=True, outliers=128),
    Kind("iebme-w4a4-0-o128", "IE-BME W4A4, 0% sparse, 128 outlier channels: the control", runtime=True,
         outliers=128),
    Kind("iebme-w4a4-50-o128-dp", "IE-BME W4A4, 50% sparse, 128 outlier channels, rows reordered per tile by the "
         "exact DP as --reorder dp does (runtime CompressedLinear)", sparsity=0.5, runtime=True, outliers=128,
         reorder=True),
    Kind("iebme-w4a8-50", "IE-BME W4A8, 50% sparse, no outlier channels: keeps quality with 4-bit weights "
         "(runtime CompressedLinear)", sparsity=0.5, runtime=True, act_bits=8),
    Kind("iebme-w4a8-0", "IE-BME W4A8, 0% sparse: the control (runtime CompressedLinear)", runtime=True, act_bits=8),
    Kind("iebme-w4a16-50", "IE-BME W4A16, 50% sparse, float16 activations: no activation quantization (runtime "
         "CompressedLinear)", sparsity=0.5, runtime=True, act_bits=16),
    Kind("iebme-w4a16-0", "IE-BME W4A16, 0% sparse: the control (runtime CompressedLinear)", runtime=True,
         act_bits=16),
    Kind("iebme-w4a16-50u", "IE-BME W4A16, 50% union-structured (--structure union: the union bitmap holds half "
         "the positions) (runtime CompressedLinear)", sparsity=0.5, runtime=True, act_bits=16, union=True),
    Kind("iebme-w4a16-70u", "IE-BME W4A16, 70% union-structured (runtime CompressedLinear)", sparsity=0.7,
         runtime=True, act_bits=16, union=True),
    Kind("iebme-w4a16-90u", "IE-BME W4A16, 90% union-structured (runtime CompressedLinear)", sparsity=0.9,
         runtime=True, act_bits=16, union=True),
    Kind("iebme-w4a8-50u", "IE-BME W4A8, 50% union-structured, no outlier channels (runtime CompressedLinear)",
         sparsity=0.5, runtime=True, act_bits=8, union=True),
    Kind("iebme-w4a4-70", "IE-BME W4A4, 70% sparse (runtime CompressedLinear)", sparsity=0.7, runtime=True),
    Kind("iebme-w4a4-90", "IE-BME W4A4, 90% sparse (runtime CompressedLinear)", sparsity=0.9, runtime=True),
    Kind("iebme-w2a4-50-o128", "IE-BME W2A4, 50% sparse, 128 outlier channels (runtime CompressedLinear)",
         sparsity=0.5, runtime=True, bits=2, outliers=128),
    Kind("tcbc-fp16-30+30", "Tiled-CBC fp16, 30% static + 30% dynamic (runtime CompressedLinear)", sparsity=0.3,
         dynamic=0.3, runtime=True),
    Kind("tcbc-fp16-50+30", "Tiled-CBC fp16, 50% static + 30% dynamic (runtime CompressedLinear)", sparsity=0.5,
         dynamic=0.3, runtime=True),
    Kind("tcbc-int4-50+30", "Tiled-CBC int4 (W4A16), 50% static + 30% dynamic (runtime CompressedLinear)",
         sparsity=0.5, dynamic=0.3, runtime=True, bits=4),
    Kind("tcbc-int4-50+50", "Tiled-CBC int4 (W4A16), 50% static + 50% dynamic (runtime CompressedLinear)",
         sparsity=0.5, dynamic=0.5, runtime=True, bits=4),
)}
BASELINES = ("fp16", "w4a16")
CONTROLS = {"iebme-w4a4-50": "iebme-w4a4-0", "iebme-w4a4-70": "iebme-w4a4-0", "iebme-w4a4-90": "iebme-w4a4-0",
            "iebme-w4a4-50-o128": "iebme-w4a4-0-o128", "iebme-w4a4-50-o128-dp": "iebme-w4a4-0-o128",
            "iebme-w4a8-50": "iebme-w4a8-0", "iebme-w4a16-50": "iebme-w4a16-0", "iebme-w4a16-50u": "iebme-w4a16-0",
            "iebme-w4a16-70u": "iebme-w4a16-0", "iebme-w4a16-90u": "iebme-w4a16-0",
            "iebme-w4a8-50u": "iebme-w4a8-0"}  # kind -> its 0%-sparsity control
DEFAULT_KINDS = ("fp16", "w4a16", "iebme-w4a4-50-o128", "iebme-w4a4-0-o128", "iebme-w4a8-50", "iebme-w4a8-0",
                 "iebme-w4a4-50", "iebme-w4a4-0", "tcbc-fp16-30+30")  # what a run times unless --kinds says otherwise


# ---------------------------------------------------------------------------------------------------- fp16


class HalfLinear(nn.Linear):
    """A float16 ``nn.Linear`` whose input and output take the caller's dtype (no conversion on a float16 model,
    so on a GPU it is cuBLAS alone; a float32 model on the CPU gets float16 arithmetic all the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    @classmethod
    def of(cls, weight: torch.Tensor) -> HalfLinear:
        """The layer of weight [m, k] (copied, in float16, on the weight's device)."""
        m, k = weight.shape
        lin = cls(k, m, bias=False, device=weight.device, dtype=torch.float16)
        with torch.no_grad():
            lin.weight.copy_(weight)
        return lin.requires_grad_(False)


def fp16_linear(m: int, k: int, device, gen: torch.Generator | None = None) -> HalfLinear:
    """A bias-free float16 linear [m, k] with N(0, 0.02²) weights made on ``device``."""
    lin = HalfLinear(k, m, bias=False, device=device, dtype=torch.float16)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.02, generator=gen)
    return lin.requires_grad_(False)


# --------------------------------------------------------------------------------------------------- W4A16


class W4A16Linear(nn.Module):
    """Dense int4 weight-only linear through ``torch._weight_int4pack_mm`` (CUDA, tinygemm) or
    ``torch._weight_int4pack_mm_for_cpu``: ``W[m, k] = (q[m, k] - 8) * scale[g, m] + zero[g, m]``, q in 0..15,
    groups of ``group_size`` inputs. Activations run in float16 where the CUDA kernel takes them, else in bfloat16
    (converted around each product; ``casts``)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE,
                 inner_k_tiles: int = INNER_K_TILES) -> None:
        super().__init__()
        m, k = q.shape
        self.out_features, self.in_features = int(m), int(k)
        check_w4a16_shape(m, k, group_size, inner_k_tiles)
        self.group_size = int(group_size)
        q32 = q.to(torch.int32).contiguous()
        if q32.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, inner_k_tiles)
        else:  # even input in the high nibble (torchao's packing)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                ((q32[:, ::2] << 4) | q32[:, 1::2]).to(torch.uint8).contiguous(), inner_k_tiles)
        self.register_buffer("packed", packed)
        sz = torch.stack([scales, zeros], dim=-1).contiguous()  # [G, m, 2]
        self.dtype = self._native_dtype(packed, sz, k)
        self.register_buffer("scales_and_zeros", sz.to(self.dtype).contiguous())

    def _native_dtype(self, packed: torch.Tensor, sz: torch.Tensor, k: int) -> torch.dtype:
        """float16 where the kernel takes it (no casts around the product), else bfloat16 (``casts``: the
        fp16 model's input and output are converted around every product, two more kernels, timed)."""
        if packed.device.type == "cuda":
            try:
                x = torch.zeros(1, k, device=packed.device, dtype=torch.float16)
                torch.ops.aten._weight_int4pack_mm(x, packed, self.group_size, sz.half())
                return torch.float16
            except RuntimeError:
                pass
        return torch.bfloat16

    @property
    def casts(self) -> bool:
        """True when every product converts its float16 input to bfloat16 and back."""
        return self.dtype != torch.float16

    @classmethod
    def random(cls, m: int, k: int, device, gen: torch.Generator | None = None, **kw) -> W4A16Linear:
        """Random codes, scales and zeros made on ``device``."""
        g = -(-k // kw.get("group_size", GROUP_SIZE))
        q = torch.randint(0, 16, (m, k), device=device, dtype=torch.int32, generator=gen)
        scales = torch.rand(g, m, device=device, generator=gen) * 0.004 + 0.002
        zeros = (torch.rand(g, m, device=device, generator=gen) - 0.5) * 0.002
        return cls(q, scales, zeros, **kw)

    @classmethod
    def from_weight(cls, w: torch.Tensor, **kw) -> W4A16Linear:
        """Round-to-nearest asymmetric int4 of weight ``w`` [m, k] per group (min and max on the grid's ends)."""
        gs = kw.get("group_size", GROUP_SIZE)
        m, k = w.shape
        wg = w.float().reshape(m, k // gs, gs)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = lo + 8 * scales  # w = (q - 8) * s + zero: q = 0 at lo, 15 at hi
        q = torch.clamp(torch.round((wg - lo[..., None]) / scales[..., None]), 0, 15).reshape(m, k)
        return cls(q.to(torch.int32), scales.t().contiguous(), zeros.t().contiguous(), **kw)

    def weight_bytes(self) -> int:
        return self.out_features * self.in_features // 2 + self.scales_and_zeros.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        if self.packed.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"


def check_w4a16_shape(m: int, k: int, group_size: int = GROUP_SIZE, inner_k_tiles: int = INNER_K_TILES) -> None:
    if m % 8 or k % (inner_k_tiles * 16) or k % group_size or group_size not in (32, 64, 128, 256):
        raise UserError(f"W4A16 (tinygemm) needs M % 8 == 0, K % {inner_k_tiles * 16} == 0 and K % group == 0, "
                         f"group in 32/64/128/256; got M={m}, K={k}, group {group_size}")


def w4a16_dequantized(lin: W4A16Linear, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [m, k] weight the kernel computes with: (q - 8) * scale + zero, scales and zeros as stored."""
    sz = lin.scales_and_zeros.float()
    s = sz[..., 0].t().repeat_interleave(lin.group_size, dim=1)
    z = sz[..., 1].t().repeat_interleave(lin.group_size, dim=1)
    return (q.float() - 8.0) * s.to(q.device) + z.to(q.device)


# -------------------------------------------------------------------------------------------- IE-BME, Tiled-CBC


def random_codes(m: int, k: int, sparsity: float, rng: np.random.Generator, bits: int = 4,
                 union: bool = False) -> np.ndarray:
    """Nonzero signed ``bits``-bit codes (int8 [m, k]) under a uniformly random mask at ``sparsity``, or with
    ``union`` the union-structured mask (``pruning.union``, tile 16x64, areas 2x2) of a random metric."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi, size=(m, k), dtype=np.int8)  # lo .. hi-1, then nonnegative ones shifted up: nonzero
    q += (q >= 0).astype(np.int8)
    if sparsity > 0 and union:
        metric = torch.from_numpy(rng.random((m, k), dtype=np.float32))
        q[~union_mask(metric, sparsity, (16, 64), (2, 2)).numpy()] = 0
    elif sparsity > 0:
        q[rng.random((m, k), dtype=np.float32) < sparsity] = 0
    return q


def iebme_record(name: str, m: int, k: int, sparsity: float, rng: np.random.Generator, bits: int = 4,
                 group_size: int = GROUP_SIZE, outliers: int = 0, act_bits: int = 4,
                 reorder: bool = False, union: bool = False) -> LayerRecord:
    """A stored IE-BME W{bits}A{act_bits} layer as ``compress`` writes one (``reorder``: rows reordered per tile
    by the exact DP, else none): random codes, fp16 scales per (row, group of 128), the per-token activation
    record; with ``outliers`` (capped at K // 4, as ``--keep-outliers auto``) that many random input channels
    kept at 8 bits: the main matrix in the permuted column order with the outlier columns zero, the int8 side
    matrix and its scales; ``union``: a union-structured mask."""
    n = min(int(outliers), k // 4)
    codes = random_codes(m, k, sparsity, rng, bits, union)
    side = None
    channels = None
    if n:
        channels = np.sort(rng.choice(k, size=n, replace=False)).astype(np.int64)
        codes[:, k - n:] = 0  # the permuted order's last n columns: the outlier channels, in the side matrix
        side_codes = rng.integers(-127, 128, size=(m, n), dtype=np.int8)
        side_scales = (rng.random((m, 1), dtype=np.float32) * 0.0004 + 0.0002).astype(np.float16)
        side = OutlierSide(channels, column_permutation(k, channels), side_codes, side_scales)
    perm = reorder_matrix(codes != 0, (16, 64), (2, 2), method="dp")[0] if reorder else None
    enc = iebme.encode(codes, bits=bits, tile=(16, 64), areas=(2, 2), perm=perm)
    g = -(-k // group_size)
    scales = (rng.random((m, g), dtype=np.float32) * 0.004 + 0.002).astype(np.float16)
    attrs = {"prune": "synthetic", "quant": f"w{bits}a{act_bits}", "bits": bits, "group_size": group_size,
             "activations": activation_scheme(act_bits, group_size, outlier_channels=None if channels is None
                                              else channels.tolist())}
    return LayerRecord(name, enc, scales, attrs, side)


def sparse_fp16(m: int, k: int, sparsity: float, rng: np.random.Generator) -> np.ndarray:
    """Random N(0, 0.02²) float16 weights [m, k] with a uniformly random ``sparsity`` of zeros."""
    w = (rng.standard_normal((m, k), dtype=np.float32) * 0.02).astype(np.float16)
    if sparsity > 0:
        w[rng.random((m, k), dtype=np.float32) < sparsity] = 0
    return w


def tcbc_record(name: str, w: np.ndarray, tau: float | None = None, bits: int | None = None) -> LayerRecord:
    """A stored Tiled-CBC layer of weights ``w`` (float16 [m, k], zeros where pruned), tile 256x16, the
    threshold ``tau`` stored as ``dp_threshold``: fp16 values, or with ``bits`` the codes of symmetric
    round-to-nearest per (row, group of 128) and their fp16 scales (``--quant w4a16 --format tiled-cbc``;
    pruned weights stay zero codes)."""
    if bits is None:
        enc = tiled_cbc.encode(w, tile=tiled_cbc.DEFAULT_TILE, bits=None)
        attrs = {"prune": "synthetic", "quant": "none", "bits": None,
                 "dp_threshold": None if tau is None else float(tau)}
        return LayerRecord(name, enc, None, attrs)
    q = rtn(w.astype(np.float32), bits, GROUP_SIZE)
    enc = tiled_cbc.encode(q.codes, tile=tiled_cbc.DEFAULT_TILE, bits=bits)
    attrs = {"prune": "synthetic", "quant": f"w{bits}a16", "bits": bits, "group_size": q.group_size,
             "dp_threshold": None if tau is None else float(tau)}
    return LayerRecord(name, enc, q.scales, attrs)


def with_tau(rec: LayerRecord, tau: float | None) -> LayerRecord:
    """The same stored arrays with another ``dp_threshold``."""
    return replace(rec, attrs={**rec.attrs, "dp_threshold": None if tau is None else float(tau)})


def record_bytes(rec: LayerRecord) -> int:
    """Bytes of a stored layer's arrays (encoding, scales, side matrix): what a kernel reads at most."""
    return int(sum(np.asarray(a).nbytes for a in rec.arrays().values()))


def record_read_bytes(rec: LayerRecord, inactive: float = 0.0) -> int:
    """Bytes one product must read: every array, less the values of inactive inputs (a fraction ``inactive``
    of the columns; the spMspV kernel skips their values, not their bitmaps or column info)."""
    arrays = rec.arrays()
    total = sum(np.asarray(a).nbytes for a in arrays.values())
    if inactive > 0 and "values" in arrays:
        total -= int(np.asarray(arrays["values"]).nbytes * inactive)
    return int(total)


def normal_tau(dynamic: float) -> float:
    """The ``dynamic`` quantile of |x| for x ~ N(0, 1) (the input of a block's first linears, after RMSNorm):
    the threshold before calibration on the step's own inputs."""
    from statistics import NormalDist

    return float(NormalDist().inv_cdf(0.5 + dynamic / 2))
