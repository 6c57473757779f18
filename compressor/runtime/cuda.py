"""Whether the runtime's CUDA backend can run here (the backend itself is :mod:`.kernel_op` with
``kernels/cuda_ops.py``).

Without a CUDA device visible to torch and to CuPy, :func:`require_cuda` raises one ``UserError``.
"""

from __future__ import annotations

import torch

from ..errors import UserError


def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from ...kernels import available

    if not available():
        return "CuPy is not installed or sees no CUDA device (pip install 'unionsparse[gpu]')"
    return None


def require_cuda() -> None:
    """Raise one ``UserError`` unless the CUDA backend can run here."""
    why = cuda_problem()
    if why is not None:
        raise UserError(f"--device cuda: {why}; use --device cpu")
