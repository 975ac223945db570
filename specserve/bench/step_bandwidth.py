"""`specserve bench step --rows N...`: the weight bandwidth one target forward reaches, per row count.

A forward of n new tokens (decode at n = 1, a verify window beyond) reads every weight matrix once whatever n is
(its rows share each pass over a weight tile), so at small n its time is the time to stream the weights:
  GB/s  = the matrices' bytes (`bench real`'s count: every projection and the head, not the embedding) / time
  share = GB/s / the read bandwidth this run measures (bench/machine.py)
and t(n)/t(1) says what a verify row costs beyond the decode. `--llama-server` runs llama.cpp's server on the same
GGUF at the same context and row counts: t(1) from its per-token decode time, t(n > 1) from the evaluation of n
new prompt tokens after the cached context (one llama.cpp batch, what its speculative verify runs).
`--rounds R`: R rounds, the engines taking turns with llama-server kept up; each figure is the median round, every
round's kept beside it (`ms_runs`, `specserve_over_llama_t1_runs`).
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


def measure_specserve(engine: Any, rows: list[int], ctx: int, repeats: int) -> dict[str, float]:
    """Median ms of an n-token forward at context ctx, per n."""
    from .step_time import _step, median_seconds

    out = {}
    for n in rows:
        fn, pt = _step(engine, n, ctx)
        out[str(n)] = median_seconds(fn, repeats) * 1000
        engine.kv.release(pt)
    return out


class LlamaServerSteps:
    """llama-server on the same GGUF, up for the whole run (rounds interleave with specserve's): the median
    per-token decode time (n = 1) and the median time to evaluate n new tokens after a cached context (n > 1), as
    its own timings report them."""

    def __init__(self, model: str, threads: int, ctx: int, vocab: int) -> None:
        from .launch import free_port, launch, llama_server_argv

        self.ctx, self.vocab = ctx, vocab
        port = free_port()
        self.srv = launch(llama_server_argv("llama-server", model, port, threads, ctx=ctx + 512), port)
        self._round = 0

    def close(self) -> None:
        self.srv.stop()

    def _ids(self, start: int, k: int) -> list[int]:
        return [(start + 7919 * i) % (self.vocab - 1000) + 1000 for i in range(k)]

    def measure(self, rows: list[int], repeats: int) -> dict[str, float]:
        prefix, srv, out = self._ids(0, self.ctx), self.srv, {}
        self._round += 1
        for n in rows:
            times = []
            for rep in range(repeats + 1):  # the first is a warm-up
                srv.post("/completion", {"prompt": prefix, "n_predict": 0, "cache_prompt": True})
                if n == 1:
                    t = srv.post("/completion", {"prompt": prefix, "n_predict": 32, "temperature": 0,
                                                 "ignore_eos": True, "cache_prompt": True})["timings"]
                    ms = t["predicted_ms"] / max(t["predicted_n"], 1)
                else:  # new tokens each time: never a cached continuation
                    new = self._ids(self.ctx + 131 * (rep + (repeats + 1) * self._round) + n, n)
                    t = srv.post("/completion", {"prompt": prefix + new, "n_predict": 0, "cache_prompt": True})["timings"]
                    if t.get("prompt_n") != n:
                        raise RuntimeError(f"llama-server evaluated {t.get('prompt_n')} prompt tokens, not {n}: its "
                                           "prompt cache did not cover the context")
                    ms = t["prompt_ms"]
                if rep:
                    times.append(ms)
            out[str(n)] = statistics.median(times)
        return out


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per row count the median over rounds (`ms`) and every round's (`ms_runs`)."""
    return {n: {"ms": statistics.median(r[n] for r in runs), "ms_runs": [round(r[n], 2) for r in runs]}
            for n in runs[0]}


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
    results: dict[str, Any] = {"context": a.context[0], "weight_bytes": wb, "rounds": a.rounds}
    llama = None
    if a.llama_server:
        if model_path is None or not str(model_path).endswith(".gguf"):
            raise ValueError("--llama-server runs llama.cpp on the same file: give a GGUF model")
        from .real import file_weight_bytes

        results["llama_server_weight_bytes"] = fb = file_weight_bytes(str(model_path))
        llama = LlamaServerSteps(str(model_path), a.num_threads or torch_threads(), a.context[0],
                                 engine.model.cfg.vocab_size)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    try:  # NOTE: rounds alternate the engines: this VM's bandwidth moves minute to minute, so only a round's
        for _ in range(a.rounds):  # figures, side by side, compare
            ours.append(measure_specserve(engine, rows, a.context[0], a.repeats))
            if llama is not None:
                theirs.append(llama.measure(rows, a.repeats))
    finally:
        if llama is not None:
            llama.close()
    results["specserve"] = summarize(ours)
    if llama is not None:
        results["llama_server"] = summarize(theirs)
        results["specserve_over_llama_t1_runs"] = [round(t["1"] / o["1"], 3) for o, t in zip(ours, theirs)
                                                   if "1" in o]
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
