"""Launch a CuPy-compiled kernel with launch attributes (sm_90+), by ctypes on the CUDA driver.

CuPy's ``RawKernel.__call__`` takes no launch attributes, so these launches go through ``cuLaunchKernelEx``:
thread-block clusters (``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``; the kernel needs no ``__cluster_dims__``, so
one compiled kernel serves every cluster shape and plain launches) and programmatic dependent launch. Driver
launches are captured into CUDA graphs like any other::

    launch_ex(fn, grid, block, shared_mem, args, cluster=(1, 2, 1), stream=None)
    launch_ex(fn, grid, block, shared_mem, args, cluster=None, programmatic=True)

``programmatic``: programmatic dependent launch (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``):
the kernel may start while the kernel before it on the stream still runs, and waits for it with
``griddepcontrol.wait`` (kernels/pdl.cuh). ``args`` are CuPy arrays (passed as device pointers), NumPy
scalars and ctypes objects (a tensor map: passed by value).

The decode step's kernels go through :func:`launch`: a programmatic launch where the GPU has it (sm_90+) unless
:func:`programmatic_launches` turned it off, else CuPy's own launch. Every kernel launched so starts with
``pdl_enter`` (kernels/pdl.cuh), or with ``allow_dependents`` where it loads what no kernel of the step writes before
its ``wait_for_producer`` (attention, lm_head; docs/kernels.md).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import numpy as np

from .errors import KernelError

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
MAX_PORTABLE_CLUSTER = 8      # any sm_90 GPU; up to 16 with the non-portable opt-in (H100 / H200)


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (its clusterDim x, y, z, or in
    ``x`` the int programmaticStreamSerializationAllowed)."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (CUDA 12+)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_LIB = None
_NON_PORTABLE: set[int] = set()   # functions opted in to clusters of more than 8 CTAs


def _lib():
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuFuncSetAttribute.restype = ctypes.c_int
        _LIB = lib
    return _LIB


def kernel_params(args) -> tuple[ctypes.Array, list]:
    """(void* array for kernelParams, the ctypes values it points to, to keep alive until the launch)."""
    vals: list = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):  # a CuPy array: its device pointer
            vals.append(ctypes.c_uint64(a.data.ptr))
        elif isinstance(a, np.int32):
            vals.append(ctypes.c_int32(int(a)))
        elif isinstance(a, np.int64):
            vals.append(ctypes.c_int64(int(a)))
        elif isinstance(a, np.uint64):
            vals.append(ctypes.c_uint64(int(a)))
        elif isinstance(a, np.float32):
            vals.append(ctypes.c_float(float(a)))
        elif isinstance(a, ctypes.Array | ctypes.Structure):  # a struct passed by value (its bytes)
            vals.append(a)
        else:
            raise TypeError(f"unsupported kernel argument {type(a).__name__}: pass CuPy arrays, np.int32/int64/"
                            "uint64/float32 or ctypes structs")
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
    return ptrs, vals


def launch_ex(fn, grid: tuple[int, ...], block: tuple[int], shared_mem: int, args,
              cluster: tuple[int, int, int] | None = None, programmatic: bool = False, stream=None) -> None:
    """Launch CuPy kernel ``fn`` by ``cuLaunchKernelEx`` with the attributes asked for (clusters, programmatic
    dependent launch), on ``stream`` (or CuPy's current stream)."""
    import cupy as cp

    fptr = getattr(fn, "kernel", fn).ptr  # CuPy RawKernel -> its cuda.Function (the CUfunction)
    grid = (*grid, 1, 1)[:3]
    attrs = []
    if cluster is not None:
        if any(g % c for g, c in zip(grid, cluster, strict=True)):
            raise KernelError(f"cluster {cluster} must divide the grid {grid}")
        size = cluster[0] * cluster[1] * cluster[2]
        if size > MAX_PORTABLE_CLUSTER and fptr not in _NON_PORTABLE:
            attr = CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            status = _lib().cuFuncSetAttribute(ctypes.c_void_p(fptr), attr, 1)
            if status != 0:
                raise KernelError(f"clusters of {size} CTAs are not allowed here (CUDA driver error {status})")
            _NON_PORTABLE.add(fptr)
        attrs.append(LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, x=cluster[0], y=cluster[1],
                                     z=cluster[2]))
    if programmatic:
        attrs.append(LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, x=1))
    s = stream if stream is not None else cp.cuda.get_current_stream()
    arr = (LaunchAttribute * max(1, len(attrs)))(*attrs)
    cfg = LaunchConfig(gridDimX=grid[0], gridDimY=grid[1], gridDimZ=grid[2], blockDimX=block[0], blockDimY=1,
                       blockDimZ=1, sharedMemBytes=shared_mem, hStream=ctypes.c_void_p(s.ptr),
                       attrs=arr, numAttrs=len(attrs))
    ptrs, _keep = kernel_params(args)
    status = _lib().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fptr), ptrs, None)
    if status != 0:
        raise KernelError(f"cuLaunchKernelEx (cluster {cluster}, programmatic {programmatic}, grid {grid}) failed "
                          f"with CUDA driver error {status}")


_PROGRAMMATIC: list[bool | None] = [None]   # None: on where the GPU has it


@contextmanager
def programmatic_launches(on: bool | None):
    """Within the block, :func:`launch` (and the IE-BME launcher) use programmatic dependent launch if ``on``
    (and the GPU has it), never if False; None restores the default (for A/B timings in one process)."""
    before = _PROGRAMMATIC[0]
    _PROGRAMMATIC[0] = on
    try:
        yield
    finally:
        _PROGRAMMATIC[0] = before


def programmatic_enabled() -> bool:
    """Whether launches on the current GPU are programmatic dependent launches (sm_90+, unless turned off)."""
    return _PROGRAMMATIC[0] is not False and compute_capability() >= 90


def compute_capability() -> int:
    """The current CUDA device's compute capability as an int (90 on H100 / H200), one driver query a device."""
    import cupy as cp

    dev = cp.cuda.Device()
    if dev.id not in _CC:
        _CC[dev.id] = int(dev.compute_capability)
    return _CC[dev.id]


_CC: dict[int, int] = {}


def launch(fn, grid: tuple[int, ...], block: tuple[int], args, shared_mem: int = 0, stream=None,
           cluster: tuple[int, int, int] | None = None) -> None:
    """Launch a step kernel (one that starts with ``pdl_enter``) on ``stream`` or CuPy's current stream: a
    programmatic dependent launch when :func:`programmatic_enabled`, else CuPy's plain launch; ``cluster``: in
    thread-block clusters of that shape (sm_90)."""
    if programmatic_enabled() or cluster is not None:
        launch_ex(fn, grid, block, shared_mem, args, cluster=cluster, programmatic=programmatic_enabled(),
                  stream=stream)
    elif stream is None:
        fn(grid, block, args, shared_mem=shared_mem)
    else:
        fn(grid, block, args, shared_mem=shared_mem, stream=stream)
