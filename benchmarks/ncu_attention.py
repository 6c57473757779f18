"""One decode-attention launch per case, for Nsight Compute (``ncu``): where a layer's attention spends its time
against the copy bandwidth (docs/kernels.md, "Decode attention").

    python3 benchmarks/ncu_attention.py CASE FORM
    (CASE: b1-ctx512 | b8-ctx512 | b8-ctx2048 | llama3-b1; FORM: split | cluster)
    ncu --kernel-name regex:attention_decode --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_attention.py b8-ctx2048 cluster

(the first launch compiles and warms; ``--cache-control all`` by default, so the cache is cold as in a step).
"""

from __future__ import annotations

import sys

import torch
from unionsparse.kernels import attention

# name: batch, query heads, KV heads, head dim, context (benchmarks/attention_bytes.py's cases)
CASES = {"b1-ctx512": (1, 32, 32, 128, 512), "b8-ctx512": (8, 32, 32, 128, 512),
         "b8-ctx2048": (8, 32, 32, 128, 2048), "llama3-b1": (1, 32, 8, 128, 512)}


def main() -> None:
    name, form = sys.argv[1], sys.argv[2]
    b, h, hkv, d, ctx = CASES[name]
    attention.CLUSTER = form == "cluster"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, h, 1, d, device=dev, dtype=torch.float16, generator=gen)
    kc = torch.randn(b, hkv, ctx + 8, d, device=dev, dtype=torch.float16, generator=gen)
    vc = torch.randn(b, hkv, ctx + 8, d, device=dev, dtype=torch.float16, generator=gen)
    pos = torch.full((b,), ctx - 1, device=dev)
    off = torch.zeros(b, dtype=torch.long, device=dev)
    for _ in range(2):
        attention.decode_attention(q, kc, vc, pos, off, d ** -0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
