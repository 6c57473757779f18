"""Sparse low-bit weight formats: IE-BME (UnionSparse) and Tiled-CBC (SPDP), and their statistics."""

from . import iebme, tiled_cbc
from .errors import FormatError

__all__ = ["FormatError", "iebme", "tiled_cbc"]
