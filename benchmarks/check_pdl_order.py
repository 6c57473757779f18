"""Check in the SASS that no step kernel touches global memory before ``griddepcontrol.wait``.

Kernels launched as programmatic dependent launches (kernels/pdl.cuh) may start while the kernel before them
still runs; a global load issued before the wait reads stale data. The compiler moves read-only loads
(``__ldg``, ``const __restrict__``) across the wait's ``asm volatile``, and it did once (IE-BME's activation
scales: NaN decode steps on an H100). This compiles each kernel file for sm_90 with nvcc, disassembles it with
nvdisasm (``pip download nvidia-cuda-nvdisasm``, unzip, pass ``--nvdisasm``) and fails if any global load, store
or atomic precedes the first ``ACQBULK`` (the wait) of a kernel; the norms copy their weights and permutations into
shared memory before it (``LDGSTS``, which reaches no register), and must (the study build ``NORM_EARLY=0``: not).
IE-BME reads its weights before the wait by design and what producers write through ``ld_produced``
(``LDG.E.STRONG.GPU``): none of those may come first; lm_head.cu likewise reads its weight before the wait
(read-only ``.CONSTANT`` loads) and nothing else. attention.cu reads before it what no kernel of the step writes
(the cache's earlier slots, the position, the rotary tables: plain loads) and what producers wrote after it
(``ld.global.cg``, ``STRONG.GPU``): no store, atomic or strong load before.

    python benchmarks/check_pdl_order.py [--nvdisasm PATH]      (no GPU needed; nvcc on PATH)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FILES = ("glue", "act_quant", "norm_quant", "outlier_side")
BUILDS = ((), ("-DNORM_EARLY=0",))  # shipped (the norms' early copies, kernels/pdl.cuh); the study build without
BUILD_NAMES = dict(zip(BUILDS, ("", " (NORM_EARLY=0)"), strict=True))
COPIES = ("rms_norm", "rms_norm_quant", "silu_mul_quant")  # kernels that copy early in the shipped build
GLOBAL = re.compile(r"\b(LDG|LD|STG|ST|ATOMG|ATOM|RED|REDG)(\.[A-Z0-9.]+)?\s")


def sass(src: str, out: Path, nvdisasm: str, opts: tuple[str, ...] = ()) -> str:
    cubin = out / "k.cubin"
    (out / "k.cu").write_text(src)
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", f"-I{KERNELS}", *opts, "-o", str(cubin),
                    str(out / "k.cu")], check=True)
    return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def functions(text: str) -> dict[str, list[str]]:
    found = re.finditer(r"\.text\.([A-Za-z0-9_]+):\n(.*?)(?=\n\s*\.section|\Z)", text, re.S)
    return {m.group(1): [ln for ln in m.group(2).splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
            for m in found}


def before_wait(lines: list[str]) -> tuple[int | None, list[str]]:
    """(index of the first ACQBULK, the global memory instructions before it)."""
    acq = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), None)
    end = len(lines) if acq is None else acq
    return acq, [ln.strip() for ln in lines[:end] if GLOBAL.search(ln)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in ((f, o) for f in FILES for o in BUILDS):  # and the study build of the norms' weights
            text = sass((KERNELS / f"{name}.cu").read_text(), Path(tmp), args.nvdisasm, opts)
            for fn, lines in functions(text).items():
                acq, early = before_wait(lines)
                copies = sum("LDGSTS" in ln for ln in lines[:acq or 0])  # cp.async: to shared memory, no register
                ok = acq is not None and not early and (copies > 0 or not (opts == BUILDS[0] and fn in COPIES))
                bad += not ok
                print(f"{'ok  ' if ok else 'BAD '} {name}.cu {fn[:48]}{BUILD_NAMES[opts]}: wait at {acq}, "
                      f"{len(early)} global ops before" + (f", {copies} early copies" if copies else "")
                      + ("" if ok else f": {early[:3] or 'no early copy'}"))
        for fn, lines in functions(sass((KERNELS / "attention.cu").read_text(), Path(tmp), args.nvdisasm)).items():
            acq, early = before_wait(lines)  # loads of what no step kernel writes (plain) may come first
            late = [ln for ln in lines[acq or 0:] if "LDG" in ln and "STRONG" in ln]
            wrong = [ln for ln in early if GLOBAL.search(ln).group(1) != "LDG" or "STRONG" in ln]
            ok = acq is not None and not wrong and bool(late)
            bad += not ok
            print(f"{'ok  ' if ok else 'BAD '} attention.cu {fn[:40]}: wait at {acq}, {len(early)} cache/position "
                  f"loads before it, {len(late)} loads of what producers wrote after it"
                  + ("" if ok else f": {wrong[:3]}"))
        for fn, lines in functions(sass((KERNELS / "lm_head.cu").read_text(), Path(tmp), args.nvdisasm)).items():
            acq, early = before_wait(lines)  # the weight's loads (read-only, .CONSTANT) may come first; nothing else
            ok = acq is not None and all("LDG" in ln and "CONSTANT" in ln for ln in early)
            bad += not ok
            print(f"{'ok  ' if ok else 'BAD '} lm_head.cu {fn}: wait at {acq}, {len(early)} weight loads before it"
                  + ("" if ok else f": {[ln for ln in early if 'CONSTANT' not in ln][:3]}"))
        src = (KERNELS / "iebme_spmm.cu").read_text() + "\nIEBME_ENTRY(4, 1, 0, 0)\nIEBME_ENTRY(4, 4, 1, 0)\n"
        text = sass(src, Path(tmp), args.nvdisasm, ("-DIEBME_PDL=1",))
        for fn, lines in functions(text).items():
            acq = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), None)
            produced = [i for i, ln in enumerate(lines) if "LDG.E" in ln and "STRONG.GPU" in ln]
            early = [lines[i].strip() for i in produced if acq is None or i < acq]
            ok = acq is not None and produced and not early
            bad += not ok
            print(f"{'ok  ' if ok else 'BAD '} iebme_spmm.cu {fn}: wait at {acq}, {len(produced)} loads of what "
                  f"producers wrote, {len(early)} before it")
    print("FAILED" if bad else "all kernels wait before touching what earlier kernels wrote")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
