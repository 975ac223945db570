"""Time torch.ops.specserve.qgemm per weight format at Qwen2.5-1.5B's decode shapes: bytes streamed per call and
GB/s, the former fp32-scale 4-bit form (what Q4_K, and the re-quantized Q5_0/Q6_K, used) against the native ones.

    PYTHONPATH=. python bench/gemm_formats.py [--threads 2] [--rows 1 8] [--reps 15] [--impls auto vnni amx]
        [--output bench/results/gemm-formats.json]

Weights are random valid codes; timing depends on the format only. Small weights are cycled through copies
(>= 256 MB in all) so each call streams them from DRAM, as a decode step does. Prints the best of --reps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from specserve.formats.quant_ref import K4, K5, K6, pack, pack_kquant

SHAPES = {"gate_up": (8960, 1536), "qkv": (2048, 1536), "down": (1536, 8960), "lm_head": (151936, 1536)}


def weight(fmt: str, N: int, K: int, g: torch.Generator) -> tuple[tuple, int]:
    """(wp, wd, wm), op fmt. old4: 4-bit codes, fp32 d and m per 32 (6 bits/weight)."""
    r = lambda hi, *s: torch.randint(0, hi, s, generator=g, dtype=torch.int16)  # noqa: E731
    f = lambda *s: (torch.rand(*s, generator=g) * 0.01).half().float()  # noqa: E731
    if fmt == "old4":
        return pack(r(16, N, K), torch.rand(N, K // 32, generator=g) * 0.01, torch.rand(N, K // 32, generator=g), 4), 4
    if fmt == "Q5_0":
        return pack(r(32, N, K) - 16, f(N, K // 32), None, 5), 5
    if fmt == "Q8_0":
        return pack(r(256, N, K) - 128, f(N, K // 32), None, 8), 8
    if fmt == "Q6_K":
        return pack_kquant(r(64, N, K), f(N, K // 256), None, r(256, N, K // 16) - 128, None, 6), K6
    bits = 4 if fmt == "Q4_K" else 5
    return pack_kquant(r(1 << bits, N, K), f(N, K // 256), f(N, K // 256), r(64, N, K // 32), r(64, N, K // 32),
                       bits), K4 if bits == 4 else K5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--formats", nargs="+", default=["old4", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--impls", nargs="+", default=["auto"], help="kernel paths to compare (SPECSERVE_QUANT_IMPL)")
    p.add_argument("--output", help="also write the rows and the machine to this JSON file")
    a = p.parse_args()
    from specserve.bench.gemm import cpu_info

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    machine = cpu_info()
    print(f"{machine['cpu']}, isa {machine['qgemm_path']}, threads {a.threads}")
    print(f"{'shape':8} {'N':>6} {'K':>5} {'format':6} {'impl':5} {'bits/w':>6} {'MB':>7} " +
          " ".join(f"{'M=' + str(m) + ' ms':>9} {'GB/s':>6}" for m in a.rows))
    rows = []
    for name in a.shapes:
        N, K = SHAPES[name]
        for fmt in a.formats:
            w, code = weight(fmt, N, K, g)
            nbytes = sum(t.numel() * t.element_size() for t in w if t is not None)
            copies = [w] + [tuple(t if t is None else t.clone() for t in w) for _ in range(max(0, (256 << 20) // nbytes))]
            for impl in a.impls:
                os.environ["SPECSERVE_QUANT_IMPL"] = impl  # read by the op at every call
                ms_by_m = {}
                for M in a.rows:
                    x = torch.randn(M, K, generator=g)
                    times = []
                    for i in range(a.reps + 2):
                        c = copies[i % len(copies)]
                        t0 = time.perf_counter()
                        torch.ops.specserve.qgemm(x, *c, N, code)
                        times.append(time.perf_counter() - t0)
                    ms_by_m[M] = min(times[2:]) * 1e3  # NOTE: the best of reps: a shared 2-core VM preempts often
                rows.append({"shape": name, "N": N, "K": K, "format": fmt, "impl": impl, "bytes": nbytes, "ms": ms_by_m})
                print(f"{name:8} {N:6} {K:5} {fmt:6} {impl:5} {nbytes * 8 / (N * K):6.3f} {nbytes / 1e6:7.1f} " +
                      " ".join(f"{ms:9.3f} {nbytes / ms / 1e6:6.1f}" for ms in ms_by_m.values()))
            del copies
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"command": "python bench/gemm_formats.py " + " ".join(sys.argv[1:]), "machine": machine,
                       "rows": rows}, f, indent=1)
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
