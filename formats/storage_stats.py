"""Storage statistics (docs/format.md, "Statistics"): bytes, PMR and CR of an encoding and of baselines on the
same mask.

PMR = B_w * NNZ / index bytes (B_w bytes per weight value, NNZ true nonzeros).
CR  = 2 * M * K / all bytes (against dense fp16). Bits per weight = all bytes * 8 / (M * K).
"All bytes" includes quantization scales and, for IE-BME, the per-tile row permutations when stored.
"""

from __future__ import annotations

import math

import numpy as np

from . import registry
from .bitpack import round_up


def figures(m: int, k: int, nnz: int, value_bits: int, payload: int, meta: int, scale: int) -> dict:
    total = payload + meta + scale
    bw = value_bits / 8
    return {
        "shape": [m, k],
        "nnz": int(nnz),
        "sparsity": 1.0 - nnz / (m * k) if m * k else 0.0,
        "payload_bytes": int(payload),
        "meta_bytes": int(meta),
        "scale_bytes": int(scale),
        "total_bytes": int(total),
        "bits_per_weight": total * 8 / (m * k) if m * k else 0.0,
        "pmr": (bw * nnz / meta) if meta else math.inf,
        "cr": (2 * m * k / total) if total else math.inf,
    }


def scale_bytes(m: int, k: int, group_size: int | None) -> int:
    """fp16 scales [M, ceil(K/g)]; None means unquantized fp16 values (no scales)."""
    return 0 if group_size is None else 2 * m * (-(-k // group_size))


def stats(enc: registry.Matrix, group_size: int | None = None) -> dict:
    """Figures of an encoded matrix (its format's ``statistics``): nnz, payload/meta/scale bytes, pmr, cr,
    bits_per_weight, ... ``group_size`` adds the fp16 scale bytes of a quantized matrix (None: no scales counted
    for fp16 values; 128 is assumed for b-bit codes when not given)."""
    return registry.of(enc).stats(enc, group_size)


def tca_bme_formula(m: int, k: int, nnz: int, value_bytes: float = 2) -> int:
    """SpInfer's seed formula on unpadded fp16: 4(NGT+1) + 8*NBT + 2*NNZ (GroupTile 64x64, BitmapTile 8x8).

    ``value_bytes`` replaces the 2 bytes of an fp16 value for b-bit codes (scales not included).
    """
    ngt = (m / 64) * (k / 64)
    nbt = m * k / 64
    return int(round(4 * (ngt + 1) + 8 * nbt + value_bytes * nnz))


def tiled_cbc_formula(m: int, k: int, nnz: int, tile: tuple[int, int] = (256, 16), value_bytes: float = 2) -> int:
    """SPDP's seed formula on unpadded fp16: 4(NGT+1) + 4*NGT*TILE_K + 8*(M*K/64) + 2*NNZ."""
    ngt = (m / tile[0]) * (k / tile[1])
    return int(round(4 * (ngt + 1) + 4 * ngt * tile[1] + 8 * (m * k / 64) + value_bytes * nnz))


def baselines(mask: np.ndarray, value_bits: int, group_size: int | None) -> dict[str, dict]:
    """Bytes of the comparison formats on the same nonzero mask, with the same value width and scales.

    - dense-fp16: 2*M*K. dense-b: M*K*b/8 + scales (b = value_bits).
    - csr: values + int32 column index per nonzero + int32 row pointer [M+1].
    - tiled-csl (Flash-LLM): 64x64 tiles; values + uint16 in-tile location per nonzero + int32 tile
      offsets [NT+1]; each tile's run padded to 16 bytes.
    - tca-bme (SpInfer): GroupTile 64x64, BitmapTile 8x8: int32 GroupTile offsets [NGT+1], one uint64
      per BitmapTile, values padded per GroupTile to 16 bytes. ``formula_bytes`` is the paper's
      unpadded fp16 figure, ``total_bytes`` the real one (padding to 64x64 included).
    """
    mask = np.asarray(mask, dtype=bool)
    m, k = mask.shape
    nnz = int(mask.sum())
    bw = value_bits / 8
    sb = scale_bytes(m, k, group_size)
    vb = int(math.ceil(nnz * bw))
    out: dict[str, dict] = {}
    out["dense-fp16"] = figures(m, k, nnz, 16, 2 * m * k, 0, 0)
    out[f"dense-{value_bits}bit"] = figures(m, k, nnz, value_bits, int(math.ceil(m * k * bw)), 0, sb)
    out["csr"] = figures(m, k, nnz, value_bits, vb, 4 * nnz + 4 * (m + 1), sb)

    mp, kp = int(round_up(m, 64)), int(round_up(k, 64))
    padded = np.zeros((mp, kp), dtype=bool)
    padded[:m, :k] = mask
    per_tile = padded.reshape(mp // 64, 64, kp // 64, 64).sum(axis=(1, 3)).ravel()
    ntiles = per_tile.size
    align = int(128 // value_bits)
    tile_vals = int(round_up(per_tile, align).sum())
    out["tiled-csl"] = figures(m, k, nnz, value_bits, int(tile_vals * bw), 2 * nnz + 4 * (ntiles + 1), sb)
    tca = figures(m, k, nnz, value_bits, int(tile_vals * bw), 4 * (ntiles + 1) + 8 * (mp * kp // 64), sb)
    tca["formula_bytes"] = tca_bme_formula(m, k, nnz, bw)
    out["tca-bme"] = tca
    return out
