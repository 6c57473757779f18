"""Measured ceilings for the kernel targets of issues 6 and 7: how fast could any kernel be that must read
the bytes our formats store, timed exactly as the benchmarks time ours (one run, one GPU).

    python benchmarks/bench_ceilings.py [--quick] [--only iebme,cbc,spmm] [--out benchmarks/results]

For every SpInfer shape and every kernel case (IE-BME W4 50% at N = 1 and 8; Tiled-CBC spMspV fp16 and int4
at static 50% / 30% + dynamic 30%), in one process:

* cuBLAS fp16 on the shape (the baseline of the targets), and our kernel's default launch on random data;
* the **read floor** of the kernel's own bytes B: the fastest of (a) a streaming kernel that only reads B
  contiguous bytes (16-byte loads, grid-stride, several launch shapes) and (b) cuBLAS fp16 GEMV on a matrix of
  B bytes (two aspect ratios): what the best-tuned memory-bound code on this GPU takes to move B bytes;
* ceiling = t_cuBLAS / t_floor(B): the speedup a kernel would show if it cost nothing beyond reading its
  bytes as fast as the fastest of those; efficiency = t_floor(B) / t_ours.

SpMM (prefill) on the four SpMM shapes: a kernel that multiplies decoded tiles on the tensor cores does the
dense FLOPs, so its floor is max(read floor of its bytes, 2·M·K·N / the best tensor rate measured here);
ceiling = t_cuBLAS / that floor.

Timing: CUDA graphs of back-to-back launches, each launch on its own copy of the data (copies together
> 200 MB, beyond the 60 MB L2), median of replays (``compressor/bench/tiled_cbc.py``'s ``time_graph_*``). Writes
``ceilings_h200.json`` and ``ceilings_h200.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

READ_FLOOR_SRC = r"""
extern "C" __global__ void read_floor(const uint4* __restrict__ p, unsigned long long n16, unsigned* __restrict__ out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0u;
    for (; i + 3 * stride < n16; i += 4 * stride) {  // four independent 16-byte loads in flight per thread
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        const uint4 a = p[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9E3779B9u) out[blockIdx.x] = acc;  // keeps the loads; (almost) never taken
}
"""
READ_CONFIGS = ((256, 8), (512, 4), (1024, 2), (512, 2), (256, 4))  # (threads, blocks per SM)
ROTATE = 200e6
PEAK_COPY = 4.16e12  # the copy bandwidth the targets are stated against


def geomean(v) -> float:
    v = [x for x in v if x and x > 0 and math.isfinite(x)]
    return float(math.exp(sum(math.log(x) for x in v) / len(v))) if v else float("nan")


def _copies(nbytes: int, cap: int = 256) -> int:
    return int(min(cap, max(2, math.ceil(ROTATE / max(nbytes, 1)))))


class ReadFloor:
    """t_floor(B): the fastest measured way to read B bytes on this GPU (cached per B)."""

    def __init__(self, cp, torch, reps: int = 5):
        from unionsparse.compressor.bench.tiled_cbc import time_graph_cupy, time_graph_torch

        self.cp, self.torch, self.reps = cp, torch, reps
        self.tg_cupy, self.tg_torch = time_graph_cupy, time_graph_torch
        self.kernel = cp.RawKernel(READ_FLOOR_SRC, "read_floor")
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.out = cp.zeros(8 * self.sms * 8, dtype=cp.uint32)
        self.cache: dict[int, dict] = {}

    def read_kernel(self, nbytes: int) -> dict:
        cp = self.cp
        n16 = -(-nbytes // 16)
        nc = _copies(n16 * 16)
        buf = cp.random.randint(0, 2**31, size=nc * n16 * 4, dtype=cp.int64).astype(cp.uint32)
        views = [buf[i * n16 * 4:(i + 1) * n16 * 4] for i in range(nc)]
        best = {}
        for threads, per_sm in READ_CONFIGS:
            blocks = self.sms * per_sm

            def launch(i, threads=threads, blocks=blocks):
                self.kernel((blocks,), (threads,), (views[i % nc], np.uint64(n16), self.out))

            best[f"{threads}x{per_sm}"] = self.tg_cupy(cp, launch, max(10, nc), self.reps)
        views.clear()
        buf = None
        cp.get_default_memory_pool().free_all_blocks()
        return best

    def cublas_equal_bytes(self, nbytes: int, m: int, k: int) -> dict:
        """cuBLAS fp16 GEMV on [m, k'] and [m', k] matrices of ~nbytes (k', m' multiples of 64)."""
        torch = self.torch
        out = {}
        for label, (mm, kk) in (("same M", (m, max(64, round(nbytes / (2 * m) / 64) * 64))),
                                ("same K", (max(64, round(nbytes / (2 * k) / 64) * 64), k))):
            nc = _copies(2 * mm * kk)
            ws = [torch.randn(mm, kk, device="cuda", dtype=torch.float16) for _ in range(min(nc, 64))]
            x = torch.randn(kk, device="cuda", dtype=torch.float16)
            t = self.tg_torch(torch, lambda i, ws=ws, x=x: torch.matmul(ws[i % len(ws)], x), max(10, len(ws)),
                              self.reps)
            out[label] = dict(t=t, bytes=2 * mm * kk, shape=[mm, kk])
            del ws
        torch.cuda.empty_cache()
        return out

    def __call__(self, nbytes: int, m: int, k: int) -> dict:
        if nbytes not in self.cache:
            rk = self.read_kernel(nbytes)
            cb = self.cublas_equal_bytes(nbytes, m, k)
            # cuBLAS times scaled to exactly nbytes (its matrix is within a 64-column rounding of it)
            cb_t = min(v["t"] * nbytes / v["bytes"] for v in cb.values())
            t = min(min(rk.values()), cb_t)
            self.cache[nbytes] = dict(t_floor_us=t * 1e6, read_kernel_us={c: v * 1e6 for c, v in rk.items()},
                                      cublas_equal_bytes_us=cb_t * 1e6,
                                      floor_by=("read kernel" if min(rk.values()) <= cb_t else "cuBLAS"),
                                      floor_bw_frac=nbytes / t / PEAK_COPY)
        return self.cache[nbytes]


def cbc_fp16_bytes(m: int, k: int, static: float, n: int, rng) -> int:
    """Bytes of a Tiled-CBC fp16 layer at random ``static`` sparsity (bitmaps, ColInfo, TileOffset, values
    padded to 16 bytes per column) plus X [n, K] and Y [n, M] in fp16: what an SpMM must move."""
    gr, gc = -(-m // 256), -(-k // 16)
    nnz = rng.binomial(256, 1.0 - static, size=gr * gc * 16)
    vals = int((-(-nnz * 2 // 16) * 16).sum())
    return vals + 36 * gr * gc * 16 + 4 * (gr * gc + 1) + 2 * n * k + 2 * n * m


def run_iebme(cp, torch, shapes, floor, log) -> list[dict]:
    from unionsparse.compressor.bench.kernels import n_copies, synth_layer, time_cublas, time_iebme

    rows = []
    for si, (m, k) in enumerate(shapes):
        one = synth_layer(m, k, 4, 0.5, "none", 128, si)
        nb = int(one.values.nbytes + one.bitmaps.nbytes)
        layers = [one] + [synth_layer(m, k, 4, 0.5, "none", 128, si + 100 * i) for i in range(1, n_copies(nb))]
        wf = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(n_copies(2 * m * k))]
        for n in (1, 8):
            t, b = time_iebme(layers, n)
            tc, _ = time_cublas(m, k, n, wf)
            f = floor(b, m, k)
            rows.append(dict(case=f"IE-BME W4 50% N={n}", M=m, K=k, N=n, bytes=b, t_ours_us=t * 1e6,
                             t_cublas_us=tc * 1e6, fp16_weight_MB=2 * m * k / 1e6, **f))
            r = rows[-1]
            log(f"iebme {m}x{k} N={n}: cublas {r['t_cublas_us']:.1f} ours {r['t_ours_us']:.1f} floor "
                f"{r['t_floor_us']:.1f}us ({r['floor_by']}, {r['floor_bw_frac']:.0%} of copy bw) -> ceiling "
                f"x{tc * 1e6 / r['t_floor_us']:.2f}, ours x{tc / t:.2f}")
        del layers, wf
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def run_cbc(cp, torch, shapes, floor, log) -> list[dict]:
    from unionsparse.compressor.bench.tiled_cbc import bench_spmspv, spmspv_candidates

    rows = []
    for bits in (16, 4):
        quiet = []
        got = bench_spmspv(cp, torch, shapes, (0.5, 0.3), 0.3, quiet.append,
                           candidates=spmspv_candidates(bits, full=False), bits=bits)
        for g in got:
            f = floor(int(g["bytes_read"]), g["M"], g["K"])
            vt = "fp16" if bits == 16 else f"int{bits}"
            rows.append(dict(case=f"spMspV {vt} {g['static']:.0%}+30%", M=g["M"], K=g["K"], N=1,
                             bytes=int(g["bytes_read"]), t_ours_us=g["t_default_us"],
                             t_nodecode_us=g.get("t_nodecode_us"), t_cublas_us=g["t_cublas_us"],
                             fp16_weight_MB=2 * g["M"] * g["K"] / 1e6, **f))
            r = rows[-1]
            log(f"{r['case']} {r['M']}x{r['K']}: cublas {r['t_cublas_us']:.1f} ours {r['t_ours_us']:.1f} floor "
                f"{r['t_floor_us']:.1f}us -> ceiling x{r['t_cublas_us'] / r['t_floor_us']:.2f}, ours "
                f"x{r['t_cublas_us'] / r['t_ours_us']:.2f}")
    return rows


def run_spmm(cp, torch, floor, log) -> tuple[list[dict], float]:
    from unionsparse.compressor.bench.tiled_cbc import SPMM_NS, SPMM_SHAPES, time_graph_torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    t_big = time_graph_torch(torch, lambda i: torch.nn.functional.linear(a, b), 5, 5)
    peak = 2 * 8192**3 / t_big
    log(f"tensor rate: 8192^3 fp16 GEMM {peak / 1e12:.0f} TFLOP/s")
    rng = np.random.default_rng(0)
    rows = []
    for m, k in SPMM_SHAPES:
        nc = _copies(2 * m * k, 32)
        ws = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(nc)]
        for n in SPMM_NS:
            x = torch.randn(n, k, device="cuda", dtype=torch.float16)
            t = time_graph_torch(torch, lambda i, x=x, ws=ws: torch.nn.functional.linear(x, ws[i % len(ws)]),
                                 max(10, nc), 5)
            peak = max(peak, 2 * m * k * n / t)
            rows.append(dict(M=m, K=k, N=n, t_cublas_us=t * 1e6, bytes=cbc_fp16_bytes(m, k, 0.5, n, rng)))
        ws.clear()
        torch.cuda.empty_cache()
    for r in rows:
        f = floor(r["bytes"], r["M"], r["K"])
        t_mma = 2 * r["M"] * r["K"] * r["N"] / peak * 1e6
        r.update(t_read_floor_us=f["t_floor_us"], t_mma_floor_us=t_mma, t_floor_us=max(f["t_floor_us"], t_mma),
                 bound="tensor" if t_mma > f["t_floor_us"] else "memory")
        log(f"spmm {r['M']}x{r['K']} N={r['N']}: cublas {r['t_cublas_us']:.1f}us floor read {f['t_floor_us']:.1f} "
            f"mma {t_mma:.1f} -> ceiling x{r['t_cublas_us'] / r['t_floor_us']:.2f} ({r['bound']}-bound)")
    return rows, peak


def summarize(res: dict) -> dict:
    out = {}
    for r in res.get("rows", []):
        out.setdefault(r["case"], []).append(r)
    summ = {}
    for case, rr in out.items():
        big = [r for r in rr if r["fp16_weight_MB"] > 100]
        summ[case] = dict(
            n=len(rr),
            geomean_ours=geomean([r["t_cublas_us"] / r["t_ours_us"] for r in rr]),
            geomean_ceiling=geomean([r["t_cublas_us"] / r["t_floor_us"] for r in rr]),
            geomean_efficiency=geomean([r["t_floor_us"] / r["t_ours_us"] for r in rr]),
            geomean_nodecode=geomean([r["t_cublas_us"] / r["t_nodecode_us"] for r in rr if r.get("t_nodecode_us")]),
            mean_floor_bw_frac_over_100MB=float(np.mean([r["floor_bw_frac"] for r in big])) if big else None,
            mean_ours_bw_frac_over_100MB=(float(np.mean([r["bytes"] / r["t_ours_us"] / 1e-6 / PEAK_COPY for r in big]))
                                          if big else None),
        )
    if res.get("spmm"):
        summ["spmm"] = {str(n): dict(geomean_ceiling=geomean([r["t_cublas_us"] / r["t_floor_us"]
                                                               for r in res["spmm"] if r["N"] == n]),
                                     bound=sorted({r["bound"] for r in res["spmm"] if r["N"] == n}))
                        for n in sorted({r["N"] for r in res["spmm"]})}
    return summ


def write_md(res: dict, path: Path) -> None:
    s = res["summary"]
    L = ["# Measured ceilings (H200)", "", f"`{res['command']}` · {res['machine'].get('gpu')} · "
         f"{res['machine'].get('nvidia_smi')} · CuPy {res['machine'].get('cupy')} · torch "
         f"{res['machine'].get('torch')} · {res['date']}", "",
         "ceiling = t_cuBLAS / t_floor(our bytes); efficiency = t_floor / t_ours (1 = as fast as reading the "
         "bytes can be); floor bandwidth = bytes / t_floor as a fraction of 4.16 TB/s.", "",
         "| case | shapes | ours (geomean vs cuBLAS) | ceiling | efficiency | no-decode | floor bw, fp16 > 100 MB "
         "| ours bw, fp16 > 100 MB |", "|---|---|---|---|---|---|---|---|"]
    for case, v in s.items():
        if case == "spmm":
            continue
        L.append(f"| {case} | {v['n']} | {v['geomean_ours']:.2f}x | **{v['geomean_ceiling']:.2f}x** | "
                 f"{v['geomean_efficiency']:.2f} | {v['geomean_nodecode']:.2f}x | "
                 f"{(v['mean_floor_bw_frac_over_100MB'] or float('nan')):.0%} | "
                 f"{(v['mean_ours_bw_frac_over_100MB'] or float('nan')):.0%} |")
    if "iebme" in res.get("parts", []):
        g = [r for r in res["rows"] if r["case"].startswith("IE-BME")]
        ours = geomean([r["t_cublas_us"] / r["t_ours_us"] for r in g])
        ceil = geomean([r["t_cublas_us"] / r["t_floor_us"] for r in g])
        L += ["", f"IE-BME, N <= 8 (N = 1 and 8 together): ours {ours:.2f}x, ceiling {ceil:.2f}x."]
    if s.get("spmm"):
        L += ["", f"SpMM ceiling (tensor rate {res['tensor_tflops']:.0f} TFLOP/s, best measured), geomean over "
              f"{len({(r['M'], r['K']) for r in res['spmm']})} shapes:", "",
              "| N | " + " | ".join(s["spmm"]) + " |", "|---|" + "---|" * len(s["spmm"]),
              "| ceiling | " + " | ".join(f"{v['geomean_ceiling']:.2f}x" for v in s["spmm"].values()) + " |",
              "| bound | " + " | ".join("/".join(v["bound"]) for v in s["spmm"].values()) + " |"]
    L += ["", "## Per shape", "",
          "| case | M | K | bytes (MB) | cuBLAS us | ours us | floor us | floor by | ceiling | ours |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("rows", []):
        L.append(f"| {r['case']} | {r['M']} | {r['K']} | {r['bytes'] / 1e6:.1f} | {r['t_cublas_us']:.1f} | "
                 f"{r['t_ours_us']:.1f} | {r['t_floor_us']:.1f} | {r['floor_by']} | "
                 f"{r['t_cublas_us'] / r['t_floor_us']:.2f}x | {r['t_cublas_us'] / r['t_ours_us']:.2f}x |")
    path.write_text("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first 4 SpInfer shapes")
    ap.add_argument("--only", default="iebme,cbc,spmm", help="comma-separated parts: iebme, cbc, spmm")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if not parts or set(parts) - {"iebme", "cbc", "spmm"}:
        print(f"bench_ceilings: --only takes iebme, cbc, spmm; got {args.only!r}", file=sys.stderr)
        return 2
    import cupy as cp
    import torch
    from unionsparse.compressor.bench.tiled_cbc import SPINFER, machine_info

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    shapes = SPINFER[:4] if args.quick else SPINFER
    res = dict(command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])), machine=machine_info(cp, torch),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), parts=parts, rows=[])
    floor = ReadFloor(cp, torch)
    if "iebme" in parts:
        res["rows"] += run_iebme(cp, torch, shapes, floor, log)
    if "cbc" in parts:
        res["rows"] += run_cbc(cp, torch, shapes, floor, log)
    if "spmm" in parts:
        res["spmm"], peak = run_spmm(cp, torch, floor, log)
        res["tensor_tflops"] = peak / 1e12
    res["summary"] = summarize(res)
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceilings_h200.json").write_text(json.dumps(res, indent=1))
    write_md(res, out / "ceilings_h200.md")
    for case, v in res["summary"].items():
        if case != "spmm":
            log(f"SUMMARY {case}: ours {v['geomean_ours']:.2f}x ceiling {v['geomean_ceiling']:.2f}x efficiency "
                f"{v['geomean_efficiency']:.2f} floor bw >100MB {v['mean_floor_bw_frac_over_100MB']}")
    for n, v in res["summary"].get("spmm", {}).items():
        log(f"SUMMARY spmm N={n}: ceiling {v['geomean_ceiling']:.2f}x ({v['bound']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
