"""unionsparse.kernels: CuPy RawKernel runtime kernels and their CPU references. Import the modules by name
(``kernels.iebme_spmm``, ``kernels.tiled_cbc_reference``, ...); the package itself holds only whether a GPU is
here (:func:`available`) and its SM count, and imports none of its modules."""

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


__all__ = ["H200_SMS", "available", "sm_count"]
