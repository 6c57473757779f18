"""The one CuPy module loader of every kernel: NVRTC compiles a ``kernels/*.cu`` source (or a variant of it)
into a ``cupy.RawModule`` for the current device, once per process and source.

CuPy is imported lazily, so every kernel module (and the CPU references) imports on machines without a GPU;
:func:`require_cupy` raises one :class:`~.errors.KernelError` where the kernels cannot run.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from . import study
from .errors import KernelError

KERNEL_DIR = Path(__file__).resolve().parent  # the .cu sources and fp16.cuh


def cupy_or_none():
    """The cupy module if it imports and sees a CUDA device, else None."""
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        return cp
    except Exception:  # no cupy, no driver, no device
        return None


def require_cupy():
    """The cupy module; :class:`KernelError` without CuPy or a CUDA device."""
    cp = cupy_or_none()
    if cp is None:
        raise KernelError("the GPU kernels need CuPy and a CUDA device (pip install 'unionsparse[gpu]')")
    return cp


@cache
def compile_source(code: str, options: tuple[str, ...] = (), expressions: tuple[str, ...] = ()):
    """``code`` compiled with NVRTC (C++17, ``kernels/`` on the include path for ``fp16.cuh``) plus ``options``,
    with the template instances ``expressions`` named; cached per process."""
    cp = require_cupy()
    return cp.RawModule(code=code, options=("-std=c++17", f"-I{KERNEL_DIR}", *options),
                        name_expressions=list(expressions) or None)


def load_module(name: str, expressions: tuple[str, ...] = (), source: str = "", options: tuple[str, ...] = ()):
    """``kernels/<name>.cu`` compiled for the current device by :func:`compile_source`, as the study build in
    force for ``name`` has it (``kernels/study.py``: the shipped file and options unless a study set another
    revision or macros); ``source``: another revision of the file for this call."""
    build = study.build(name)
    path = source or build.source or KERNEL_DIR / f"{name}.cu"
    return compile_source(Path(path).read_text(), (*options, *build.options()), tuple(expressions))
