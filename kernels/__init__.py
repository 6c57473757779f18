"""unionsparse.kernels: CuPy RawKernel runtime kernels and their CPU references."""

from __future__ import annotations

import sys
from functools import cache
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path


def _yield_top_level_name() -> None:
    """Imported as the top-level ``kernels`` (Python run with the checkout's root on ``sys.path``: ``python -m``
    or ``python -c`` from it), this folder would shadow an installed package of that name, such as Hugging
    Face's ``kernels``, which transformers >= 5.25 requires and imports. Load that package instead and leave it
    in ``sys.modules``, which the running import then returns; with none installed, stay as we are."""
    root = Path(__file__).resolve().parent.parent
    path = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return
    real = module_from_spec(spec)
    sys.modules["kernels"] = real
    try:
        spec.loader.exec_module(real)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _yield_top_level_name()


@cache
def available() -> bool:
    """True when CuPy imports and a CUDA device is present."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError, missing driver
        return False


gpu_available = available

H200_SMS = 132  # the benchmark machine's SM count: what the launch rules use where no GPU is visible


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (the kernels' launch rules size grids by it);
    H200_SMS without a GPU, so that the rules can be checked on any machine. No driver call after the first
    per device (launches may be captured into CUDA graphs)."""
    if not available():
        return H200_SMS
    import cupy

    return _device_sm_count(cupy.cuda.Device().id)


@cache
def _device_sm_count(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


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


__all__ = ["H200_SMS", "available", "check_iebme_layer", "gpu_available", "iebme_partial_sums",
           "iebme_spmm_reference", "prepare_layer", "quantize_activations", "sm_count", "spmm_iebme"]
