"""unionsparse.solvers: bitmap-aware row reordering for IE-BME (exact subset DP, OR-Tools CP-SAT)."""

from .errors import SolverError
from .reorder import METHODS, ReorderReport, reorder_matrix, reorder_tile, union_cost

__all__ = ["METHODS", "SolverError", "ReorderReport", "reorder_matrix", "reorder_tile", "union_cost"]
