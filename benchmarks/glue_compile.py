"""The decode step's glue three ways on the same linears, side by side in one process (issue 36, item 3).

Issue 36 asks to weigh the ways to bring the part of the step outside the linears down by measurement:
* ``kernels``: the project's hand-written glue (kernels/glue.cu, norm_quant.cu, attention.cu), the runtime default;
* ``torch``: the same step with transformers' modules for the glue (norms, rotary, SDPA over the static cache),
  eager, as the torch references compute it;
* ``compiled``: each glue op's torch reference through ``torch.compile`` (Inductor generates a Triton kernel or
  two per op, fusing the residual add into the norm, the mask into attention), called where the step calls the
  hand-written kernels (:class:`CompiledGlue` says why not the whole forward).
Every way runs the step as the runtime does (one CUDA graph per step, greedy choice on the device), on the
synthetic model of ``--spec`` with the linears of ``--kinds`` (fp16: cuBLAS; the compressed kinds' CuPy kernels are
graph breaks for torch.compile, their linears still in the graph). The part outside the linears is the step less
the kernels-way linears time (the same modules in every way). The logits of one eager step of each way are
compared with the kernels way's (float16 rounding apart, the same model). Results: ``--out``/glue_compile.{md,json}.

    python benchmarks/glue_compile.py --out DIR            (a CUDA machine; benchmarks/glue_h200.sh compile runs it)
    python benchmarks/glue_compile.py --spec tiny --device cpu --ways torch,compiled   (a smoke run on the CPU)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from unionsparse.compressor.bench.e2e import install_kind, machine_info, prepare_case, run_case, time_calls
from unionsparse.compressor.bench.e2e_models import SPECS, build_model
from unionsparse.compressor.bench.launches import kernel_names
from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder

WAYS = ("kernels", "torch", "compiled")


class CompiledGlue:
    """The glue's torch references (kernels/glue.py, attention.py), each through ``torch.compile`` (Inductor), in
    the runtime kernels' place: the step calls them where it calls the hand-written kernels. The whole forward is
    not compiled: the fused linears' hand-over state (compressor/runtime/fused.py) and the compressed ops' CuPy
    calls make Dynamo recompile or break the graph at every linear, so per-op compilation is what a user of these
    linears gets. No fused variants: attention gets q rotated by ``rotary_cache``, o_proj quantizes its own input."""

    name = "compiled"

    def __init__(self) -> None:
        from unionsparse.compressor.runtime.decoder import _TorchGlue  # the glue's torch references, one place

        for name in ("rms_norm", "add_rms_norm", "silu_mul", "rotary_cache", "decode_attention"):
            setattr(self, name, torch.compile(getattr(_TorchGlue, name), dynamic=False))

    @staticmethod
    def glue_dtypes() -> tuple[torch.dtype, ...]:
        return (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def decode_attention_rope(*_args):
        return None

    @staticmethod
    def decode_attention_quant(*_args):
        return None


def _set_way(dec: StaticDecoder, way: str, kernels, compiled: CompiledGlue | None) -> None:
    if kernels is None and way == "kernels":
        raise SystemExit("glue_compile.py: the kernels way needs a CUDA device")
    dec.kernels = compiled if way == "compiled" else kernels
    dec.glue = "torch" if way == "torch" else "kernels"
    if way == "compiled":
        dec.prequant = False  # the linears quantize their own inputs (none do for fp16 and W4A16)


def _one_step_logits(dec: StaticDecoder, context: int, start: torch.Tensor) -> torch.Tensor:
    dec.position.fill_(context)
    dec.tokens.copy_(start)
    return dec.step().float().clone()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="llama2-7b", choices=sorted(SPECS))
    ap.add_argument("--kinds", default="fp16,iebme-w4a16-50")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = torch.device(args.device)
    spec = SPECS[args.spec]
    ways = [w for w in args.ways.split(",") if w]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(spec, dev, seed=0, linears=False)
    res = {"machine": machine_info(dev), "spec": spec.name, "batch": args.batch, "context": args.context,
           "torch": torch.__version__, "rows": []}
    for kind in args.kinds.split(","):
        install_kind(model, spec, kind, dev, 0)
        dec, start, _ = prepare_case(model, spec, args.batch, args.context, args.steps, dev)
        base = None  # the kernels way's run_case row (or the first way's): its linears time is every way's
        ref_logits = None
        kernels, compiled = dec.kernels, CompiledGlue() if "compiled" in ways else None
        for way in ways:
            _set_way(dec, way, kernels, compiled)
            t0 = time.perf_counter()
            logits = _one_step_logits(dec, args.context, start)  # the compile happens here
            first_s = time.perf_counter() - t0
            ref_logits = logits if ref_logits is None else ref_logits
            if base is None:
                base = run_case(model, spec, kind, dec, start, args.context, args.steps, args.repeats, dev)
                step_ms, launches = base["step_ms"], base.get("launches")
            else:
                dec.position.fill_(args.context)
                step = GraphedStep(dec, greedy=True, strict=False)
                step()
                step_ms = time_calls(step, args.steps, args.repeats, dev,
                                     before=lambda d=dec: d.position.fill_(args.context))
                launches = None
                if dev.type == "cuda" and base.get("launches"):  # the same linears: the same launches inside them
                    dec.position.fill_(args.context)
                    n = len(kernel_names(GraphedStep(dec, greedy=True, capture=False), dev))
                    outside = n - base["launches"]["linears"]
                    launches = {"step": n, "outside": outside, "outside_per_layer": outside / spec.layers}
                if step.capture_error:
                    res.setdefault("notes", []).append(f"{kind} {way}: step not captured ({step.capture_error})")
                del step
            row = {"kind": kind, "way": way, "step_ms": step_ms, "linears_ms": base["linears_ms"]["total"],
                   "outside_ms": step_ms - base["linears_ms"]["total"], "first_step_s": first_s,
                   "max_logit_diff_vs_first_way": float((logits - ref_logits).abs().max()),
                   "launches": launches}
            res["rows"].append(row)
            print(f"{spec.name} {kind:>16} {way:>9}: step {step_ms:.3f} ms, outside the linears "
                  f"{row['outside_ms']:.3f} ms, first step {first_s:.1f} s, "
                  f"max |logit diff| {row['max_logit_diff_vs_first_way']:.3g}", flush=True)
        del dec
    (out / "glue_compile.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    lines = [f"{spec.name}, batch {args.batch}, context {args.context}, {res['machine'].get('gpu', args.device)}, "
             f"torch {torch.__version__}", "",
             "| kind | glue | step (ms) | outside the linears (ms) | launches outside per layer | first step (s) |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        per_layer = (r["launches"] or {}).get("outside_per_layer")
        lines.append(f"| {r['kind']} | {r['way']} | {r['step_ms']:.3f} | {r['outside_ms']:.3f} | "
                     f"{'' if per_layer is None else f'{per_layer:.1f}'} | {r['first_step_s']:.1f} |")
    lines += [""] + res.get("notes", [])
    (out / "glue_compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
