"""Run an artifact: load it into a transformers model whose compressed linears compute what the artifact's
kernels compute on the stored arrays, and generate text (docs/runtime.md).

    rt = unionsparse.compressor.runtime.load("out/s.zarr", device="cpu")
    g = rt.generate("The sparse kernel", max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1,
                    stream=lambda token, text: print(text, end=""))
"""

from __future__ import annotations

from .generate import Generation, Runtime, TextStream, load
from .linear import CompressedLinear
from .plan import BACKENDS, LayerPlan, layer_plan

__all__ = ["BACKENDS", "CompressedLinear", "Generation", "LayerPlan", "Runtime", "TextStream", "layer_plan", "load"]
