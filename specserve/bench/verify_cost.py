"""`specserve bench verify`: time of one target verify forward over ragged windows, `compact`
(windows packed back to back: Σ(k_b + 1) tokens through the linear layers) against `padded` (every
window padded to the batch's longest), on the same batch, interleaved, median of repeats.

Windows: `mixed` cycles 0, 1, …, K over the batch (what confidence/cost windows produce),
`uniform` gives every request K (where both modes do the same work).
"""
from __future__ import annotations

import argparse
import statistics
import time

from ..flags import config_from_args
from ..core import Proposal, Request, SamplingParams
from .common import record


def add_args(p: argparse.ArgumentParser) -> None:
    from ..flags import add_engine_args

    p.add_argument("model", nargs="?", default=None, help="target (default smollm2-135m)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--context", type=int, default=256, help="committed tokens per request")
    p.add_argument("--max-window", type=int, default=7, help="K: the longest window")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/verify-<time>.json)")
    add_engine_args(p)


def _batch(engine, bs: int, ctx: int, windows: list[int]) -> tuple[list[Request], Proposal]:  # noqa: ANN001
    reqs = []
    for b in range(bs):
        r = Request(f"v{b}", [1] * ctx, SamplingParams(temperature=0, max_tokens=64))
        r.output_ids, r.committed_len = [1], ctx
        engine.kv.ensure(r.page_table, ctx + 1 + max(windows))
        reqs.append(r)
    return reqs, Proposal(tokens=[[1] * w for w in windows])


def run(a: argparse.Namespace) -> dict:
    from ..engine.llm import LLM
    from ..speculative.verify import verify

    a.speculative_algorithm = None
    engine = LLM.from_config(config_from_args(a, a.model)).engine
    K, results = a.max_window, {}
    for bs in a.batch_sizes:
        for kind, windows in (("mixed", [b % (K + 1) for b in range(bs)]), ("uniform", [K] * bs)):
            reqs, prop = _batch(engine, bs, a.context, windows)
            times: dict[str, list[float]] = {"compact": [], "padded": []}
            for i in range(a.repeats + 1):  # the first round warms up
                for mode in times:
                    t = time.perf_counter()
                    verify(engine.runner, reqs, prop, mode)
                    if i:
                        times[mode].append(time.perf_counter() - t)
            for r in reqs:
                engine.kv.release(r.page_table)
            c, p = (statistics.median(times[m]) * 1000 for m in ("compact", "padded"))
            row = {"compact_ms": c, "padded_ms": p, "padded_over_compact": p / c,
                   "tokens_compact": sum(w + 1 for w in windows), "tokens_padded": bs * (max(windows) + 1)}
            results[f"{bs}-{kind}"] = row
            print(f"batch {bs:3d} {kind:8s} compact {c:8.1f} ms ({row['tokens_compact']:4d} tokens)  "
                  f"padded {p:8.1f} ms ({row['tokens_padded']:4d} tokens)  padded/compact {p / c:.2f}")
    print(f"wrote {record('verify', a, results)}")
    return results
