"""unionsparse.kernels: CuPy RawKernel runtime kernels and their CPU references."""

from __future__ import annotations

from functools import cache


@cache
def available() -> bool:
    """True when CuPy imports and a CUDA device is present."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError, missing driver
        return False


gpu_available = available


def __getattr__(name: str):
    # lazy: importing the package must not import numba, cupy or torch
    if name in ("iebme_spmm_reference", "iebme_partial_sums"):
        from . import iebme_reference

        return getattr(iebme_reference, name)
    if name in ("spmm_iebme", "prepare_layer"):
        from . import iebme_spmm

        return getattr(iebme_spmm, name)
    if name == "check_iebme_layer":
        from .iebme_check import check_iebme_layer

        return check_iebme_layer
    if name == "quantize_activations":
        from .activations import quantize_activations

        return quantize_activations
    raise AttributeError(f"module 'unionsparse.kernels' has no attribute {name!r}")


__all__ = ["available", "check_iebme_layer", "gpu_available", "iebme_partial_sums", "iebme_spmm_reference",
           "prepare_layer", "quantize_activations", "spmm_iebme"]
