"""fp16 GEMM through cuBLAS by ctypes, usable inside CUDA-graph stream capture.

CuPy's cuBLAS bindings refuse to run while a stream is being captured; cuBLAS itself supports capture
when the handle has a preset workspace. This module opens the libcublas that CuPy already loaded, keeps one
handle per device with its own workspace (a CuPy allocation), and exposes one call::

    gemm_f16(transa, transb, m, n, k, a, lda, b, ldb, c, ldc)   # column-major C = op(A) op(B), pointers

fp16 inputs, fp16 (or fp32, ``c32``) output, fp32 accumulation (CUBLAS_COMPUTE_32F), on CuPy's current stream.
"""

from __future__ import annotations

import ctypes

from .errors import KernelError

CUDA_R_16F = 2
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
OP_N, OP_T = 0, 1
WORKSPACE_BYTES = 32 * 1024 * 1024   # cuBLAS's recommendation for Hopper is 32 MiB

_LIB = None
_HANDLES: dict[int, tuple[ctypes.c_void_p, object]] = {}
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)


def _lib():
    global _LIB
    if _LIB is None:
        import cupy  # noqa: F401  (loads libcublas's soname into the process first)

        for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise KernelError("libcublas not found (looked for libcublas.so.13/.12/.11)")
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        _LIB = lib
    return _LIB


def _check(status: int, what: str) -> None:
    if status != 0:
        raise KernelError(f"{what} failed with cuBLAS status {status}")


def _handle():
    import cupy as cp

    dev = cp.cuda.Device().id
    if dev not in _HANDLES:
        lib = _lib()
        h = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        ws = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        _check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.data.ptr), WORKSPACE_BYTES), "cublasSetWorkspace")
        _HANDLES[dev] = (h, ws)
    return _HANDLES[dev][0]


def gemm_f16(transa: int, transb: int, m: int, n: int, k: int, a: int, lda: int, b: int, ldb: int, c: int,
             ldc: int, c32: bool = False, accumulate: bool = False) -> None:
    """Column-major ``C[m, n] = op(A) @ op(B)`` on device pointers (fp16 A and B, fp32 accumulation); C fp16, or
    fp32 with ``c32``; ``accumulate``: C += the product (beta = 1)."""
    import cupy as cp

    lib = _lib()
    h = _handle()
    _check(lib.cublasSetStream_v2(h, ctypes.c_void_p(cp.cuda.get_current_stream().ptr)), "cublasSetStream")
    _check(lib.cublasGemmEx(h, transa, transb, m, n, k, ctypes.byref(_ONE), ctypes.c_void_p(a), CUDA_R_16F, lda,
                            ctypes.c_void_p(b), CUDA_R_16F, ldb, ctypes.byref(_ONE if accumulate else _ZERO),
                            ctypes.c_void_p(c), CUDA_R_32F if c32 else CUDA_R_16F, ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT), "cublasGemmEx")


def dense_halves(bits: int | None) -> int:
    """float16 halves per weight in a decoded dense weight (``decode_dense`` of either format): 2 for 4-bit codes
    (code x float16 scale needs up to 14 significant bits: hi = fp16(w), lo = fp16(w - hi), exact), else 1
    (float16 values; 2-bit codes -2..1 times a float16 scale are float16)."""
    return 2 if bits is not None and bits > 2 else 1


def gemm_decoded(ws, x, k: int, kp: int, halves: int, out, accumulate: bool = False) -> None:
    """``out`` [N, M] = ``x`` [N, >= k] times the decoded weight ``ws`` [M, halves * kp] (CuPy fp16, contiguous):
    with two halves, the product of [x, x] (each padded to kp) with hi | lo over 2 kp inner columns, so every
    product is exact and the float32 sum is the reference's up to order. ``out`` float16, or float32 (then
    ``accumulate`` adds the product to it)."""
    import cupy as cp

    n, m = x.shape[0], ws.shape[0]
    inner = k
    if halves == 2:
        x2 = cp.zeros((n, 2 * kp), dtype=cp.float16)
        x2[:, :k] = x[:, :k]
        x2[:, kp : kp + k] = x[:, :k]
        x, inner = x2, 2 * kp
    # Y [N, M] row-major is Y^T [M, N] column-major: Y^T = W X^T with W read transposed
    gemm_f16(OP_T, OP_N, m, n, inner, ws.data.ptr, ws.shape[1], x.data.ptr, x.shape[1], out.data.ptr, m,
             c32=out.dtype == cp.float32, accumulate=accumulate)
