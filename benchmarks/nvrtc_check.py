"""Compile a bundled kernel with NVRTC for sm_90 on a machine without a GPU; print ptxas's resource report.

    pip install nvidia-cuda-nvrtc-cu12          # libnvrtc, no GPU or driver needed
    python benchmarks/nvrtc_check.py kernels/iebme_spmm.cu --entry "IEBME_ENTRY(4, 1, 0, 0)" \\
        -DIEBME_NSTAGE=2 -DIEBME_WARPS=4 -DIEBME_ILP=1 [--cubin out.cubin]

Registers, shared memory, stack frame and spills per entry point come from ``--ptxas-options=-v``; the
cubin (``--cubin``) can be disassembled with ``nvdisasm -c`` (PyPI ``nvidia-cuda-nvdisasm``) to count
the instructions of a loop. Exit code 1 when NVRTC reports an error.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from pathlib import Path


def find_nvrtc() -> str:
    env = os.environ.get("NVRTC_LIB")
    if env:
        return env
    for root in sys.path:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libnvrtc.so*")) +
                      glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and "alt" not in h]
        if hits:
            return hits[0]
    return "libnvrtc.so"


def compile_cu(source: str, name: str, options: list[str]) -> tuple[int, str, bytes]:
    """(NVRTC status, log, cubin) for ``source`` compiled with ``options``."""
    lib = ctypes.CDLL(find_nvrtc())
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [o.encode() for o in options]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = b""
    if status == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw
    return status, log.value.decode(errors="replace"), cubin


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("--entry", action="append", default=[], help="line appended to the source, e.g. an ENTRY macro")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--cubin", type=Path, help="write the cubin here")
    args, defines = ap.parse_known_args()
    src = args.source.read_text() + "\n" + "\n".join(args.entry) + "\n"
    status, log, cubin = compile_cu(src, args.source.name, [f"-arch={args.arch}", "--ptxas-options=-v",
                                                            "-std=c++17", f"-I{args.source.resolve().parent}",
                                                            *defines])
    print(log)
    if args.cubin and cubin:
        args.cubin.write_bytes(cubin)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
