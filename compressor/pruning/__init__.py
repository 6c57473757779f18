"""Pruning, one function per method (True = kept): the masks ``magnitude``, ``wanda``, ``sparsegpt`` and OWL's
per-block sparsities (``methods``), one layer pruned by method name (``dispatch``: ``prune_layer``), N:M
patterns (``nm``), and the per-row selection the masks share (``row_select``)."""

from .dispatch import METHODS, prune_layer
from .methods import magnitude, outlier_ratio, owl_sparsities, sparsegpt, wanda, wanda_metric
from .nm import parse_nm

__all__ = ["METHODS", "magnitude", "outlier_ratio", "owl_sparsities", "parse_nm", "prune_layer", "sparsegpt", "wanda",
           "wanda_metric"]
