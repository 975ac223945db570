"""`specserve bench step`: where the time of one target forward goes, at batch 1 (with `--rows`: the weight
bandwidth a forward reaches per row count, bench/step_bandwidth.py).

For a decode step (1 new token) and a verify step (T new tokens, default 8) over each committed context,
per mode (--dtype / --quantization, one mode per run): median wall time, and from one torch.profiler
pass the self time of the ops by kind (matmuls, attention, norms/RoPE/glue), the time outside any op
(Python and dispatch overhead: wall − Σ op self time) and the op count per step and per layer.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from ..cost.curve import probe_tokens
from .common import record

MATMUL = ("linear", "addmm", "mm", "bmm", "matmul", "_weight_int4pack_mm", "quant", "gemm", "_int_mm")
ATTENTION = ("attention", "index_copy", "index", "softmax", "baddbmm", "_efficient", "flash", "rope_kv")


def add_args(p: argparse.ArgumentParser) -> None:
    from ..flags import add_engine_args

    p.add_argument("model", nargs="?", default=None, help="target (default smollm2-135m)")
    p.add_argument("--context", type=int, nargs="+", default=[256],
                   help="committed tokens before the step (several: one decode and one verify step each)")
    p.add_argument("--verify-tokens", type=int, default=8, help="T of the verify step")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rows", type=int, nargs="+", default=None, metavar="N",
                   help="the bandwidth table instead: per row count N, GB/s and the share of the read bandwidth "
                        "(the first --context)")
    p.add_argument("--llama-server", action="store_true", help="--rows: llama-server on the same GGUF too")
    p.add_argument("--rounds", type=int, default=1,
                   help="--rows: measure this many rounds (with --llama-server: the engines take turns), report "
                        "the median round")
    p.add_argument("--check", default=None, metavar="RESULT",
                   help="--rows: fail when the batch-1 bandwidth share is >10%% below RESULT's (same CPU model)")
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/step-<time>.json)")
    add_engine_args(p)


def machine() -> dict:
    """CPU model, the ISA flags that matter for our kernels, threads (the VM changes kind)."""
    info = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        text = open("/proc/cpuinfo").read()
        info["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name"))
        flags = set(next(ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")))
        info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except (OSError, StopIteration):
        pass
    return info


def _kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in MATMUL) and "attention" not in n:
        return "matmul"
    if any(k in n for k in ATTENTION):
        return "attention"
    return "glue"


def _step(engine, n_new: int, ctx: int):  # noqa: ANN001, ANN202
    pt: list[int] = []
    engine.kv.ensure(pt, ctx + n_new)
    runner = engine.runner
    vocab = engine.model.cfg.vocab_size
    runner.forward([pt], [0], [probe_tokens(ctx, vocab)], [[ctx - 1]])  # fill the context once
    ids = probe_tokens(n_new + ctx, vocab)[ctx:]  # distinct tokens: an MoE's rows route apart (cost/curve.py)
    fn = lambda: runner.forward([pt], [ctx], [ids], [list(range(n_new))])  # noqa: E731
    return fn, pt


def median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    """Median wall time of fn() over `repeats` calls, after 3 unmeasured ones."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(engine, n_new: int, ctx: int, repeats: int) -> dict:  # noqa: ANN001
    fn, pt = _step(engine, n_new, ctx)
    seconds = median_seconds(fn, repeats)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        fn()
        wall_prof = time.perf_counter() - t
    events = [e for e in prof.events() if e.name != "ProfilerStep*"]
    by_kind: Counter[str] = Counter()
    for e in events:
        by_kind[_kind(e.name)] += e.self_cpu_time_total / 1000
    op_self = sum(by_kind.values())
    top = Counter(e.name for e in events).most_common(12)
    engine.kv.release(pt)
    layers = engine.model.cfg.num_layers
    return {
        "ms": seconds * 1000,
        "profiled_ms": wall_prof * 1000,
        "self_ms": {k: round(v, 3) for k, v in by_kind.items()},
        "outside_ops_ms": round(wall_prof * 1000 - op_self, 3),
        "ops": len(events),
        "ops_per_layer": round(len(events) / layers, 1),
        "top_ops": top,
    }


def run(a: argparse.Namespace) -> dict:
    from ..flags import config_from_args
    from ..engine.llm import LLM

    a.speculative_algorithm = None
    if (a.llama_server or a.check) and not a.rows:
        raise ValueError("--llama-server and --check belong to the bandwidth table: give --rows")
    if a.rounds < 1:
        raise ValueError("--rounds: at least 1")
    t0 = time.perf_counter()
    engine = LLM.from_config(config_from_args(a, a.model)).engine
    load_s = time.perf_counter() - t0
    if a.rows:
        return _bandwidth(a, engine)
    t0 = time.perf_counter()
    fn, pt = _step(engine, 1, 16)
    fn()
    engine.kv.release(pt)
    first_s = time.perf_counter() - t0
    results: dict = {"load_s": load_s, "first_forward_s": first_s, "machine": machine(), "contexts": {}}
    for ctx in a.context:
        row: dict = {}
        for name, n in (("decode", 1), (f"verify{a.verify_tokens}", a.verify_tokens)):
            r = row[name] = measure(engine, n, ctx, a.repeats)
            print(f"context {ctx:5d} {name:9s} {r['ms']:7.2f} ms  ops {r['ops']:5d} ({r['ops_per_layer']}/layer)  "
                  f"self {r['self_ms']}  outside ops {r['outside_ops_ms']} ms (profiled {r['profiled_ms']:.1f} ms)")
        d, v = row["decode"]["ms"], row[f"verify{a.verify_tokens}"]["ms"]
        row["verify_over_decode"] = v / d
        results["contexts"][str(ctx)] = row
        print(f"context {ctx:5d} t({a.verify_tokens})/t(1) = {v / d:.2f}")
    print(f"load {load_s:.1f} s, first forward {first_s:.2f} s; {results['machine']}")
    print(f"wrote {record('step', a, results)}")
    return results


def _bandwidth(a: argparse.Namespace, engine) -> dict:  # noqa: ANN001
    from . import step_bandwidth
    from ..loading.checkpoint import resolve_model_path

    path = resolve_model_path(a.model or "smollm2-135m")
    results = step_bandwidth.run(a, engine, str(path))
    print(f"wrote {record('step', a, results)}")
    if a.check and (why := step_bandwidth.check(results, a.check)):
        raise SystemExit(why)
    return results
