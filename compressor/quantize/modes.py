"""The ``--quant`` modes: the weight and activation bits of each, the one table compress, verify and the
configuration read.

One convention for "not quantized", the formats' own: weights kept as float16 have ``weight_bits`` None (as an
encoding's ``bits``), activations kept as float16 have ``act_bits`` 16 (as
``formats.arithmetic.activations.activation_scheme`` takes them). Imports nothing heavy: the configuration
checks use it before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

FP16_ACTIVATIONS = 16  # act_bits of a mode that leaves activations in float16


@dataclass(frozen=True)
class QuantMode:
    """Bits of one ``--quant`` mode."""

    weight_bits: int | None  # None: float16 weights
    act_bits: int  # FP16_ACTIVATIONS: float16 activations

    @property
    def quantizes_activations(self) -> bool:
        return self.act_bits != FP16_ACTIVATIONS


QUANT_MODES: dict[str, QuantMode] = {  # the order of --quant's choices
    "w4a4": QuantMode(4, 4),
    "w2a4": QuantMode(2, 4),
    "w4a8": QuantMode(4, 8),
    "w2a8": QuantMode(2, 8),
    "w4a16": QuantMode(4, FP16_ACTIVATIONS),
    "none": QuantMode(None, FP16_ACTIVATIONS),
}


def quant_mode(name: str) -> QuantMode:
    """The bits of ``--quant`` mode ``name``; UserError naming the choices for an unknown one."""
    try:
        return QUANT_MODES[name]
    except KeyError:
        raise UserError(f"--quant: unknown value {name!r} (choose from {', '.join(QUANT_MODES)})") from None
