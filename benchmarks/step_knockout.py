"""What each glue op costs the graphed decode step: the step with that op knocked out, side by side (issue 36).

The profiler's eager kernel times do not add up to the step's part outside the linears: with programmatic
dependent launch a kernel starts while the one before it runs and its measured time includes that wait. This
script measures each op's share the only way that holds inside a CUDA graph: the same `bench --e2e` case with the
op replaced by a view of its input (no launch; the values are garbage, so the step checks are off), the step's
time against the intact step's, all in one process:

* ``attention``: decode attention (with its rotary + KV write) returns q's rows;
* ``norms``: RMSNorm and the residual add return their input (the residual stream stops being updated);
* ``silu``: SiLU·mul returns the gate;
* ``glue``: all three (what is left: the linears, lm_head, the greedy choice, embedding, position updates).

    python benchmarks/step_knockout.py --out DIR     (a CUDA machine; benchmarks/glue_h200.sh knockout runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from unionsparse.compressor.bench.e2e import case_arguments, e2e_command

OPS = ("attention", "norms", "silu")


def _attention(q, *_args):
    b = q.shape[0]
    return q.reshape(b, 1, -1), None


def _norm(x, _weight, _eps):
    return x


def _add_norm(x, _delta, _weight, _eps):
    return x, x


def _silu(gate, _up):
    return gate


@contextlib.contextmanager
def knocked_out(ops: tuple[str, ...]) -> Iterator[None]:
    """The CUDA runtime kernels with ``ops`` replaced by views of their inputs (see the module docstring)."""
    from unionsparse.kernels.cuda_ops import CudaKernels

    patches = {"attention": {"decode_attention_rope": _attention},
               "norms": {"rms_norm": _norm, "add_rms_norm": _add_norm},
               "silu": {"silu_mul": _silu}}
    saved = {}
    for op in ops:
        for name, fn in patches[op].items():
            saved[name] = CudaKernels.__dict__[name]
            setattr(CudaKernels, name, staticmethod(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(CudaKernels, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = case_arguments(ap, "fp16,iebme-w4a16-50").parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {"intact": (), **{op: (op,) for op in OPS}, "glue": OPS}
    res: dict = {"spec": args.spec, "batch": args.batch, "context": args.context, "cases": {}}
    for label, ops in cases.items():
        with knocked_out(ops):
            r = e2e_command(specs=args.spec, batches=args.batch, contexts=args.context, kinds=args.kinds,
                            hf_generate=False, checks=False)
        res["cases"][label] = [{k: row.get(k) for k in ("kind", "batch", "context", "step_ms", "outside_ms")}
                               for row in r["rows"] if "step_ms" in row]
        res.setdefault("machine", r.get("machine"))
        print(label, [(row["kind"], round(row["step_ms"], 3)) for row in res["cases"][label]], flush=True)
    intact = {(r["kind"], r["batch"], r["context"]): r["step_ms"] for r in res["cases"]["intact"]}
    lines = [f"{args.spec}, batch {args.batch}, context {args.context}: step (ms) with one op knocked out, and what "
             "the op costs the step (intact less knocked out)", "",
             "| kind | intact | " + " | ".join(f"no {c}" for c in cases if c != "intact") + " |",
             "|---|---|" + "---|" * (len(cases) - 1)]
    for key, ms in intact.items():
        cells = []
        for label in cases:
            if label == "intact":
                continue
            row = next((r for r in res["cases"][label] if (r["kind"], r["batch"], r["context"]) == key), None)
            cells.append("-" if row is None else f"{row['step_ms']:.3f} ({ms - row['step_ms']:+.3f})")
        lines.append(f"| {key[0]} B={key[1]} | {ms:.3f} | " + " | ".join(cells) + " |")
    (out / "step_knockout.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "step_knockout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
