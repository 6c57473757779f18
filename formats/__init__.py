"""Sparse low-bit weight formats: IE-BME (UnionSparse) and Tiled-CBC (SPDP), and their statistics."""

from . import iebme, registry, tiled_cbc
from .errors import FormatError, UnionsparseError
from .registry import Format
from .storage_stats import baselines, stats, tca_bme_formula, tiled_cbc_formula

__all__ = ["Format", "FormatError", "UnionsparseError", "baselines", "iebme", "stats", "tca_bme_formula", "registry",
           "tiled_cbc", "tiled_cbc_formula"]
