"""Errors of the row-reordering solvers."""

from ..formats.errors import UnionsparseError


class SolverError(UnionsparseError):
    """A tile, area grid, permutation or solver option that the reordering cannot take."""
