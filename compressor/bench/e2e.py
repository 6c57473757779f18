"""`unionsparse bench --e2e [ARTIFACT]`: time per output token of whole decode steps (issue 28, item 5).

For each model (synthetic LLaMA-2-7B and Llama-3-8B shapes with random weights made on the device, or an
artifact's own model), each linear kind (``e2e_peers.KINDS``, by default ``DEFAULT_KINDS``: dense fp16, dense
W4A16, IE-BME W4A4 50% with and without 128 outlier channels and their 0% controls, Tiled-CBC fp16 30% + 30%;
Q/K/V and gate/up stacked through the runtime's
``SharedInputLinear``), each batch and each context, the same step code runs: ``runtime.decoder.StaticDecoder``
(static KV cache) prefilled with ``context`` random tokens, its step captured in ONE CUDA graph
(``GraphedStep``, greedy choice included) and replayed; CUDA events around ``steps`` replays, median over
repeats, the position reset to ``context`` before each repeat. Every kind is built once and stays resident;
each (context, batch) is prefilled once by the fp16 peers (untimed: through the sparse kinds' kernels, which take
at most 32 rows a launch, a 16k-token prefill would take minutes) and every kind steps from that same cache.
A step yields one token per sequence: ``step_ms`` is the time per output token of each sequence,
``tokens_per_s`` counts all ``batch``.

Breakdown: the decoder linears alone, one CUDA graph per group (Q/K/V stacked, O, gate/up stacked, down) running
that group's module of every block on the inputs an eager step of the same case gave it (so Tiled-CBC's
thresholds skip what they skip in the step), and the lm_head alone; ``outside`` is the step less the decoder
linears (attention, norms, rotary, cache writes, the lm_head, the greedy choice).

Byte floor: the bytes a step must read (every decoder linear's stored arrays, less the values of inputs the
spMspV kernel skips at batch 1; the lm_head; the embedding rows; the norms; K and V of ``context`` positions),
over the device's copy bandwidth, measured in the run (``copy_bandwidth``: about 4.16 TB/s on an H200, 3.0 on
an H100; ``PEAK_BW`` on the CPU smoke run); ``floor_pct`` is how much of it the step reaches (floor time / step
time).

Ratios are within one process: every kind runs in the same process on the same model and the same step code.
Hugging Face eager ``generate`` (DynamicCache, no graph) on the fp16 peers at batch 1 is reported beside it,
labelled as such. ``device="cpu"`` (tiny spec) runs the same code eagerly, for tests: not a performance figure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..artifact.store import Artifact
from ..errors import UserError
from ..files import atomic_write, environment_errors
from .e2e_models import GPU_SPECS, GROUP_MEMBERS, GROUPS, SPECS, ModelSpec, build_model, clear_groups, install_group
from .e2e_peers import (
    BASELINES,
    CONTROLS,
    DEFAULT_KINDS,
    GROUP_SIZE,
    KINDS,
    HalfLinear,
    W4A16Linear,
    check_w4a16_shape,
    fp16_linear,
    iebme_record,
    normal_tau,
    record_read_bytes,
    sparse_fp16,
    tcbc_record,
    with_tau,
)
from .kernels import PEAK_BW
from .launches import kernel_names, outside_launches

CPU_LABEL = "CPU, not a performance figure"
HF_LABEL = "Hugging Face eager generate (DynamicCache, no CUDA graph), fp16 peers"
ARTIFACT_KIND = "artifact"
CALIB_TOKENS = 64
DEFAULTS = {  # device -> (batches, contexts, steps, repeats)
    "cuda": ((1, 4, 8), (512, 2048), 16, 5),
    "cpu": ((1, 2), (16, 32), 3, 3),
}
TARGETS = (  # (spec, context, kind, against, batches, at least x)
    # issue 36, on the configuration that keeps quality; its 1.9x is of the fp16 step of 2026-12-05 (5.22 ms), and
    # against today's fp16, which has the same fused glue, it is stricter
    ("llama2-7b", 512, "iebme-w4a4-50-o128", "fp16", (1,), 1.9),
    ("llama2-7b", 512, "iebme-w4a4-50-o128", "w4a16", (1, 4, 8), 1.0),
    ("llama2-7b", 512, "tcbc-fp16-30+30", "fp16", (1,), 1.5),  # issue 28, item 5
)


# ------------------------------------------------------------------------------------------------ arguments


def case_arguments(ap, kinds: str):
    """Add the options of a script that runs `bench --e2e` cases side by side (``benchmarks/step_ab.py``,
    ``step_knockout.py``): --spec, --kinds (default ``kinds``), --batch, --context, --out."""
    ap.add_argument("--spec", default="llama2-7b")
    ap.add_argument("--kinds", default=kinds)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--context", default="512")
    ap.add_argument("--out", default="benchmarks/results")
    return ap


def parse_ints(text: str | None, option: str, default: tuple[int, ...]) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option}: expected comma-separated positive integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise UserError(f"{option}: expected comma-separated positive integers, got {text!r}")
    return vals


def parse_names(text: str | None, option: str, known, default: tuple[str, ...]) -> tuple[str, ...]:
    if text is None:
        return default
    vals = tuple(v.strip() for v in str(text).split(",") if v.strip())
    bad = [v for v in vals if v not in known]
    if not vals or bad:
        raise UserError(f"{option}: unknown value {bad[0] if bad else text!r} (choose from {', '.join(known)})")
    return tuple(dict.fromkeys(vals))


def gpu_problem() -> str | None:
    """Why the GPU benchmark cannot run here (one line), or None: the runtime's CUDA backend's reason."""
    from ..runtime.cuda import cuda_problem

    return cuda_problem()


# ------------------------------------------------------------------------------------------------ timing


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The device's measured copy bandwidth in bytes/s (read + write of a ``nbytes`` copy, best of ``repeats``):
    what a step's floor is measured against (an H100 copies about 3.0 TB/s, an H200 about 4.16)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / best


def apply_floor(rows: list[dict], bw: float) -> None:
    """Each row's floor (its bytes over ``bw``) and how close its step comes to it."""
    for r in rows:
        r["floor_ms"] = r["bytes"]["total"] / bw * 1e3
        r["floor_pct"] = 100.0 * r["floor_ms"] / r["step_ms"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], n: int, repeats: int, device: torch.device,
               before: Callable[[], None] | None = None) -> float:
    """Median over ``repeats`` of the milliseconds per call of ``n`` back-to-back calls of ``fn`` (CUDA events on
    a GPU, the wall clock on the CPU); ``before()`` runs before each repeat, outside the timed span."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / n)
        else:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / n)
    return float(statistics.median(times))


def graphed(fn: Callable[[], object], device: torch.device, warmup: int = 2) -> Callable[[], object]:
    """``fn`` captured in one CUDA graph (after ``warmup`` eager runs on the capture's side stream), returned as
    its replay; on the CPU ``fn`` itself."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


# ----------------------------------------------------------------------------------------- model structure


def group_modules(model: nn.Module, layer: int, group: str) -> list[nn.Module]:
    """The modules that compute block ``layer``'s ``group``: the stacked op of fused members (once), and the
    separate linears."""
    from ..runtime.fused import SharedInputMember

    block = model.get_submodule(f"model.layers.{layer}")
    out: list[nn.Module] = []
    for name in GROUP_MEMBERS[group]:
        mod = block.get_submodule(name)
        mod = mod.shared.stacked if isinstance(mod, SharedInputMember) else mod
        if not any(m is mod for m in out):
            out.append(mod)
    return out


@contextlib.contextmanager
def recording(model: nn.Module, n_layers: int, store: dict):
    """Record the input of every group module (``store[(layer, group, j)]`` = a copy) while inside."""
    handles = []
    for layer in range(n_layers):
        for group in GROUPS:
            for j, mod in enumerate(group_modules(model, layer, group)):
                def hook(_m, args, key=(layer, group, j)):
                    store[key] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
                handles.append(mod.register_forward_pre_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def union_inactive(x: torch.Tensor, tau: float, mod: nn.Module) -> float:
    """Fraction of a Tiled-CBC layer's weight columns the spMspV of one decode step leaves unread: the inputs with
    |x| <= tau in every row of a launch (``tiled_cbc_spmspv.ROWS[-1]`` rows a launch; none above
    ``KernelOp.SPMSPV_ROWS`` rows of fp16 values, where the SpMM runs). Averaged over the launches of a call, so
    for int codes above one launch's rows it is one pass's figure (the benchmark's batches are at most 8)."""
    from ...kernels.tiled_cbc_spmspv import ROWS
    from ..runtime.kernel_op import KernelOp

    x2 = x.reshape(-1, x.shape[-1]).abs().float() <= tau
    recs = getattr(mod, "_bench_records", None) or []
    fp16 = all(rec.attrs.get("bits") is None for rec in recs)
    if x2.shape[0] > KernelOp.SPMSPV_ROWS and fp16:
        return 0.0
    r = ROWS[-1]
    return float(torch.stack([x2[i : i + r].all(0) for i in range(0, x2.shape[0], r)]).float().mean())


def module_read_bytes(mod: nn.Module, inactive: float = 0.0) -> int:
    """Bytes one call of a linear must read: its weights as stored (a runtime layer: its record's arrays)."""
    recs = getattr(mod, "_bench_records", None)
    if recs is not None:  # a runtime layer: its stored arrays (a stacked op: its members', tile padding aside)
        return sum(record_read_bytes(rec, inactive) for rec in recs)
    if isinstance(mod, W4A16Linear):
        return mod.weight_bytes()
    if isinstance(mod, nn.Linear):
        return mod.weight.numel() * mod.weight.element_size()
    return sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))


def dense_read_bytes(model: nn.Module, batch: int) -> dict[str, int]:
    """Bytes a step reads outside the decoder linears, KV cache aside: lm_head, embedding rows, norms."""
    inner = model.model
    emb = inner.embed_tokens.weight
    head = model.lm_head
    head_b = module_read_bytes(head)
    norms = sum(p.numel() * p.element_size() for n, p in inner.named_parameters() if "norm" in n)
    return {"lm_head": int(head_b), "embedding_rows": int(batch * emb.shape[1] * emb.element_size()),
            "norms": int(norms)}


# ---------------------------------------------------------------------------------------------- the peers


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            import cupy as cp

            cp.get_default_memory_pool().free_all_blocks()


@contextlib.contextmanager
def float16_activation_kernel(on: bool):
    """IE-BME W4A16 layers built inside run the float16-activation kernel (``on``) whatever the runtime's default
    (``kernels.iebme_spmm.FLOAT16_ACTIVATIONS``)."""
    from ..runtime.kernel_op import KernelOp

    saved = KernelOp.IEBME16
    KernelOp.IEBME16 = True if on else saved
    try:
        yield
    finally:
        KernelOp.IEBME16 = saved


def _runtime_linear(rec, device: torch.device) -> nn.Module:
    from ..runtime.linear import CompressedLinear

    backend = "cuda" if device.type == "cuda" else "cpu"
    lin = CompressedLinear(rec, None, backend, device=device)
    lin._bench_records = [rec]  # for the byte floor (not a submodule: a plain attribute)
    return lin


def calibrate_taus(model: nn.Module, spec: ModelSpec, dynamic: float, device: torch.device, seed: int) -> dict:
    """Per (layer, group): the threshold at which a fraction ``dynamic`` of the group's inputs is inactive, from
    a prefill of ``CALIB_TOKENS`` random tokens through the model's current linears."""
    from ..activation_sparsity.thresholds import tau_from_samples
    from ..runtime.decoder import StaticDecoder

    ids = torch.randint(0, spec.vocab, (1, CALIB_TOKENS), generator=torch.Generator().manual_seed(seed + 7))
    dec = StaticDecoder(model, 1, CALIB_TOKENS + 2)
    store: dict = {}
    with recording(model, spec.layers, store):
        dec.prefill(ids.to(device))
    del dec
    return {(layer, group): tau_from_samples(x.abs().float().cpu().numpy(), dynamic)
            for (layer, group, _j), x in store.items()}


def install_kind(model: nn.Module, spec: ModelSpec, kind: str, device: torch.device, seed: int = 0,
                 log: Callable[[str], None] | None = None) -> dict:
    """Replace every decoder linear of ``model`` by ``kind``'s (one module per block and group, each its own
    weights); returns build facts (seconds, taus)."""
    k = KINDS[kind]
    groups, splits = spec.groups(), spec.splits()
    t0 = time.perf_counter()
    info: dict = {"kind": kind, "label": k.label}
    clear_groups(model, spec)
    _free(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rng = np.random.default_rng(seed + 2)
    if kind == "fp16":
        for layer in range(spec.layers):
            for g, (m, kk) in groups.items():
                install_group(model, layer, g, fp16_linear(m, kk, device, gen), splits[g])
    elif kind == "w4a16":
        for m, kk in groups.values():
            check_w4a16_shape(m, kk)
        for layer in range(spec.layers):
            for g, (m, kk) in groups.items():
                lin = W4A16Linear.random(m, kk, device, gen)
                install_group(model, layer, g, lin, splits[g])
        info["activations"] = str(lin.dtype).removeprefix("torch.")  # bfloat16: a cast around each product
    elif kind.startswith("iebme"):
        te = time.perf_counter()
        recs = {g: iebme_record(f"synthetic.{g}", m, kk, k.sparsity, rng, bits=k.bits or 4,
                                outliers=k.outliers, act_bits=k.act_bits, reorder=k.reorder, union=k.union)
                for g, (m, kk) in groups.items()}
        info["encode_s"] = time.perf_counter() - te
        if log:
            log(f"  {kind}: encoded one block on the CPU in {info['encode_s']:.1f} s")
        with float16_activation_kernel(k.act_bits == 16):  # a W4A16 kind times the kernel, not the dense fallback
            for layer in range(spec.layers):  # one upload per block: no block reads another's weights from L2
                for g in groups:
                    install_group(model, layer, g, _runtime_linear(recs[g], device), splits[g])
    elif kind.startswith("tcbc"):
        weights = {g: sparse_fp16(m, kk, k.sparsity, rng) for g, (m, kk) in groups.items()}
        te = time.perf_counter()
        recs = {g: tcbc_record(f"synthetic.{g}", w, bits=k.bits) for g, w in weights.items()}
        info["encode_s"] = time.perf_counter() - te
        if log:
            log(f"  {kind}: encoded one block on the CPU in {info['encode_s']:.1f} s")
        # thresholds from the step's own inputs: the same weights dense (fp16), a prefill of random tokens
        dense = {g: torch.from_numpy(w).to(device) for g, w in weights.items()}  # one upload, a copy per block
        del weights
        for layer in range(spec.layers):
            for g, w in dense.items():
                install_group(model, layer, g, HalfLinear.of(w), splits[g])
        del dense
        taus = calibrate_taus(model, spec, k.dynamic, device, seed)
        clear_groups(model, spec)
        _free(device)
        info["tau"] = {g: [taus[(layer, g)] for layer in range(spec.layers)] for g in groups}
        info["tau_normal_input"] = normal_tau(k.dynamic)
        for layer in range(spec.layers):
            for g in groups:
                install_group(model, layer, g, _runtime_linear(with_tau(recs[g], taus[(layer, g)]), device),
                              splits[g])
    else:
        raise UserError(f"--kinds: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    _sync(device)
    info["build_s"] = time.perf_counter() - t0
    return info


def install_artifact_peer(model: nn.Module, spec: ModelSpec, kind: str, weights: dict, device: torch.device) -> dict:
    """fp16 / W4A16 peers of an artifact's own model: each block's groups from its decoded layers (stacked)."""
    t0 = time.perf_counter()
    clear_groups(model, spec)
    _free(device)
    splits = spec.splits()
    for layer in range(spec.layers):
        for g in GROUPS:
            w = torch.cat([weights[(layer, name)] for name in GROUP_MEMBERS[g]], 0).to(device)
            mod = HalfLinear.of(w) if kind == "fp16" else W4A16Linear.from_weight(w)
            install_group(model, layer, g, mod, splits[g])
    _sync(device)
    return {"kind": kind, "label": KINDS[kind].label + ", from the artifact's decoded layers",
            "build_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- one case


def layer_tau(mod: nn.Module) -> float | None:
    """The threshold a runtime layer applies at decode (its plan's), else None."""
    plan = getattr(mod, "plan", None)
    return getattr(plan, "tau", None) if getattr(plan, "sparse_inputs", False) else None


def prepare_case(model: nn.Module, spec: ModelSpec, batch: int, context: int, steps: int, device: torch.device,
                 seed: int = 0):
    """A static decoder of ``batch`` sequences prefilled with ``context`` random tokens by the model's current
    linears: (decoder, its first tokens, prefill seconds). Every kind of the case then steps from this state."""
    from ..runtime.decoder import StaticDecoder

    dec = StaticDecoder(model, batch, context + steps + 4)
    ids = torch.randint(0, spec.vocab, (batch, context), generator=torch.Generator().manual_seed(seed + context))
    t0 = time.perf_counter()
    logits = dec.prefill(ids.to(device))
    dec.tokens.copy_(logits.argmax(-1))
    _sync(device)
    return dec, dec.tokens.clone(), time.perf_counter() - t0


def run_case(model: nn.Module, spec: ModelSpec, kind: str, dec, start_tokens: torch.Tensor, context: int, steps: int,
             repeats: int, device: torch.device, seed: int = 0) -> dict:
    """Time one kind (the model's current linears) from a prepared case (:func:`prepare_case`): the graphed step,
    each group's linears alone, the lm_head alone; the byte floor."""
    from ..runtime.decoder import GraphedStep

    batch, max_len = dec.batch_size, dec.max_len
    dec.position.fill_(context)
    dec.tokens.copy_(start_tokens)
    # one eager step records every group's inputs (for the linears alone and the measured dynamic sparsity)
    inputs: dict = {}
    with recording(model, spec.layers, inputs):
        dec.step()
    dec.position.fill_(context)
    dec.tokens.copy_(start_tokens)
    launches = None
    if device.type == "cuda":  # the eager step's kernels against its linears' alone (issue 36, item 1)
        everything = [(mod, inputs[(layer, g, j)]) for layer in range(spec.layers) for g in GROUPS
                      for j, mod in enumerate(group_modules(model, layer, g))]
        step_names = kernel_names(GraphedStep(dec, greedy=True, capture=False), device)
        linear_names = kernel_names(lambda: [mod(x) for mod, x in everything], device)
        launches = outside_launches(step_names, linear_names, spec.layers)
        dec.position.fill_(context)
        dec.tokens.copy_(start_tokens)
    _sync(device)
    t0 = time.perf_counter()
    step = GraphedStep(dec, greedy=True)
    _sync(device)
    capture_s = time.perf_counter() - t0

    def reset() -> None:
        dec.position.fill_(context)

    step()  # a first replay (graph upload) outside the timed repeats
    step_ms = time_calls(step, steps, repeats, device, before=reset)
    del step

    # the decoder linears alone, one graph per group; then the lm_head alone
    linears: dict[str, float] = {}
    read: dict[str, int] = {}
    dyn: dict[str, float] = {}
    for g in GROUPS:
        calls = [(mod, inputs[(layer, g, j)]) for layer in range(spec.layers)
                 for j, mod in enumerate(group_modules(model, layer, g))]

        def run_group(calls=calls) -> None:
            for mod, x in calls:
                mod(x)

        linears[g] = time_calls(graphed(run_group, device), max(2, steps // 2), repeats, device)
        del run_group
        read[g], skipped = 0, []
        for mod, x in calls:
            tau = layer_tau(mod)
            inactive = 0.0
            if tau is not None:  # the spMspV kernel skips inputs with |x| <= tau in every row of a launch
                inactive = union_inactive(x, tau, mod)
                skipped.append(inactive)
            read[g] += module_read_bytes(mod, inactive)
        if skipped:
            dyn[g] = float(np.mean(skipped))
    xh = torch.randn(batch, spec.hidden, device=device, generator=torch.Generator(device).manual_seed(seed + 3))
    xh = xh.to(model.lm_head.weight.dtype)

    def run_head() -> None:
        model.lm_head(xh)

    head_ms = time_calls(graphed(run_head, device), max(2, steps // 2), repeats, device)
    lin_ms = sum(linears.values())
    dense = dense_read_bytes(model, batch)
    kv = spec.kv_bytes(batch, context, dec.k_cache.element_size())
    total = sum(read.values()) + sum(dense.values()) + kv
    floor_ms = total / PEAK_BW * 1e3
    row = {
        "spec": spec.name, "kind": kind, "batch": batch, "context": context,
        "step_ms": step_ms, "ms_per_token": step_ms / batch, "tokens_per_s": batch * 1e3 / step_ms,
        "linears_ms": {**linears, "total": lin_ms}, "lm_head_ms": head_ms,
        "outside_ms": step_ms - lin_ms, "outside_share": 1.0 - lin_ms / step_ms,
        "bytes": {"linears": read, "linears_total": sum(read.values()), **dense, "kv_cache": kv, "total": total},
        "floor_ms": floor_ms, "floor_pct": 100.0 * floor_ms / step_ms,
        "capture_s": capture_s, "cache_positions": max_len,
    }
    if dyn:
        row["dynamic_sparsity_measured"] = dyn
    if launches is not None:
        row["launches"] = launches
    return row


def hf_generate_ms(model: nn.Module, spec: ModelSpec, context: int, new: int, device: torch.device,
                   seed: int = 0) -> float:
    """Milliseconds per output token of transformers' eager ``generate`` (greedy, DynamicCache) at batch 1:
    (time for 1 + ``new`` tokens - time for 1) / ``new``, so the prompt's prefill cancels."""
    ids = torch.randint(0, spec.vocab, (1, context), generator=torch.Generator().manual_seed(seed + 11)).to(device)

    def gen(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, use_cache=True, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0

    gen(2)  # warm-up
    one = statistics.median(gen(1) for _ in range(3))
    many = statistics.median(gen(1 + new) for _ in range(3))
    return max(0.0, (many - one) * 1e3 / new)


# --------------------------------------------------------------------------------------------- checks


def check_peers(device: torch.device, seed: int = 0,
                kinds: tuple[str, ...] = ("w4a16", "iebme", "iebme16", "tcbc")) -> list[dict]:
    """Each kind's linear against the product of its own weights, on small shapes: W4A16 against its
    dequantized weights (bf16 activations); IE-BME through the runtime against quantized activations times the
    record's decoded weights; Tiled-CBC against the decoded weights with |x| <= tau zeroed at one row, every
    input at four. Returns [{'check', 'ok', 'err', 'tol'}]; an exception is a failed check, not the end."""
    from ...formats.arithmetic.activations import dequantize_activations, quantize_activations
    from ..model.rebuild import layer_weight
    from .e2e_peers import w4a16_dequantized

    out = []
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    m, k = 384, 512

    def w4a16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        q = torch.randint(0, 16, (m, k), device=device, dtype=torch.int32, generator=gen)
        s = torch.rand(k // GROUP_SIZE, m, device=device, generator=gen) * 0.01 + 0.005
        z = (torch.rand(k // GROUP_SIZE, m, device=device, generator=gen) - 0.5) * 0.01
        lin = W4A16Linear(q, s, z)
        return lin(x), (x.to(lin.dtype).float() @ w4a16_dequantized(lin, q, s, z).t()).half(), 0.01

    def iebme(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        rec = iebme_record("check.iebme", m, k, 0.5, rng)
        xq, sx = quantize_activations(x.float().cpu().numpy(), 4, GROUP_SIZE)
        xd = torch.from_numpy(dequantize_activations(xq, sx, GROUP_SIZE))
        return _runtime_linear(rec, device)(x), (xd @ torch.from_numpy(layer_weight(rec)).t()).half(), 2e-3

    def iebme16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        rec = iebme_record("check.iebme16", m, k, 0.5, rng, act_bits=16)
        with float16_activation_kernel(True):
            lin = _runtime_linear(rec, device)
        ref = (x.float().cpu() @ torch.from_numpy(layer_weight(rec)).t()).half()
        return lin(x), ref, 2e-3

    def tcbc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        w = sparse_fp16(m, k, 0.3, rng)
        tau = float(np.quantile(np.abs(x[0].float().cpu().numpy()), 0.3))
        xr = x.float().cpu()
        if x.shape[0] == 1:
            xr = torch.where(xr.abs() > tau, xr, torch.zeros_like(xr))
        ref = (xr @ torch.from_numpy(w.astype(np.float32)).t()).half()
        return _runtime_linear(tcbc_record("check.tcbc", w, tau), device)(x), ref, 2e-3

    names = {"w4a16": "w4a16", "iebme": "iebme-w4a4-50", "iebme16": "iebme-w4a16-50", "tcbc": "tcbc-fp16-30+30"}
    fns = {"w4a16": w4a16, "iebme": iebme, "iebme16": iebme16, "tcbc": tcbc}
    for n in (1, 4):
        x = torch.randn(n, k, device=device, generator=gen).half()
        for key in kinds:
            name = f"{names[key]} N={n}"
            try:
                got, ref, rel = fns[key](x)
                out.append(_close(name, got, ref, rel))
            except Exception as e:  # recorded as a failed check
                out.append({"check": name, "ok": False, "err": f"{type(e).__name__}: {e}", "tol": None})
    return out


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float) -> dict:
    got, ref = got.float().cpu(), ref.float().cpu()
    err = float((got - ref).abs().max())
    tol = rel * max(float(ref.abs().max()), 1e-6)
    return {"check": name, "ok": bool(torch.isfinite(got).all()) and err <= tol, "err": err, "tol": tol}


def _check_kind_steps(model, spec, kind, ids, device, seed) -> list[dict]:
    from ..runtime.decoder import GraphedStep, StaticDecoder

    out = []
    install_kind(model, spec, kind, device, seed)
    dec = StaticDecoder(model, 2, 24)
    dec.tokens.copy_(dec.prefill(ids).argmax(-1))
    pos, tok = dec.position.clone(), dec.tokens.clone()
    eager = dec.step().clone()
    dec.position.copy_(pos)
    dec.tokens.copy_(tok)
    g = GraphedStep(dec, greedy=False)
    replay = g().clone()
    out.append(_close(f"graphed step = eager step, {kind}", replay, eager, 1e-2))
    if kind == "fp16":
        logits = dec.prefill(ids)
        dec.tokens.copy_(logits.argmax(-1))
        step = GraphedStep(dec, greedy=True)
        seq = ids
        tokens_ok, logits_err = True, 0.0
        for _ in range(4):
            ref = model(seq).logits[:, -1].float()
            top2 = ref.topk(2, dim=-1).values
            sure = (top2[:, 0] - top2[:, 1]) > 1e-2
            tokens_ok &= bool(torch.equal(logits.argmax(-1)[sure], ref.argmax(-1)[sure]))
            logits_err = max(logits_err, float((logits.float() - ref).abs().max()))
            seq = torch.cat([seq, dec.tokens[:, None]], 1)
            logits = step()
        out.append({"check": "static decoder greedy tokens = transformers forward, fp16", "ok": tokens_ok,
                    "err": logits_err, "tol": None})
    return out


def check_steps(device: torch.device, kinds: tuple[str, ...], seed: int = 0) -> list[dict]:
    """On the tiny spec: (1) for every kind, the graphed step's logits equal an eager step's from the same state
    (the capture runs what eager runs); (2) with fp16 peers, 4 greedy tokens of the static decoder equal those
    of transformers' forward on the whole sequence (where its top two logits differ by more than the
    tolerance). An exception is a failed check of that kind."""
    spec = SPECS["tiny"]
    out = []
    model = build_model(spec, device, seed=seed, linears=False)
    ids = torch.randint(0, spec.vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    for kind in kinds:
        try:
            out += _check_kind_steps(model, spec, kind, ids, device, seed)
        except Exception as e:  # recorded as a failed check
            out.append({"check": f"graphed step = eager step, {kind}", "ok": False,
                        "err": f"{type(e).__name__}: {e}", "tol": None})
            _free(device)
    clear_groups(model, spec)
    del model
    _free(device)
    return out


# ------------------------------------------------------------------------------------------- reporting


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_<baseline> = baseline step / this step, for rows of the same spec, batch and context."""
    by = {(r["spec"], r["kind"], r["batch"], r["context"]): r for r in rows if "step_ms" in r}
    for r in rows:
        if "step_ms" not in r:
            continue
        for base in BASELINES:
            b = by.get((r["spec"], base, r["batch"], r["context"]))
            r[f"speedup_vs_{base}"] = None if b is None else b["step_ms"] / r["step_ms"]
            r[f"linears_speedup_vs_{base}"] = (None if b is None else
                                               b["linears_ms"]["total"] / r["linears_ms"]["total"])
        c = by.get((r["spec"], CONTROLS.get(r["kind"]), r["batch"], r["context"]))
        if c is not None:  # what the sparsity buys: the same kind at 0% / this step
            r["speedup_vs_control"] = c["step_ms"] / r["step_ms"]
            r["control"] = c["kind"]


def evaluate_targets(rows: list[dict], device: torch.device) -> list[dict]:
    by = {(r["spec"], r["kind"], r["batch"], r["context"]): r for r in rows if "step_ms" in r}
    out = []
    for spec, ctx, kind, base, batches, need in TARGETS:
        for b in batches:
            r = by.get((spec, kind, b, ctx))
            what = (f"{kind} {spec} batch {b} context {ctx}: step "
                    + (f">= {need}x {base}" if need != 1.0 else f"faster than {base}"))
            got = None if r is None else r.get(f"speedup_vs_{base}")
            status = ("not measured" if got is None else "not a GPU figure" if device.type != "cuda"
                      else "met" if (got >= need if need != 1.0 else got > 1.0) else "missed")
            out.append({"target": what, "speedup": got, "needed": need, "status": status})
    return out


def explain(rows: list[dict]) -> list[str]:
    """One line per (kind, case) that is slower than a baseline or below a target: where the time goes."""
    by = {(r["spec"], r["kind"], r["batch"], r["context"]): r for r in rows if "step_ms" in r}
    need = {(s, c, k, base, b): x for s, c, k, base, bs, x in TARGETS for b in bs}
    lines = []
    controls = set(CONTROLS.values())
    for r in rows:
        if "step_ms" not in r or r["kind"] in BASELINES or r["kind"] in controls:
            continue
        c = r.get("control")
        if c is not None and r["speedup_vs_control"] < 1.5:
            cr = by[(r["spec"], c, r["batch"], r["context"])]
            lines.append(f"{r['kind']} {r['spec']} B={r['batch']} ctx={r['context']}: only "
                         f"{r['speedup_vs_control']:.2f}x its 0% control {c} "
                         f"(linears {r['linears_ms']['total']:.3f} vs "
                         f"{cr['linears_ms']['total']:.3f} ms, {r['bytes']['linears_total'] / 1e9:.2f} vs "
                         f"{cr['bytes']['linears_total'] / 1e9:.2f} GB): the sparsity is not turned into time.")
        for base in BASELINES:
            b = by.get((r["spec"], base, r["batch"], r["context"]))
            if b is None:
                continue
            sp = b["step_ms"] / r["step_ms"]
            want = need.get((r["spec"], r["context"], r["kind"], base, r["batch"]), 1.0)
            if sp >= want and not (want == 1.0 and sp <= 1.0):
                continue
            lin, blin = r["linears_ms"], b["linears_ms"]
            worst = max(GROUPS, key=lambda g, lin=lin, blin=blin: lin[g] / max(blin[g], 1e-9))
            line = (f"{r['kind']} {r['spec']} B={r['batch']} ctx={r['context']}: {sp:.2f}x {base} "
                    f"(wanted {'>' if want == 1.0 else '>='} {want}x). Linears {lin['total']:.3f} ms vs "
                    f"{blin['total']:.3f} ms ({blin['total'] / lin['total']:.2f}x); outside the linears "
                    f"{r['outside_ms']:.3f} ms ({100 * r['outside_share']:.0f}% of the step) vs {b['outside_ms']:.3f}"
                    f" ms; worst group {worst}: {lin[worst]:.3f} ms vs {blin[worst]:.3f} ms.")
            if want > 1.0:
                allowed = b["step_ms"] / want - r["outside_ms"]
                line += (f" To reach {want}x with this outside part the linears must take <= {allowed:.3f} ms"
                         + (" (impossible: the outside part alone is too slow)." if allowed <= 0 else "."))
            lines.append(line)
    return lines


def format_table(res: dict) -> str:
    rows = [r for r in res["rows"] if "step_ms" in r]
    head = (f"{'spec':<10} {'ctx':>5} {'B':>2} {'kind':<16} {'step ms':>8} {'tok/s':>8} {'vs fp16':>7} "
            f"{'vs w4a16':>8} {'vs 0%':>6} {'qkv':>7} {'o':>7} {'gateup':>7} {'down':>7} {'outside':>7} "
            f"{'floor ms':>8} {'%floor':>6} {'launch/L':>8}")
    out = [f"unionsparse bench --e2e: {res['label']}", head, "-" * len(head)]
    rows.sort(key=lambda r: (r["spec"], r["context"], r["batch"], list(res["kinds"]).index(r["kind"])
                             if r["kind"] in res["kinds"] else -1))

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for r in rows:
        lin = r["linears_ms"]
        out.append(f"{r['spec']:<10} {r['context']:>5} {r['batch']:>2} {r['kind']:<16} {r['step_ms']:>8.3f} "
                   f"{r['tokens_per_s']:>8.1f} {x(r.get('speedup_vs_fp16')):>7} {x(r.get('speedup_vs_w4a16')):>8} "
                   f"{x(r.get('speedup_vs_control')):>6} "
                   f"{lin['qkv']:>7.3f} {lin['o']:>7.3f} {lin['gateup']:>7.3f} {lin['down']:>7.3f} "
                   f"{100 * r['outside_share']:>6.0f}% {r['floor_ms']:>8.3f} {r['floor_pct']:>5.0f}% "
                   f"{format(r['launches']['outside_per_layer'], '.1f') if 'launches' in r else '-':>8}")
    for h in res.get("hf_generate", []):
        out.append(f"{h['spec']:<10} {h['context']:>5} {1:>2} {'HF generate':<16} {h['ms_per_token']:>8.3f} "
                   f"{1e3 / h['ms_per_token'] if h['ms_per_token'] else float('nan'):>8.1f}  ({h['label']})")
    out.append("linears: each group's modules of every block alone, ms per step; outside: the step less them "
               "(attention, norms, lm_head, greedy choice); floor: bytes read / "
               + (f"{res['copy_bw'] / 1e12:.2f} TB/s (this device's measured copy bandwidth)" if res.get("copy_bw")
                  else f"{PEAK_BW / 1e12:.2f} TB/s (nominal)")
               + "; launch/L: kernel launches outside the linears per layer (eager step, profiler)")
    for r in rows:
        if "launches" in r and r["batch"] == rows[0]["batch"] and r["context"] == rows[0]["context"]:
            la = r["launches"]
            us = la["outside_us_by_kind"]
            kinds = ", ".join(f"{k} {v} ({us[k]:.0f} us)" for k, v in la["outside_by_kind"].items())
            out.append(f"launches outside the linears per step (GPU time, eager), {r['spec']} {r['kind']} "
                       f"B={r['batch']} ctx={r['context']}: {kinds}")
    for e in res.get("errors", []):
        out.append(f"ERROR {e['where']}: {e['error']}")
    for s in res.get("skipped", []):
        out.append(f"skipped {s}")
    for c in res.get("checks", []):
        if not c["ok"]:
            detail = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("check", "ok"))
            out.append(f"CHECK FAILED {c['check']}: {detail}")
    if res.get("targets"):
        out.append("targets (issues 28 and 36):")
        for t in res["targets"]:
            sp = "-" if t["speedup"] is None else f"{t['speedup']:.2f}x"
            out.append(f"  {t['status']:<16} {t['target']}: {sp}")
    if res.get("analysis"):
        out.append("where it loses, from the breakdown:")
        out.extend(f"  {line}" for line in res["analysis"])
    return "\n".join(out)


def record_speed(artifact: str, res: dict):
    """The artifact's step times, and its ratios to its fp16 and W4A16 peers, beside it (``inspect`` shows them)."""
    from ..artifact.ownership import store_attrs
    from ..report.figures import record

    if store_attrs(Path(artifact)) is None:
        raise UserError(f"--record: {artifact} is not a unionsparse artifact (figures are kept beside artifacts)")
    gpu = res["machine"].get("gpu") or "GPU"
    path = None
    for r in res["rows"]:
        if r["kind"] != ARTIFACT_KIND:
            continue
        value = {"ms_per_step": round(r["step_ms"], 4), "tokens_per_s": round(r["tokens_per_s"], 1)}
        for base in BASELINES:
            if r.get(f"speedup_vs_{base}") is not None:
                value[f"vs_{base}"] = round(r[f"speedup_vs_{base}"], 3)
        path = record(artifact, "speed", f"bench --e2e, {gpu}, batch {r['batch']}, context {r['context']}", value)
    return path


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__, "device": device.type}
    try:
        import cupy as cp

        info["cupy"] = cp.__version__
    except Exception:  # no CuPy here
        info["cupy"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda)
        try:
            import subprocess

            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.mem", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:  # no nvidia-smi
            info["nvidia_smi"] = f"unavailable: {type(e).__name__}"
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def machine_slug(info: dict) -> str:
    if info.get("gpu"):
        name = info["gpu"].lower()
        for known in ("h200", "h100", "a100", "l40s", "b200"):
            if known in name:
                return known
        return "".join(c if c.isalnum() else "-" for c in name).strip("-")
    return "cpu"


def write_results(res: dict, out_dir: str | Path) -> Path:
    """``out_dir/e2e-<machine>-<date>.json`` (a -2, -3... suffix rather than overwrite) and the table beside it."""
    out_dir = Path(out_dir)
    with environment_errors("--out", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"e2e-{machine_slug(res['machine'])}-{res['date'][:10]}"
    path, i = out_dir / f"{stem}.json", 1
    while path.exists():
        i += 1
        path = out_dir / f"{stem}-{i}.json"
    atomic_write(path, json.dumps(res, indent=2, default=str) + "\n", "--out")
    atomic_write(path.with_suffix(".md"), "```\n" + format_table(res) + "\n```\n", "--out")
    return path


def write_table(out_dir: str | Path, stem: str, text: str, data: dict) -> None:
    """A benchmark script's Markdown table ``out_dir/<stem>.md`` and its figures ``<stem>.json``, each written whole."""
    out_dir = Path(out_dir)
    with environment_errors("--out", out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / f"{stem}.md", text, "--out")
    atomic_write(out_dir / f"{stem}.json", json.dumps(data, indent=2, default=str) + "\n", "--out")


# ------------------------------------------------------------------------------------------- the command


def e2e_command(artifact: str | Artifact | None = None, specs: str | None = None, batches: str | None = None,
                contexts: str | None = None, kinds: str | None = None, steps: int | None = None,
                device: str = "cuda", out_dir: str | None = None, time_budget: float | None = None,
                hf_generate: bool = True, checks: bool = True, seed: int = 0, record: bool = False,
                log: Callable[[str], None] | None = None, verify: bool = True) -> dict:
    """What `unionsparse bench --e2e` runs; returns the result (see the module docstring). ``artifact``: a path, or
    the Artifact the command opened (used as it is: opened once). ``record``: keep the artifact's time per token
    beside it (``OUT.zarr.figures.json``, shown by ``inspect``; GPU only). ``verify``: the artifact's files are
    checked against its manifest as they are read (a path only)."""
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device: unknown value {device!r} (choose from cuda, cpu)")
    if record and artifact is None:
        raise UserError("--record: keeps an ARTIFACT's figures beside it; give the artifact")
    if record and device != "cuda":
        raise UserError("--record: CPU timings are not performance figures and are not recorded; run on a GPU")
    if device == "cuda":
        why = gpu_problem()
        if why is not None:
            raise UserError(f"bench --e2e needs a CUDA GPU: {why}; --device cpu runs the CPU smoke mode "
                            "(--spec tiny, not a performance figure)")
    dev = torch.device(device)
    d_batches, d_contexts, d_steps, repeats = DEFAULTS[device]
    batch_list = parse_ints(batches, "--batch", d_batches)
    context_list = parse_ints(contexts, "--context", d_contexts)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UserError(f"--steps must be a positive integer, got {steps!r}")
    steps = steps or d_steps
    kind_list = parse_names(kinds, "--kinds", tuple(KINDS), DEFAULT_KINDS)
    if artifact is None:
        spec_list = parse_names(specs, "--spec", tuple(SPECS), GPU_SPECS if device == "cuda" else ("tiny",))
        if device == "cpu" and spec_list != ("tiny",):
            raise UserError("--device cpu is a smoke mode for --spec tiny only (not a performance figure); "
                            "the 7B/8B specs need a GPU")
    else:
        if specs is not None:
            raise UserError("--spec: an ARTIFACT brings its own model (leave --spec out)")
        bad = [k for k in kind_list if k not in BASELINES]
        if kinds is not None and bad:
            raise UserError(f"--kinds: with an ARTIFACT the peers are {', '.join(BASELINES)}, got {bad[0]!r}")
        spec_list = ()
    kind_list = tuple(dict.fromkeys(("fp16", *kind_list)))  # fp16 first: every ratio needs it
    say = log or (lambda _m: None)
    t_start = time.perf_counter()
    deadline = None if time_budget is None else t_start + float(time_budget)
    res: dict = {
        "benchmark": "e2e", "label": CPU_LABEL if device == "cpu" else "GPU, CUDA-graph decode steps",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "command": _command_line(),
        "machine": machine_info(dev), "peak_bw": PEAK_BW,
        "settings": {"batches": batch_list, "contexts": context_list, "steps": steps, "repeats": repeats,
                     "seed": seed, "time_budget_s": time_budget, "group_size": GROUP_SIZE},
        "kinds": [ARTIFACT_KIND, *BASELINES] if artifact is not None else list(kind_list),
        "kind_labels": {k: KINDS[k].as_dict() for k in (BASELINES if artifact is not None else kind_list)},
        "models": [], "rows": [], "hf_generate": [], "checks": [], "errors": [], "skipped": [],
    }
    partial = None
    if out_dir is not None:  # rows so far, rewritten after every case: a killed run keeps what it measured
        partial = Path(out_dir) / "e2e-partial.json"
        with environment_errors("--out", partial.parent):
            partial.parent.mkdir(parents=True, exist_ok=True)
        res["_save"] = lambda: atomic_write(partial, json.dumps({k: v for k, v in res.items() if k != "_save"},
                                                                indent=2, default=str) + "\n", "--out")
    with torch.no_grad():
        if checks:
            t0 = time.perf_counter()
            try:
                res["checks"] = check_peers(dev, seed)
                res["checks"] += check_steps(dev, kind_list, seed)
            except Exception as e:  # recorded: a failing check must not hide the timings
                res["errors"].append({"where": "checks", "error": f"{type(e).__name__}: {e}"})
            if dev.type == "cuda":
                _act_quant_fallback(res, dev, seed, say)
                _glue_check(res, dev, seed, say)
            bad = [c["check"] for c in res["checks"] if not c["ok"]]
            if res.get("_save"):
                res["_save"]()
            say(f"checks: {len(res['checks']) - len(bad)}/{len(res['checks'])} passed in "
                f"{time.perf_counter() - t0:.1f} s" + (f"; FAILED: {', '.join(bad)}" if bad else ""))
        if artifact is not None:
            _run_artifact(res, artifact, dev, batch_list, context_list, steps, repeats, hf_generate, seed, deadline,
                          say, verify)
        for name in spec_list:
            _run_spec(res, SPECS[name], kind_list, dev, batch_list, context_list, steps, repeats, hf_generate, seed,
                      deadline, say)
    if dev.type == "cuda":
        res["copy_bw"] = copy_bandwidth(dev)
        apply_floor(res["rows"], res["copy_bw"])
    add_ratios(res["rows"])
    res["targets"] = evaluate_targets(res["rows"], dev) if artifact is None else []
    res["analysis"] = explain(res["rows"]) if dev.type == "cuda" else [f"not analysed: {CPU_LABEL}"]
    res["wall_s"] = time.perf_counter() - t_start
    res.pop("_save", None)
    if record:
        res["recorded_to"] = str(record_speed(str(getattr(artifact, "path", artifact)), res))
    if out_dir is not None:
        res["written_to"] = str(write_results(res, out_dir))
        partial.unlink(missing_ok=True)
    return res


def _act_quant_fallback(res: dict, dev: torch.device, seed: int, say) -> None:
    """When the IE-BME checks fail with the one-launch activation quantizer (``kernels/act_quant.cu``, new) and
    pass with the formats' torch functions, time IE-BME with the latter (recorded in the settings)."""
    from ..runtime.kernel_op import KernelOp

    res["settings"]["iebme_act_quant"] = KernelOp.act_quant
    failed = [c for c in res["checks"] if c["check"].startswith("iebme") and not c["ok"]]
    if not failed or KernelOp.act_quant != "kernel":
        return
    KernelOp.act_quant = "torch"
    again = check_peers(dev, seed, kinds=("iebme",))
    for c in again:
        c["check"] += ", act_quant torch"
    res["checks"] += again
    if all(c["ok"] for c in again):
        res["settings"]["iebme_act_quant"] = "torch (the one-launch kernel failed its check)"
        say("IE-BME: the one-launch activation quantizer failed its check; timing with the torch quantizer")
    else:
        KernelOp.act_quant = "kernel"


def _glue_check(res: dict, dev: torch.device, seed: int, say) -> None:
    """The decode step's glue kernels (``kernels/glue.cu``, new) against the torch glue on the tiny spec's fp16
    model (prefill and 4 greedy steps, logits to fp16 tolerance, the same tokens); on a failure every kind is
    timed with the torch glue (recorded in the settings: it is the same for all kinds). Then the quantizing
    producers (``kernels/norm_quant.cu``) against IE-BME quantizing its own inputs (bit for bit); on a failure
    IE-BME is timed quantizing its own inputs."""
    from ..runtime.decoder import GraphedStep, StaticDecoder

    res["settings"]["glue"] = StaticDecoder.GLUE
    if StaticDecoder.GLUE != "kernels":
        return
    model = build_model(SPECS["tiny"], dev, seed=seed)
    ids = torch.randint(0, SPECS["tiny"].vocab, (2, 12), device=dev, generator=torch.Generator(dev).manual_seed(seed))
    rows = {}
    try:
        for mode in ("kernels", "torch"):
            dec = StaticDecoder(model, 2, 32)
            dec.glue = mode
            out = [dec.prefill(ids)]
            dec.tokens.copy_(out[0].argmax(-1))
            step = GraphedStep(dec, greedy=True)
            out += [step().clone() for _ in range(4)]
            rows[mode] = torch.stack(out)
        err = float((rows["kernels"] - rows["torch"]).abs().max())
        ok = err <= 0.02 * float(rows["torch"].abs().max()) + 0.02 and torch.equal(
            rows["kernels"].argmax(-1), rows["torch"].argmax(-1))
        detail = f"max |kernels - torch| {err:.3g}"
    except Exception as e:  # recorded, then the torch glue
        ok, detail = False, f"{type(e).__name__}: {e}"
    res["checks"].append({"check": "glue kernels against torch glue (tiny, fp16)", "ok": ok, "detail": detail})
    if not ok:
        StaticDecoder.GLUE = "torch"
        res["settings"]["glue"] = "torch (the glue kernels failed their check)"
        say(f"glue kernels failed their check ({detail}); timing every kind with the torch glue")
        return
    # quantizing producers (kernels/norm_quant.cu) hand IE-BME the codes it would make itself: the same logits
    res["settings"]["quantizing_producers"] = StaticDecoder.PREQUANT
    try:
        install_kind(model, SPECS["tiny"], "iebme-w4a4-50", dev, seed)
        for pre in (True, False):
            dec = StaticDecoder(model, 2, 32)
            dec.prequant = pre
            out = [dec.prefill(ids)]
            dec.tokens.copy_(out[0].argmax(-1))
            out.append(dec.step().clone())
            rows[pre] = torch.stack(out)
        ok = torch.equal(rows[True], rows[False])
        detail = f"max |producers - linears| {float((rows[True] - rows[False]).abs().max()):.3g}"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    res["checks"].append({"check": "quantizing producers against the linears' own quantization (tiny, IE-BME)",
                          "ok": ok, "detail": detail})
    if not ok:
        StaticDecoder.PREQUANT = False
        res["settings"]["quantizing_producers"] = "off (the kernels failed their check)"
        say(f"quantizing producers failed their check ({detail}); IE-BME quantizes its own inputs")


def _command_line() -> str:
    import shlex

    if Path(sys.argv[0]).name in ("unionsparse", "cli.py", "__main__.py"):
        return "unionsparse " + shlex.join(sys.argv[1:])
    return shlex.join(sys.argv)


def _over(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _error(res: dict, where: str, e: BaseException, say) -> None:
    res["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}"})
    say(f"  {where}: ERROR {type(e).__name__}: {e}")


def _matrix(res, model, spec, sets: dict, dev, batch_list, context_list, steps, repeats, seed, deadline,
            say) -> None:
    """Every (context, batch): one static decoder prefilled once by the fp16 peers (the prefill is not timed:
    through the sparse kinds' N <= 32 kernels a 16k-token prefill would take minutes), then each kind's
    linears put in place and its step captured and timed from that same state, one after the other."""
    from .e2e_models import restore_linears

    save = res.get("_save") or (lambda: None)
    for context in context_list:
        for batch in batch_list:
            where = f"{spec.name} batch {batch} context {context}"
            if _over(deadline):
                res["skipped"].append(f"{where}: time budget spent")
                continue
            restore_linears(model, spec, sets["fp16"])
            try:
                dec, start, prefill_s = prepare_case(model, spec, batch, context, steps, dev, seed)
            except UserError:
                raise
            except Exception as e:  # one case failing must not lose the others
                _error(res, f"{where} prefill", e, say)
                _free(dev)
                save()
                continue
            for kind, snap in sets.items():
                if _over(deadline):
                    res["skipped"].append(f"{where} {kind}: time budget spent")
                    continue
                restore_linears(model, spec, snap)
                try:
                    row = run_case(model, spec, kind, dec, start, context, steps, repeats, dev, seed)
                except UserError:
                    raise
                except Exception as e:
                    _error(res, f"{where} {kind}", e, say)
                    _free(dev)
                    save()
                    continue
                row["prefill_s"], row["prefill_by"] = prefill_s, "fp16"
                res["rows"].append(row)
                save()
                say(f"  {where} {kind}: step {row['step_ms']:.3f} ms, linears {row['linears_ms']['total']:.3f} ms, "
                    f"outside {100 * row['outside_share']:.0f}%, floor {row['floor_pct']:.0f}%")
            del dec
            _free(dev)


def _hf_generate(res, model, spec, sets, dev, context_list, steps, seed, deadline, say) -> None:
    from .e2e_models import restore_linears

    restore_linears(model, spec, sets["fp16"])
    for context in context_list:
        if _over(deadline):
            res["skipped"].append(f"{spec.name} HF generate context {context}: time budget spent")
            continue
        try:
            ms = hf_generate_ms(model, spec, context, max(2, steps), dev, seed)
        except Exception as e:
            _error(res, f"{spec.name} HF generate context {context}", e, say)
            continue
        res["hf_generate"].append({"spec": spec.name, "kind": "fp16", "batch": 1, "context": context,
                                   "ms_per_token": ms, "label": HF_LABEL})


def _run_spec(res, spec, kind_list, dev, batch_list, context_list, steps, repeats, hf_generate, seed, deadline,
              say) -> None:
    """Build every kind of ``spec`` once (all stay resident), then the matrix."""
    from .e2e_models import snapshot_linears

    t0 = time.perf_counter()
    model = build_model(spec, dev, seed=seed, linears=False)
    _sync(dev)
    facts = {"spec": spec.as_dict(), "build_s": time.perf_counter() - t0, "kinds": {}}
    res["models"].append(facts)
    say(f"{spec.name}: model built in {facts['build_s']:.1f} s")
    sets: dict = {}
    for kind in kind_list:
        if _over(deadline):
            res["skipped"].append(f"{spec.name} {kind}: time budget spent")
            continue
        try:
            info = install_kind(model, spec, kind, dev, seed, say)
        except UserError:
            raise
        except Exception as e:
            _error(res, f"{spec.name} {kind} build", e, say)
            continue
        sets[kind] = snapshot_linears(model, spec)
        facts["kinds"][kind] = info
        say(f"{spec.name} {kind}: built in {info['build_s']:.1f} s")
    if "fp16" in sets:
        if hf_generate:
            _hf_generate(res, model, spec, sets, dev, context_list, steps, seed, deadline, say)
        _matrix(res, model, spec, sets, dev, batch_list, context_list, steps, repeats, seed, deadline, say)
    else:
        res["skipped"].append(f"{spec.name}: no fp16 peers (they prefill every case and every ratio needs them)")
    clear_groups(model, spec)
    del model, sets
    _free(dev)


def artifact_spec(model: nn.Module, name: str) -> ModelSpec:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    return ModelSpec(name, int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers), heads,
                     int(getattr(cfg, "num_key_value_heads", None) or heads), int(cfg.vocab_size))


def _run_artifact(res, path, dev, batch_list, context_list, steps, repeats, hf_generate, seed, deadline,
                  say, verify: bool = True) -> None:
    """The artifact's own model (its stored layers as the runtime runs them: one launch per stored linear), then
    fp16 and W4A16 peers built from its decoded layers (Q/K/V and gate/up stacked). ``path``: a path or an opened
    Artifact."""
    from ..model.rebuild import layer_weight
    from ..runtime import load
    from ..runtime.decoder import StaticDecoder
    from ..runtime.fused import SharedInputMember
    from ..runtime.linear import CompressedLinear
    from .e2e_models import snapshot_linears

    t0 = time.perf_counter()
    art = path if isinstance(path, Artifact) else Artifact(path, verify=verify)
    path = art.path
    rt = load(art, device=dev.type, fuse=True)  # Q/K/V and gate/up stacked, as for every peer
    model = rt.model
    why = StaticDecoder.unsupported(model)
    if why is not None:
        raise UserError(f"{path}: the static decoder cannot run this model: {why}")
    spec = artifact_spec(model, Path(str(path)).name)
    if spec.head_dim * spec.heads != spec.hidden or getattr(model.config, "head_dim", spec.head_dim) != spec.head_dim:
        raise UserError(f"{path}: head_dim differs from hidden / heads; bench --e2e needs the LLaMA layout")
    stored = set(art.layer_names)
    weights: dict = {}
    for layer in range(spec.layers):
        for names in GROUP_MEMBERS.values():
            for name in names:
                full = f"model.layers.{layer}.{name}"
                mod = model.get_submodule(full)
                if full in stored:
                    rec = art.read_layer(full)
                    op = mod.shared.stacked if isinstance(mod, SharedInputMember) else mod
                    if isinstance(op, CompressedLinear):  # the byte floor: the stored arrays it computes from
                        op.__dict__.setdefault("_bench_records", []).append(rec)
                    weights[(layer, name)] = torch.from_numpy(layer_weight(rec)).half()
                else:
                    weights[(layer, name)] = mod.weight.detach().half().cpu()
    fusion = getattr(model, "unionsparse_fusion", {})
    label = (f"the artifact as runtime.load(fuse=True) builds it: {fusion.get('ops', '?')} compressed ops for "
             f"{fusion.get('layers', '?')} stored linears")
    facts = {"spec": spec.as_dict(), "artifact": str(path), "load_s": time.perf_counter() - t0,
             "kinds": {ARTIFACT_KIND: {"label": label, "fusion": fusion}}}
    res["models"].append(facts)
    say(f"{spec.name}: artifact loaded and decoded in {facts['load_s']:.1f} s")
    sets = {ARTIFACT_KIND: snapshot_linears(model, spec)}
    for kind in BASELINES:
        if kind == "w4a16":
            try:
                for m, k in spec.groups().values():
                    check_w4a16_shape(m, k)
            except ValueError as e:
                res["skipped"].append(f"{spec.name} w4a16: {e}")
                continue
        facts["kinds"][kind] = install_artifact_peer(model, spec, kind, weights, dev)
        sets[kind] = snapshot_linears(model, spec)
    del weights
    if hf_generate:
        _hf_generate(res, model, spec, sets, dev, context_list, steps, seed, deadline, say)
    _matrix(res, model, spec, sets, dev, batch_list, context_list, steps, repeats, seed, deadline, say)
    for r in res["rows"]:
        if r["spec"] == spec.name and r["kind"] == ARTIFACT_KIND:
            r["label"] = label
    del model, rt, sets
    _free(dev)
