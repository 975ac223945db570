"""Time specserve's paged-attention op alone, the way a decode step meets it: 30 layers' K/V pools (SmolLM2-135M
shapes: 9 query heads, 3 kv heads, head_dim 64), head-major like KVPool, pages in random order, the caches
evicted before each step (the weights stream through them between layers in a real step).

    python bench/attention_probe.py [--threads 2] [--contexts 256 1024 2048] [--rows 1 5]

Prints milliseconds per step (30 calls, median of 8) for an fp32 pool and a bf16 pool (--kv-cache-dtype
bfloat16), with fp32 queries.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve import kernels


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5], help="query rows (1 = decode, k+1 = verify)")
    a = p.parse_args()
    kernels.load()
    torch.set_num_threads(a.threads)
    op = torch.ops.specserve.paged_attention
    H, KVH, D, layers, slots, page = 9, 3, 64, 30, 8192, 16
    g = torch.Generator().manual_seed(0)
    order = (torch.randperm(slots // page, generator=g)[:, None] * page + torch.arange(page)).reshape(-1)
    evict = torch.randn(20_000_000)  # 80 MB: more than any last-level cache here
    for kv in (torch.float32, torch.bfloat16):
        pools = [[torch.randn(KVH, slots, D, generator=g).to(kv).transpose(0, 1) for _ in range(2)] for _ in range(layers)]
        row = []
        for ctx in a.contexts:
            for T in a.rows:
                q = torch.randn(T, H, D, generator=g)
                args = (torch.tensor([0, T]), torch.arange(ctx - T, ctx), order[:ctx], torch.tensor([0, ctx]), torch.tensor([0]))
                times = []
                for _ in range(10):
                    evict.sum()
                    t = time.perf_counter()
                    for kc, vc in pools:
                        op(q, kc, vc, args[0], args[1], args[2], args[3], args[4], None, None, True, 0, D**-0.5)
                    times.append(time.perf_counter() - t)
                row.append(f"ctx {ctx} rows {T}: {1000 * statistics.median(times[2:]):.2f} ms")
        print(f"{str(kv).removeprefix('torch.'):8s} pool | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
