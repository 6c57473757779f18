"""Tiled-CBC spMspV / SpMM beside cuBLAS fp16 on the H200 (code: ``unionsparse.compressor.bench.tiled_cbc``).

    python benchmarks/bench_tiled_cbc.py [--quick] [--no-spmm] [--no-spmspv] [--spmspv-bits 16,4]
        [--out benchmarks/results]

writes ``tiled_cbc_h200.json`` and ``tiled_cbc_h200.md`` under --out (--no-spmm: spMspV only, --no-spmspv:
SpMM only; --spmspv-bits: spMspV value types, fp16 and int4 by default).
"""

from unionsparse.compressor.bench.tiled_cbc import main

if __name__ == "__main__":
    main()
