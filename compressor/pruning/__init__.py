"""Pruning masks, one function per method (True = kept): ``magnitude``, ``wanda``, ``sparsegpt``, and OWL's
per-block sparsities; ``methods`` holds them, ``row_select`` the per-row selection they share."""

from .methods import magnitude, outlier_ratio, owl_sparsities, parse_nm, sparsegpt, wanda, wanda_metric

__all__ = ["magnitude", "outlier_ratio", "owl_sparsities", "parse_nm", "sparsegpt", "wanda", "wanda_metric"]
