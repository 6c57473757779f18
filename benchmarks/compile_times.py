"""First-launch compile time of the runtime's kernel modules on a fresh CuPy cache (docs/kernels.md, "Compile
time"): each module as the runtime builds it (one head dimension, one value type, the prompt's decode kernels
apart), beside the whole file it was built from before.

    CUPY_CACHE_DIR=$(mktemp -d) python benchmarks/compile_times.py --out DIR   (a CUDA machine; compile_h200.sh)
"""

from __future__ import annotations

import argparse
import time

import torch
from unionsparse.compressor.bench.e2e import write_table
from unionsparse.kernels import tiled_cbc_spmm, tiled_cbc_spmspv
from unionsparse.kernels.loader import load_module

# label: (module as the runtime builds it now, the whole file as before (None: nothing to compare), a kernel of
# both: CuPy compiles a module at its first get_function)
CASES = {
    "attention, head dim 128": (lambda: load_module("attention", (), options=("-DATTN_PER=4",)),
                                lambda: load_module("attention", ()), "attention_decode_4"),
    "Tiled-CBC spMspV, fp16 values": (lambda: tiled_cbc_spmspv._module(16),
                                      lambda: load_module(tiled_cbc_spmspv.KERNEL, tiled_cbc_spmspv._EXPR),
                                      "tcbc_spmspv2<16, 4, 2>"),
    "Tiled-CBC spMspV, int4 codes": (lambda: tiled_cbc_spmspv._module(4), None, "tcbc_spmspv2<4, 4, 3>"),
    "Tiled-CBC prompt decode": (tiled_cbc_spmm._decode_module, None, "tcbc_decode_dense2"),
    "Tiled-CBC SpMM module (without the decode kernels)": (tiled_cbc_spmm._module, None,
                                                           f"tcbc_spmm2<32, {tiled_cbc_spmm.GK}, 3, 2>"),
}


def seconds(build, name: str) -> float:
    t = time.perf_counter()
    build().get_function(name)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    for label, (now, before, name) in CASES.items():  # the module the runtime builds first, on a cold cache
        rows.append({"module": label, "now_s": seconds(now, name),
                     "whole_file_s": seconds(before, name) if before else None})
    head = f"{torch.cuda.get_device_name()}, first build on a fresh CuPy cache (NVRTC, then the driver's load)"
    lines = [head, "", "| module | as the runtime builds it (s) | the whole file before (s) |", "|---|---|---|"]
    lines += [f"| {r['module']} | {r['now_s']:.2f} | " + (f"{r['whole_file_s']:.2f}" if r["whole_file_s"] else "")
              + " |" for r in rows]
    lines.append("(the prompt decode was part of the SpMM module before: compare it with that row)")
    text = "\n".join(lines) + "\n"
    print(text)
    write_table(args.out, "compile_times", text, {"machine": head, "rows": rows})


if __name__ == "__main__":
    main()
