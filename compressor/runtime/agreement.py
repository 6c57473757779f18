"""Does a runtime compute the CPU reference's answer? Op by op, on the inputs it really sees (docs/runtime.md,
"Agreement").

Comparing two runtimes' logits says little for the configurations users compress: W4A4 quantizes every linear's
input to 16 levels and Tiled-CBC skips inputs under a threshold, so a difference in the last bit of an input (a
float16 model against a float32 one, cuBLAS against the CPU's summation order) flips codes or skipped columns,
and the flips compound over the layers. Measured on SmolLM2-135M on the CPU: the same runtime with float16 dense
parts instead of float32 moves W4A4's logits by 2.6 at the prefill and Tiled-CBC's with thresholds by 3-4 per
decode step, while each op computes its arithmetic exactly. So the check forces the activations, not only the
tokens: every compressed op of the runtime under test (``rt``) is hooked while it decodes a given token path (its
steps eager, no graph), and each call's output is compared with what the CPU op of the same stored layer
(``backend="cpu"``, the arithmetic ``eval`` measures) computes from the very same input, within a tolerance
derived from float16 rounding of the quantities involved (:func:`tolerance`). A wrong row, column, threshold,
outlier channel, scale or stacked offset moves an output by at least one weight times one input; rounding moves it
by a few ulps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...formats.arithmetic.grouped import grouped_int_matmul
from ...formats.arithmetic.sparse_inputs import sparsify_input
from ...kernels import iebme_decode
from ...kernels.cublas_gemm import dense_halves
from ...kernels.tiled_cbc_spmm import DENSE_FROM_N
from ..errors import UserError
from .cpu import CpuOp
from .linear import CompressedLinear

F32_EPS = 2.0**-24  # unit roundoff of float32
F16_MIN_NORMAL = 2.0**-14


def ulp16(v: torch.Tensor) -> torch.Tensor:
    """Spacing of float16 numbers at magnitude ``v`` (elementwise; subnormal spacing below the normal range)."""
    e = torch.floor(torch.log2(v.abs().clamp(min=F16_MIN_NORMAL)))
    return torch.exp2(e - 10)


@dataclass
class OpReport:
    """Agreement of one op over all its calls: the largest error, its tolerance there, and their largest ratio."""

    name: str
    calls: int = 0
    rows: int = 0
    max_err: float = 0.0
    tol_at_max: float = 0.0
    worst_ratio: float = 0.0  # max over outputs of |got - want| / tolerance: <= 1 is agreement
    kind: str = ""

    @property
    def ok(self) -> bool:
        return self.worst_ratio <= 1.0


@dataclass
class Agreement:
    """Every op's :class:`OpReport`, and the logits of the run (for the record)."""

    ops: dict[str, OpReport] = field(default_factory=dict)
    logits: torch.Tensor | None = None

    @property
    def ok(self) -> bool:
        return bool(self.ops) and all(r.ok for r in self.ops.values())

    @property
    def worst(self) -> OpReport | None:
        return max(self.ops.values(), key=lambda r: r.worst_ratio, default=None)

    def failures(self) -> list[str]:
        return [f"{r.name}: |err| {r.max_err:.4g} over tolerance {r.tol_at_max:.4g} (x{r.worst_ratio:.3g}, "
                f"{r.kind})" for r in self.ops.values() if not r.ok]


def tolerance(op: CpuOp, x2: torch.Tensor, steps: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 reference output [N, M], tolerance [N, M]) of CPU op ``op`` on input ``x2`` (``steps``: its rows are
    decode steps, as the op was called).

    Both sides compute float32 sums of the same exact products (integer group sums times scales, or weight times
    input) and round to float16; they may differ in the order of the float32 additions (split-K, summation trees),
    which moves the sum by at most ``(terms + 2) * 2^-24 * sum |terms|`` (``delta``); an IE-BME layer with outliers
    whose side product takes the separate launch rounds its main product to float16 first (one more rounding, at
    most one ulp of its magnitude; allowed for every such layer); and two float16 roundings of sums that differ
    by ``delta`` differ by at most ``delta`` plus one ulp (of the larger binade). A dense float16 product (W4A16)
    may also round partial sums to float16 (cuBLAS's reduced-precision reduction): one more ulp of the magnitude
    sum there. Tiled-CBC 4-bit codes in a product of ``DENSE_FROM_N`` rows or more are decoded to two float16 halves
    of each weight first (``tiled_cbc_spmm.decode_dense``), and so may an IE-BME W4A16 prompt of
    ``iebme_decode.DENSE_FROM_N`` rows (``iebme_decode.decode_dense``): twice the terms; a quantized-activation
    prompt of ``iebme_decode.DENSE_INT_FROM_N`` rows splits each input s_x · q_x in two halves too and sums every
    product (``spmm_dense_int``)."""
    impl = op.impl
    x = x2.detach().float().cpu()
    y = op(x, steps).float()
    if hasattr(impl, "tau"):  # Tiled-CBC: the active inputs, as the op sees them in this call
        xa = sparsify_input(x, impl.tau_t if op.plan.prunes(x, steps) else None)
        mag = xa.abs() @ impl.weight.abs().T
        terms = impl.in_features * (dense_halves(op.plan.bits) if x.shape[0] >= DENSE_FROM_N else 1)
        delta = (terms + 2) * F32_EPS * mag
    elif impl.act_bits == 16:  # W4A16: the decoded weight, one dense product
        mag = x.half().float().abs() @ impl.w_deq.abs().T
        terms = impl.in_features * (2 if x.shape[0] >= iebme_decode.DENSE_FROM_N else 1)
        delta = (terms + 2) * F32_EPS * mag + ulp16(mag)
    else:  # quantized activations: the same quantization, exact group sums
        xq, sx, oq, osx = impl.quantize(x)
        mag = grouped_int_matmul(xq.abs(), sx.abs(), impl.w_codes.abs(), impl.w_scales.abs(), impl.group_size)
        terms = math.ceil(impl.in_features / impl.group_size)
        if x.shape[0] >= iebme_decode.DENSE_INT_FROM_N:  # a prompt may take the dense path: every product summed
            terms = 2 * dense_halves(impl.bits) * impl.in_features
        extra = torch.zeros_like(mag)
        if impl.outliers is not None:
            main = mag.clone()
            mag = grouped_int_matmul(oq.abs(), osx.abs(), impl.side_codes.abs(), impl.side_scales.abs(),
                                     impl.side_group, out=mag)
            terms += math.ceil(impl.side_codes.shape[1] / impl.side_group)
            extra = ulp16(main)
        delta = (terms + 2) * F32_EPS * mag + extra
    return y, delta + ulp16(y.abs() * (1 + 2.0**-9) + delta)  # the rounding may reach the next binade


def _hooked_ops(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m.op for name, m in model.named_modules() if isinstance(m, CompressedLinear)}


def op_agreement(rt, cpu_rt, prompts: Sequence[Sequence[int]], new_ids: Sequence[Sequence[int]]) -> Agreement:
    """Decode ``new_ids`` (teacher forcing: one list per prompt) after ``prompts`` with runtime ``rt``, every step
    eager, and compare each call of each compressed op with the op of the same name in ``cpu_rt`` (a CPU
    runtime of the same artifact with the same fusion) on the same input (see the module docstring). One prompt
    runs as :meth:`~.generate.Runtime.step_logits` does, several as one left-padded batch."""
    ref_ops = _hooked_ops(cpu_rt.model)
    ops = _hooked_ops(rt.model)
    missing = sorted(set(ops) - set(ref_ops))
    if missing:
        raise UserError(f"the reference runtime has no op named {missing[0]} (load both with the same fusion)")
    out = Agreement({name: OpReport(name) for name in ops})

    def check(name: str, args: tuple, y: torch.Tensor) -> None:
        x2 = args[0]
        want, tol = tolerance(ref_ops[name], x2, args[1] if len(args) > 1 else None)
        err = (y.detach().float().cpu() - want).abs()
        ratio = err / tol
        i = int(torch.argmax(ratio))
        r = out.ops[name]
        r.calls += 1
        r.rows += int(x2.shape[0])
        r.kind = getattr(ops[name], "kind", "")
        if float(ratio.view(-1)[i]) >= r.worst_ratio:
            r.worst_ratio = float(ratio.view(-1)[i])
            r.max_err, r.tol_at_max = float(err.view(-1)[i]), float(tol.view(-1)[i])

    hooks = [op.register_forward_hook(lambda _m, args, y, name=name: check(name, args, y))
             for name, op in ops.items()]
    saved = rt.graphs
    rt.graphs = False
    rt._decoder = rt._graph = None
    rt._batched.clear()
    try:
        if len(prompts) == 1:
            out.logits = rt.step_logits(prompts[0], new_ids[0])
        else:
            out.logits = rt.step_logits_batch(prompts, new_ids)
    finally:
        for h in hooks:
            h.remove()
        rt.graphs = saved
        rt._decoder = rt._graph = None
        rt._batched.clear()
    return out
