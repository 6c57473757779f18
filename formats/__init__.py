"""Sparse low-bit weight formats: IE-BME (UnionSparse) and Tiled-CBC (SPDP), and their statistics."""

from . import iebme, tiled_cbc
from .errors import FormatError
from .storage_stats import baselines, stats, tca_bme_formula, tiled_cbc_formula

__all__ = ["FormatError", "baselines", "iebme", "stats", "tca_bme_formula", "tiled_cbc", "tiled_cbc_formula"]
