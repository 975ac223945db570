"""`specserve bench gemm`: ms per call of the block-scaled int8 GEMM (`w4a8`, `w8a8`) against fp32 F.linear and
torch's int4 weight-only kernel (bf16 activations, as `--quantization int4` ran before), at SmolLM2-135M's
shapes, per token count M. Random weights: timing only. Records the CPU (model, SIMD flags, kernel path).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from .common import record

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}


def cpu_info() -> dict:
    """CPU model and the flags that decide the kernel paths (VNNI, AMX, BF16)."""
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    keep = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
            "amx_int8", "amx_bf16")
    from .. import kernels

    kernels.load()
    return {"cpu": model, "flags": [f for f in keep if f in flags], "qgemm_path": torch.ops.specserve.quant_isa(),
            "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}  # others' load skews timings


def _time(fn, reps: int) -> float:  # noqa: ANN001
    for _ in range(max(3, reps // 10)):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="token counts M")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/gemm-<time>.json)")


@torch.inference_mode()
def run(a: argparse.Namespace) -> None:
    from ..formats.quant import BlockQuantWeight, Int4Weight, quantize_blocks

    if a.threads:
        torch.set_num_threads(a.threads)
    machine = cpu_info()
    print(machine)
    rows = []
    for name in a.shapes:
        K, N = SHAPES[name]
        w = torch.randn(N, K) * 0.05
        q4, q8 = BlockQuantWeight(quantize_blocks(w, 4)), BlockQuantWeight(quantize_blocks(w, 8))
        i4 = Int4Weight(quantize_blocks(w, 4), torch.bfloat16)
        reps = max(10, a.reps // (8 if name == "head" else 1))
        for M in a.ms:
            x = torch.randn(M, K)
            r = {"shape": name, "K": K, "N": N, "M": M,
                 "w4a8": _time(lambda: q4(x), reps), "w8a8": _time(lambda: q8(x), reps),
                 "fp32": _time(lambda: torch.nn.functional.linear(x, w), reps),
                 "int4_bf16": _time(lambda: i4(x), reps)}
            rows.append(r)
            print(f"{name:8s} K={K:5d} N={N:6d} M={M:3d}  " + "  ".join(f"{k} {r[k]:.3f}" for k in
                                                                      ("w4a8", "w8a8", "fp32", "int4_bf16")), flush=True)
    print("wrote", record("gemm", a, rows, {"cpu": machine}))
