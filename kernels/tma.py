"""Tensor maps for the copy engine (TMA, sm_90+): ``cuTensorMapEncodeTiled`` by ctypes on the CUDA driver.

    tmap = fp16_2d(X, box=(64, 128))   # X: C-contiguous CuPy fp16 [rows, cols]; box (cols, rows), 128-byte swizzle

The result (a 128-byte, 64-byte-aligned ctypes struct) is a kernel argument passed by value
(``cluster_launch.launch_ex``); elements of a box outside the array are zero-filled by the copy engine.
"""

from __future__ import annotations

import ctypes

from .cluster_launch import _lib
from .errors import KernelError

FLOAT16, SWIZZLE_128B, L2_PROMOTION_256B = 6, 3, 3  # CUtensorMapDataType / Swizzle / L2promotion (cuda.h)


class TensorMap(ctypes.Structure):
    """CUtensorMap: 128 opaque bytes (64-byte aligned: ``aligned_map``)."""

    _fields_ = [("w", ctypes.c_uint64 * 16)]


def aligned_map() -> TensorMap:
    """A zeroed TensorMap at a 64-byte-aligned host address (its buffer kept alive by the object)."""
    buf = (ctypes.c_char * 192)()
    off = (-ctypes.addressof(buf)) % 64
    tmap = TensorMap.from_buffer(buf, off)
    tmap._buf = buf
    return tmap


def fp16_2d(x, box: tuple[int, int]) -> TensorMap:
    """Tensor map of a C-contiguous fp16 CuPy array [rows, cols] read in boxes of ``box`` = (cols, rows) with the
    128-byte swizzle (``box[0]`` * 2 must be 128: one swizzle row); the row pitch must be a multiple of 16 bytes."""
    rows, cols = x.shape
    if x.dtype.itemsize != 2 or not x.flags.c_contiguous or (cols * 2) % 16 or x.data.ptr % 16:
        raise KernelError("fp16_2d needs a C-contiguous 2-byte array, 16-byte aligned, rows a multiple of 16 bytes "
                         f"(got itemsize {x.dtype.itemsize}, {cols} columns, address {x.data.ptr:#x})")
    if box[0] * 2 != 128 or not 1 <= box[1] <= 256:
        raise KernelError(f"box must be (64, 1..256) for the 128-byte swizzle, got {box}")
    lib = _lib()
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    tmap = aligned_map()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)
    boxd = (ctypes.c_uint32 * 2)(box[0], box[1])
    estr = (ctypes.c_uint32 * 2)(1, 1)
    status = fn(ctypes.byref(tmap), ctypes.c_int(FLOAT16), ctypes.c_uint32(2), ctypes.c_void_p(x.data.ptr), dims,
                strides, boxd, estr, ctypes.c_int(0), ctypes.c_int(SWIZZLE_128B), ctypes.c_int(L2_PROMOTION_256B),
                ctypes.c_int(0))
    if status != 0:
        raise KernelError(f"cuTensorMapEncodeTiled failed with CUDA driver error {status}")
    return tmap
