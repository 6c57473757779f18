"""One switch of the decode step, off and on, on whole decode steps in one process (`bench --e2e` cases).

``--switch pdl``: programmatic dependent launch of the step's kernels (kernels/pdl.cuh; on by default on sm_90):
each of the step's own kernels is scheduled while the kernel before it still runs and waits for it with
``griddepcontrol.wait``; IE-BME also issues its weight-only prologue before the wait.
``--switch rope``: a decode step's rotary embedding and KV-cache write inside the attention launch
(``StaticDecoder.ROPE_IN_ATTENTION``, kernels/attention.cu): one launch a layer fewer.
``--switch attention``: decode attention's split form (global partials, the last block combines) against its
cluster form (``attention.CLUSTER``: the chunks of a head combined through distributed shared memory).
``--switch early``: the IE-BME kernel letting the next kernel start only at its end (study build ``IEBME_TRIGGER=0``)
or once its weights have landed (the default), then with decode attention also loading the cache's earlier slots, the
position and the rotary tables before its wait (``attention.EARLY``, attention.cu's ATTN_EARLY; the default).
``--switch head``: the final norm's rows through the model's lm_head (cuBLAS), ``.float()`` and ``torch.argmax``
against lm_head and the greedy choice in one launch (``StaticDecoder.HEAD_KERNEL``, kernels/lm_head.cu).
``--switch norms``: the norms (and the quantizing SiLU·mul) reading their weight and channel permutation after
their wait (study build ``NORM_EARLY=0``), or copying them into shared memory before it (kernels/pdl.cuh,
``early_copy``; the default since 2026-12-07).
``--switch side-cta``: the IE-BME kernel's outlier side product added by the first K chunk's CTA (the shipped build) or
by the last one's (study build ``IEBME_SIDE_LAST=1``: often the shortest chunk, so the side may hide behind the
longer ones).
``--switch splits``: the IE-BME launches' K chunks as the chunk rule picks them (default) or at most 4 or 2
(``LaunchSettings.max_splits``: fewer, longer CTAs, fewer prologues and split-K exits; kernels/iebme_spmm.py).
``--switch int4-decode``: the Tiled-CBC spMspV of 4-bit codes decoding each set bit under a predicate (mode 0, the
default) or scattering each bitmap byte's codes with byte permutes, 16 rows a lane (mode 4; tiled_cbc_spmspv.cu).
``--switch source --baseline KERNEL=FILE``: kernel ``KERNEL`` (a ``kernels/*.cu`` stem) compiled from ``FILE``, another
revision of its source with the same launch arguments (e.g. ``git show REV:kernels/attention.cu > .ab/attention.cu``),
against the shipped file (study builds, kernels/study.py).

Both settings run with the step checks on, side by side; the tables and the JSON go to ``--out``:

    python benchmarks/step_ab.py --switch pdl|rope|attention|early|head|norms|side-cta|splits|int4-decode --out DIR
    python benchmarks/step_ab.py --switch source --baseline attention=.ab/attention.cu --out DIR
    (a CUDA machine; glue_h200.sh, attention_h200.sh)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest.mock import patch

from unionsparse.compressor.bench.e2e import case_arguments, e2e_command, format_table
from unionsparse.compressor.runtime.decoder import StaticDecoder
from unionsparse.kernels import attention, iebme_spmm, study, tiled_cbc_spmspv
from unionsparse.kernels.cluster_launch import programmatic_launches

KINDS = "fp16,w4a16,iebme-w4a4-50-o128,iebme-w4a4-0-o128,iebme-w4a4-50-o128-dp,iebme-w4a4-50,iebme-w4a8-50"


def _set(owner: object, name: str, value: object) -> contextlib.AbstractContextManager:
    """``owner.name = value`` for the duration of a ``with`` block."""
    return patch.object(owner, name, value)


@contextlib.contextmanager
def _early(on: bool, trigger: bool) -> Iterator[None]:
    build = None if trigger else study.Build(defines=(("IEBME_TRIGGER", 0),))
    with _set(attention, "EARLY", on), study.building("iebme_spmm", build):
        yield


@contextlib.contextmanager
def _norms(early: bool) -> Iterator[None]:
    build = None if early else study.Build(defines=(("NORM_EARLY", 0),))
    with study.building("glue", build), study.building("norm_quant", build):
        yield


@contextlib.contextmanager
def _side_cta(last: bool) -> Iterator[None]:
    with study.building("iebme_spmm", study.Build(defines=(("IEBME_SIDE_LAST", int(last)),))):
        yield


@contextlib.contextmanager
def _max_splits(bound: int | None) -> Iterator[None]:
    old = iebme_spmm.use_settings(iebme_spmm.LaunchSettings(max_splits=bound))
    try:
        yield
    finally:
        iebme_spmm.use_settings(old)


BASELINE: dict[str, str] = {}  # --baseline: kernel stem -> the source file of its other revision


@contextlib.contextmanager
def _source(baseline: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for kernel, path in BASELINE.items():
            stack.enter_context(study.building(kernel, study.Build(source=path) if baseline else None))
        yield


SWITCHES: dict[str, tuple[tuple[str, Callable[[], contextlib.AbstractContextManager]], ...]] = {
    "pdl": (("pdl off", lambda: programmatic_launches(False)),
            ("pdl on (default)", lambda: programmatic_launches(None))),
    "rope": (("rotary + KV write: own launch", lambda: _set(StaticDecoder, "ROPE_IN_ATTENTION", False)),
             ("rotary + KV write: in attention", lambda: _set(StaticDecoder, "ROPE_IN_ATTENTION", True))),
    "attention": (("attention: split, global partials", lambda: _set(attention, "CLUSTER", False)),
                  ("attention: cluster, shared-memory combine", lambda: _set(attention, "CLUSTER", True))),
    "early": (("attention waits first; IE-BME lets the next kernel start at its end", lambda: _early(False, False)),
              ("... IE-BME lets it start once its weights landed", lambda: _early(False, True)),
              ("... and attention loads its cache before the wait (default)", lambda: _early(True, True))),
    "norms": (("norms and SiLU·mul read their weight and permutation after the wait", lambda: _norms(False)),
              ("... copied into shared memory before it (default)", lambda: _norms(True))),
    "side-cta": (("outlier side added by the first K chunk's CTA (default)", lambda: _side_cta(False)),
                 ("... by the last K chunk's CTA", lambda: _side_cta(True))),
    "splits": (("IE-BME K chunks: the chunk rule's (default)", lambda: _max_splits(None)),
               ("... at most 4", lambda: _max_splits(4)), ("... at most 2", lambda: _max_splits(2))),
    "int4-decode": (("Tiled-CBC int4: predicated rows (mode 0, default)",
                     lambda: _set(tiled_cbc_spmspv, "DEFAULT_MODES", {**tiled_cbc_spmspv.DEFAULT_MODES, 4: 0})),
                    ("... byte-permute scatter (mode 4)",
                     lambda: _set(tiled_cbc_spmspv, "DEFAULT_MODES", {**tiled_cbc_spmspv.DEFAULT_MODES, 4: 4}))),
    "source": (("baseline source (--baseline)", lambda: _source(True)), ("shipped source", lambda: _source(False))),
    "head": (("lm_head (cuBLAS), .float(), argmax", lambda: _set(StaticDecoder, "HEAD_KERNEL", False)),
             ("lm_head + greedy choice: one launch", lambda: _set(StaticDecoder, "HEAD_KERNEL", True))),
}


def main() -> None:
    ap = case_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), KINDS)
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="pdl")
    ap.add_argument("--baseline", action="append", default=[], metavar="KERNEL=FILE",
                    help="--switch source: kernel KERNEL compiled from FILE as the baseline (repeatable)")
    args = ap.parse_args()
    for spec in args.baseline:
        kernel, _, path = spec.partition("=")
        if not (kernel and Path(path).is_file()):
            ap.error(f"--baseline {spec!r}: expected KERNEL=FILE with FILE an existing .cu file")
        BASELINE[kernel] = path
    if args.switch == "source" and not BASELINE:
        ap.error("--switch source needs --baseline KERNEL=FILE")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, setting in SWITCHES[args.switch]:
        with setting():
            res = e2e_command(specs=args.spec, batches=args.batch, contexts=args.context, kinds=args.kinds,
                              hf_generate=False, checks=True)
        results[label] = res
        bad = [c["check"] for c in res["checks"] if not c["ok"]]
        print(f"== {label}" + (f"; CHECK FAILED: {', '.join(bad)}" if bad else ""))
        print(format_table(res), flush=True)
    stem = f"step_ab_{args.switch}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text("\n\n".join(f"{k}\n\n{format_table(v)}" for k, v in results.items()) + "\n")


if __name__ == "__main__":
    main()
