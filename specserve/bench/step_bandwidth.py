"""`specserve bench step --rows N...`: the weight bandwidth one target forward reaches, per row count.

A forward of n new tokens (decode at n = 1, a verify window beyond) reads every weight matrix once whatever n is
(its rows share each pass over a weight tile), so at small n its time is the time to stream the weights:
  GB/s  = the matrices' bytes (`bench real`'s count: every projection and the head, not the embedding) / time
  share = GB/s / the read bandwidth this run measures (bench/machine.py)
and t(n)/t(1) says what a verify row costs beyond the decode. `--llama-server` runs llama.cpp's server on the same
GGUF at the same context and row counts: t(1) from its per-token decode time, t(n > 1) from the evaluation of n
new prompt tokens after the cached context (one llama.cpp batch, what its speculative verify runs).
`--check RESULT`: exit non-zero when the batch-1 share falls more than 10% below the one RESULT recorded on the
same CPU model (a guard for the kernels, run by hand or in a benchmark job; never a timed unit test).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: the batch-1 share may fall this much (relative) below the recorded one before --check fails
CHECK_TOLERANCE = 0.10


def measure_specserve(engine: Any, rows: list[int], ctx: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of an n-token forward at context ctx, per n."""
    from .step_time import _step, median_seconds

    out = {}
    for n in rows:
        fn, pt = _step(engine, n, ctx)
        out[str(n)] = {"ms": median_seconds(fn, repeats) * 1000}
        engine.kv.release(pt)
    return out


def measure_llama_server(model: str, threads: int, rows: list[int], ctx: int, repeats: int,
                         vocab: int) -> dict[str, dict[str, float]]:
    """llama-server on the same GGUF: the median per-token decode time (n = 1) and the median time to evaluate n
    new tokens after a cached context of ctx (n > 1), as its own timings report them."""
    from .launch import free_port, launch, llama_server_argv

    port = free_port()
    ids = lambda start, k: [(start + 7919 * i) % (vocab - 1000) + 1000 for i in range(k)]  # noqa: E731
    prefix = ids(0, ctx)
    out = {}
    with launch(llama_server_argv("llama-server", model, port, threads, ctx=ctx + 512), port) as srv:
        for n in rows:
            times = []
            for rep in range(repeats + 1):  # the first is a warm-up
                srv.post("/completion", {"prompt": prefix, "n_predict": 0, "cache_prompt": True})
                if n == 1:
                    t = srv.post("/completion", {"prompt": prefix, "n_predict": 32, "temperature": 0,
                                                 "ignore_eos": True, "cache_prompt": True})["timings"]
                    ms = t["predicted_ms"] / max(t["predicted_n"], 1)
                else:
                    t = srv.post("/completion", {"prompt": prefix + ids(ctx + 131 * rep + n, n), "n_predict": 0,
                                                 "cache_prompt": True})["timings"]
                    if t.get("prompt_n") != n:
                        raise RuntimeError(f"llama-server evaluated {t.get('prompt_n')} prompt tokens, not {n}: its "
                                           "prompt cache did not cover the context")
                    ms = t["prompt_ms"]
                if rep:
                    times.append(ms)
            out[str(n)] = {"ms": statistics.median(times)}
    return out


def annotate(times: dict[str, dict[str, float]], weight_bytes: int, bandwidth: float) -> None:
    """GB/s, the share of the read bandwidth and t(n)/t(1) beside each row count's time."""
    t1 = times.get("1", {}).get("ms")
    for r in times.values():
        r["gbs"] = weight_bytes / (r["ms"] / 1000) / 1e9
        r["share"] = r["gbs"] / bandwidth
        if t1:
            r["over_t1"] = r["ms"] / t1


def check(results: dict[str, Any], recorded_path: str) -> str | None:
    """None when the batch-1 share holds within CHECK_TOLERANCE of the recorded run's (same CPU model); else why
    not. A recorded run from another CPU model cannot judge this one: that is an error too."""
    doc = json.loads(Path(recorded_path).read_text())
    rec, cpu = doc["results"], doc["machine"]["cpu_model"]
    here = results["machine"]["cpu_model"]
    if cpu != here:
        return f"--check: {recorded_path} was recorded on {cpu!r}, this is {here!r}: no comparable figure"
    want, got = rec["specserve"]["1"]["share"], results["specserve"]["1"]["share"]
    if got < want * (1 - CHECK_TOLERANCE):
        return (f"batch-1 bandwidth share {got:.1%} is more than {CHECK_TOLERANCE:.0%} below the recorded "
                f"{want:.1%} ({recorded_path})")
    return None


def run(a: argparse.Namespace, engine: Any, model_path: str | None) -> dict[str, Any]:
    from .machine import machine_info
    from .real import streamed_weight_bytes

    rows = sorted(set(a.rows))
    if rows[0] < 1:
        raise ValueError("--rows: row counts are at least 1")
    if a.check and 1 not in rows:
        raise ValueError("--check compares the batch-1 share: include 1 in --rows")
    wb = streamed_weight_bytes(engine.model)
    results: dict[str, Any] = {"context": a.context[0], "weight_bytes": wb,
                               "specserve": measure_specserve(engine, rows, a.context[0], a.repeats)}
    if a.llama_server:
        if model_path is None or not str(model_path).endswith(".gguf"):
            raise ValueError("--llama-server runs llama.cpp on the same file: give a GGUF model")
        from .real import file_weight_bytes

        results["llama_server_weight_bytes"] = fb = file_weight_bytes(str(model_path))
        results["llama_server"] = measure_llama_server(str(model_path), a.num_threads or torch_threads(), rows,
                                                       a.context[0], a.repeats, engine.model.cfg.vocab_size)
    results["machine"] = machine_info()  # its read bandwidth measured now, after the forwards
    bw = results["machine"]["read_bandwidth_gbs"]
    annotate(results["specserve"], wb, bw)
    if a.llama_server:
        annotate(results["llama_server"], fb, bw)
    print(f"{results['machine']['cpu_model']}, read bandwidth {bw:.1f} GB/s, context {a.context[0]}, "
          f"weights {wb / 1e9:.3f} GB")
    print(f"{'rows':>5}" + "".join(f"{h:>12}" for h in ("ms", "GB/s", "share", "t(n)/t(1)")) +
          ("".join(f"{'llama ' + h:>14}" for h in ("ms", "share", "t(n)/t(1)")) if a.llama_server else ""))
    for n in rows:
        s = results["specserve"][str(n)]
        line = f"{n:>5}{s['ms']:>12.2f}{s['gbs']:>12.1f}{s['share']:>12.1%}{s.get('over_t1', 0):>12.2f}"
        if a.llama_server:
            q = results["llama_server"][str(n)]
            line += f"{q['ms']:>14.2f}{q['share']:>14.1%}{q.get('over_t1', 0):>14.2f}"
        print(line)
    return results


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
