"""torch.compile vs specserve's C++ ops for the layer's glue (results: docs/benchmarks.md, "The fused ops
against torch.compile"). One decoder layer of SmolLM2-135M shapes, fp32, T = 1 and 8 rows:
residual add + RMSNorm, SiLU·up, RoPE. Reports the cold compile time of inductor (C++ backend,
dynamic shapes) and the steady per-call time of: eager torch, the compiled function, our fused ops.

    PYTHONPATH=. python bench/compile_probe.py [OUTPUT.json]

The machine's 1-minute load average is recorded before and after (other processes on the cores inflate
the times; the ratios suffer less).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specserve.bench.step_time import machine
from specserve.kernels import load

H, I, NQ, HD, EPS = 576, 1536, 9, 64, 1e-5


def glue(x, d, w, gu, q, cos, sin):  # noqa: ANN001, ANN201
    x = x + d
    h = F.rms_norm(x, (H,), w, EPS)
    g, u = gu.chunk(2, dim=-1)
    m = F.silu(g) * u
    q1, q2 = q.chunk(2, dim=-1)
    q = q * cos + torch.cat((-q2, q1), dim=-1) * sin
    return x, h, m, q


def fused(x, d, w, gu, q, cos, sin, pos):  # noqa: ANN001, ANN201
    ops = torch.ops.specserve
    h = ops.add_rms_norm(x, d, w, EPS)
    m = ops.silu_mul(gu)
    kc = torch.empty(1, 1, HD)
    ops.rope_kv_write(q, q[:, :1], q[:, :1], cos, sin, pos, kc, kc, torch.zeros(len(pos), dtype=torch.long))
    return x, h, m, q


def bench(fn, args, n=300) -> float:  # noqa: ANN001
    for _ in range(5):
        fn(*args)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    load()
    res = {"machine": machine(), "torch_threads": torch.get_num_threads(), "load_avg_1m_before": os.getloadavg()[0]}
    t0 = time.perf_counter()
    comp = torch.compile(glue, backend="inductor", dynamic=True)
    table = torch.randn(4096, HD)
    for T in (1, 8):
        args = (torch.randn(T, H), torch.randn(T, H), torch.randn(H), torch.randn(T, 2 * I), torch.randn(T, NQ, HD))
        pos = torch.arange(100, 100 + T)
        cos, sin = table[pos].unsqueeze(1), table[pos].unsqueeze(1)
        if T == 1:
            comp(*args, cos, sin)
            res["compile_cold_s"] = time.perf_counter() - t0
        res[f"T{T}"] = {"eager_us": bench(glue, (*args, cos, sin)), "compiled_us": bench(comp, (*args, cos, sin)),
                        "fused_ops_us": bench(fused, (*args, table, table, pos))}
    res["load_avg_1m_after"] = os.getloadavg()[0]
    out = json.dumps(res, indent=1)
    print(out)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    main()
