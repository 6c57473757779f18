"""Programmatic dependent launch of the decode step's kernels (kernels/pdl.cuh, kernels/cluster_launch.py).

A kernel launched programmatically may start while the kernel before it still runs, so it must wait
(``griddepcontrol.wait``) before touching anything: every step kernel begins with ``pdl_enter()``. That the
compiler keeps every load after the wait is checked in the SASS by benchmarks/check_pdl_order.py (nvcc and
nvdisasm); the results by the GPU tests, which run with it on.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from unionsparse.kernels import cluster_launch as cl

KERNELS = Path(cl.__file__).parent
STEP_FILES = ("glue.cu", "attention.cu", "act_quant.cu", "norm_quant.cu", "outlier_side.cu", "lm_head.cu")
# kernels that issue loads of what no step kernel writes before their wait (docs/kernels.md): they start with
# allow_dependents() and wait later; benchmarks/check_pdl_order.py checks their SASS
EARLY = ("attention.cu", "lm_head.cu")


BUILDS = ({"NORM_EARLY": 0}, {"NORM_EARLY": 1})  # the shipped build; the norms' early copies (kernels/pdl.cuh)
# a declaration that only packs parameters and indices (no `[`, `->` or `*p`: nothing read from memory)
PACKING = re.compile(r"const (int|QuantArgs) (?!.*(\[|->|\*[\w(]))[^;]*", re.S)


def resolve(text: str, defines: dict[str, int]) -> str:
    """``text`` with each ``#if NAME`` block of a macro in ``defines`` (``#else`` optional, not nested) replaced by
    the branch that build takes."""
    for name, on in defines.items():
        block = re.compile(rf"#if {name}\n(.*?)(?:#else\n(.*?))?#endif\n", re.S)
        text = block.sub(lambda m, on=on: m.group(1) if on else (m.group(2) or ""), text)
    return text


def kernel_bodies(text: str) -> list[tuple[str, list[str], str]]:
    """(name, pointer parameters, its first statement that is neither a shared-memory declaration nor a packing of
    parameters)."""
    out = []
    bounds = r"__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*"  # one level of parentheses inside: (PER) <= 4 ? 2 : 1
    for m in re.finditer(rf"__global__ void (?:{bounds})?(\w+)\(([^)]*)\)\s*\{{", text):
        params = [p.split()[-1].lstrip("*&") for p in m.group(2).replace("\\", " ").split(",") if "*" in p]
        body = text[m.end():m.end() + 600].replace("\\\n", "\n")  # macro line continuations
        stmts = [s.strip() for s in body.split(";")]
        first = next(s for s in stmts if s and "__shared__" not in s and not PACKING.fullmatch(s))
        out.append((m.group(1), params, first))
    return out


@pytest.mark.parametrize("defines", BUILDS)
@pytest.mark.parametrize("name", STEP_FILES)
def test_every_step_kernel_waits_first(name, defines):
    text = resolve((KERNELS / name).read_text(), defines)
    if name == "attention.cu":  # the kernels are one macro over the arguments of DECODE_ARGS
        args = text[text.index("#define DECODE_ARGS"):text.index("//", text.index("#define DECODE_ARGS"))]
        text = re.sub(r"(##\w+)+\(DECODE_ARGS\)", "(" + args.split("DECODE_ARGS", 1)[1].replace("\\", "\\\\") + ")",
                      text)
    bodies = kernel_bodies(text)
    assert bodies, f"no kernels found in {name}"
    for kernel, params, first in bodies:
        # allow_dependents(): loads or copies of what no step kernel writes, then the wait
        early = name in EARLY or (defines["NORM_EARLY"] and kernel in ("rms_norm", "rms_norm_quant", "silu_mul_quant"))
        want = r"allow_dependents\(\)" if early else r"pdl_enter\(.*\)"
        assert params, f"{name}:{kernel}: no pointer parameters parsed"
        assert re.fullmatch(want, first.split("/*")[0].strip(), re.S), f"{name}:{kernel} starts with {first!r}"
    if name in EARLY:
        assert "wait_for_producer();" in text


def test_attention_reads_what_producers_wrote_after_the_wait_only():
    """attention.cu loads the cache's earlier slots before its wait; q, the raw Q/K/V rows and the slot at pos (what
    the launch before wrote) only through load_produced / load_raw_produced (ld.global.cg after the wait), which
    the SASS check then finds after it."""
    text = (KERNELS / "attention.cu").read_text()
    produced = re.compile(r"(rp\.r[qkv] \+|[(\s]q \+ at \* D|_cache \+ at\b)")
    uses = [ln.strip() for ln in text.splitlines() if produced.search(ln)]
    assert len(uses) >= 6, uses  # q, rq, rk, rv and slot pos of k and v (load_q, slot_pos: both forms call them)
    bad = [ln for ln in uses if not re.match(r"load_(raw_)?produced<PER>\(", ln)]
    assert not bad, bad


def test_the_check_finds_a_kernel_that_reads_first():
    head = 'extern "C" __global__ void k(const float* __restrict__ x, float* y) {\n'
    bad = head + "    y[0] = x[0];\n    pdl_enter();\n}\n"
    good = head + "    __shared__ float s[4];\n    pdl_enter();\n}\n"
    assert kernel_bodies(bad)[0][1:] == (["x", "y"], "y[0] = x[0]")
    assert kernel_bodies(good)[0][2] == "pdl_enter()"


def test_step_kernels_launch_programmatically_where_the_gpu_has_it(monkeypatch):
    calls = []
    monkeypatch.setattr(cl, "launch_ex", lambda fn, grid, block, smem, args, cluster=None, programmatic=False,
                        stream=None: calls.append(("driver", grid, smem, programmatic)))

    def cupy_launch(grid, block, args, shared_mem=0, stream=None):
        calls.append(("cupy", grid, shared_mem, stream))

    for cc, off, want in ((90, None, "driver"), (90, False, "cupy"), (80, None, "cupy"), (80, True, "cupy")):
        monkeypatch.setattr(cl, "compute_capability", lambda cc=cc: cc)
        with cl.programmatic_launches(off):
            cl.launch(cupy_launch, (3, 2), (128,), (np.int32(1),), shared_mem=64)
        assert calls[-1][0] == want and calls[-1][1] == (3, 2) and calls[-1][2] == 64
    assert calls[0][3] is True
    assert cl._PROGRAMMATIC[0] is None  # the block restores the default


def test_glue_modules_follow_the_study_build(monkeypatch):
    """benchmarks/step_ab.py --switch norms builds glue.cu and norm_quant.cu with NORM_EARLY 0 and 1 in one
    process: each kernel set is keyed by the study build in force, not made once."""
    from unionsparse.kernels import glue, loader, norm_quant, study

    built = []

    class Module:
        def __init__(self, name):
            self.name = name

        def get_function(self, fn):
            return (self.name, study.build(self.name).options(), fn)

    monkeypatch.setattr(loader, "load_module", lambda name, expressions=(), **kw: built.append(name) or Module(name))
    try:
        for mod, name in ((glue, "glue"), (norm_quant, "norm_quant")):
            for on in (0, 1):
                with study.building(name, study.Build(defines=(("NORM_EARLY", on),))):
                    fns = mod._functions()
                    assert {opts for _, opts, _ in fns.values()} == {(f"-DNORM_EARLY={on}",)}
        assert built == ["glue", "glue", "norm_quant", "norm_quant"]
    finally:  # no fake module stays cached for a later test
        glue._module_functions.cache_clear()
        norm_quant._module_functions.cache_clear()
