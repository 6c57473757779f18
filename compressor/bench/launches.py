"""Kernel launches of a decode step outside its linears, per kind (issue 36, item 1).

The profiler (CUDA activity) records the kernels of one eager step and, separately, of the decoder linears
alone on the inputs that step gave them; a step's kernel that the linears alone do not launch is outside the
linears. A quantizing producer (norm + the next linear's input quantization) counts as outside: it is glue that
replaced the linear's own activation quantization, whose launch the linears-alone run then has and the step
does not. Kernels are grouped into kinds by name (:data:`KINDS`), so the count says what to fuse next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch

KINDS = (  # (kind, substrings of a kernel's name, lower case), first match wins
    ("norm", ("rms_norm",)),
    ("rotary+kv", ("rotary",)),
    ("silu*mul", ("silu",)),
    ("attention", ("attention", "fmha", "flash", "softmax", "sdpa", "attn")),
    ("outlier side", ("side_product", "outlier")),
    ("act quant", ("act_quant", "quantize")),
    ("matmul", ("gemm", "gemv", "matmul", "xmma", "cutlass", "spmm", "spmspv", "iebme", "tcbc")),
    ("argmax/reduce", ("argmax", "reduce")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "index")),
)


TOP = 10  # the kernels outside the linears with the most GPU time, by name, kept in the row


def kind_of(name: str) -> str:
    """The kind of a kernel from its name (``other`` when no rule matches)."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def outside_launches(step: Iterable[tuple[str, float]], linears: Iterable[tuple[str, float]], layers: int) -> dict:
    """From the (kernel name, GPU microseconds) of one step and of its linears alone: the launches outside the
    linears per step and per layer (the per-step ones, such as the embedding, the final norm and the greedy
    choice, spread over the layers), and per kind the launches and their GPU time (microseconds per step; of a
    name launched in both, the step's last launches count as outside)."""
    step, linears = list(step), list(linears)
    left = Counter(name for name, _ in linears)
    by_kind: Counter = Counter()
    us: Counter = Counter()
    names: Counter = Counter()
    name_us: Counter = Counter()
    total = 0
    for name, t in step:
        if left[name] > 0:
            left[name] -= 1
            continue
        kind = kind_of(name)
        by_kind[kind] += 1
        us[kind] += t
        names[name] += 1
        name_us[name] += t
        total += 1
    return {"step": len(step), "linears": len(step) - total, "outside": total,
            "outside_per_layer": total / max(1, layers), "outside_by_kind": dict(sorted(by_kind.items())),
            "outside_us_by_kind": {k: round(us[k], 1) for k in sorted(us)},
            "step_kernel_us": round(sum(t for _, t in step), 1),
            "outside_top": [{"name": n[:120], "launches": names[n], "us": round(t, 1)}
                            for n, t in name_us.most_common(TOP)]}


def kernel_names(fn: Callable[[], object], device: torch.device) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of each kernel (and copy) one call of ``fn`` launches, in order (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name, float(e.time_range.elapsed_us())) for e in events]
