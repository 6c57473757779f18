"""Activation quantization used by the IE-BME kernels: the project's one definition, re-exported.

The rule (per token, per group of ``group_size`` input channels, symmetric, dynamic) lives in
:mod:`unionsparse.formats.arithmetic.activations`: ``scale = fp16(absmax / (2^(b-1) - 1/2))`` and
``code = clamp(rint(x / scale), -2^(b-1), 2^(b-1) - 1)``. Kernels, references and ``verify`` all call
:func:`quantize_activations` so their inputs agree bit for bit.
"""

from __future__ import annotations

from ..formats.arithmetic.activations import dequantize_activations, quantize_activations

__all__ = ["dequantize_activations", "quantize_activations"]
