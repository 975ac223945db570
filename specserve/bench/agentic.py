"""`specserve bench agentic`: coding-agent traffic, recorded once and replayed against servers.

Record (`--record FILE`): the model works HumanEval tasks as a tool loop (bench/agent_tasks.py) in-process, greedy,
through the same chat rendering and tool-call parsing as `specserve serve`; every turn's prompt token ids and the
model's own output ids are written down. Tasks with even ids tune, odd ids are held out.

Replay (`--replay FILE --launch CONFIG...`): each server is started on the same GGUF (bench/launch.py), afresh for
each run, and the conversations of `--split` run turn by turn, `--concurrency` conversations at a time; each turn
sends its recorded prompt ids and asks for exactly the recorded number of tokens (ignore_eos), so every engine does
the same work. With `--repeat N` the servers take turns N times and each reports its median run. Reported per
server and concurrency: output tok/s, its ratio to `plain` (and to llama-server when it ran), acceptance length,
accepted/drafted tokens per draft source (specserve's /metrics), and whether greedy texts equal plain decoding's on
the same engine. `--prime SPLIT` replays another split unmeasured first; with `--restart` the server is then
stopped and started again with the same flags (a --prefix-cache-dir keeps its pages and suffix index across the
restart, and from one concurrency's run to the next) before the measured replay.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .common import config_flags, median_run, record
from .launch import Launched, free_port, is_llama_server, launch, llama_server_argv, specserve_argv

_SOURCE = re.compile(r'^\w+:spec_decode_num_(draft|accepted)_tokens_by_source(?:_total)?\{[^}]*source="([^"]+)"[^}]*\}'
                     r"\s+([0-9.eE+-]+)$")
_TOTAL = re.compile(r"^\w+:spec_decode_num_(drafts|accepted_tokens)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record", default=None, metavar="FILE", help="record the tool loop of --model into FILE")
    p.add_argument("--model", default=None, help="--record: the target (GGUF path or a model name)")
    p.add_argument("--num-tasks", type=int, default=16, help="--record: HumanEval tasks (half tune, half held out)")
    p.add_argument("--max-turns", type=int, default=4, help="--record: assistant turns per conversation at most")
    p.add_argument("--max-new-tokens", type=int, default=192, help="--record: tokens per turn at most")
    p.add_argument("--replay", default=None, metavar="FILE", help="replay a recorded FILE against --launch servers")
    p.add_argument("--split", default="held-out", choices=("held-out", "tune", "all"))
    p.add_argument("--prime", default=None, choices=("held-out", "tune"),
                   help="replay this split unmeasured before the measured one")
    p.add_argument("--restart", action="store_true", help="with --prime: restart each server between the two")
    p.add_argument("--launch", nargs="+", default=None, metavar="CONFIG",
                   help="llama-server, llama-server+ngram, plain, or ALGO[+WINDOW][:flag=value...]")
    p.add_argument("--model-path", default=None, help="the GGUF every launched server loads")
    p.add_argument("--speculative-draft-model-path", default=None, help="llama-server+draft's draft model (-md)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="conversations in flight")
    p.add_argument("--repeat", type=int, default=1,
                   help="replays per server and concurrency, the servers taking turns; the median run is reported")
    p.add_argument("--output", default=None)


# ---- replay ----
def conversations(doc: dict[str, Any], split: str) -> list[dict[str, Any]]:
    return [c for c in doc["conversations"] if split == "all" or c["split"] == split]


def _turn(srv: Launched, llama: bool, ids: list[int], n: int) -> tuple[str, dict[str, int]]:
    """One turn: the recorded prompt, exactly n tokens; (text, llama-server's draft counters)."""
    if llama:
        r = srv.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                     "cache_prompt": True})
        t = r.get("timings", {})
        return r["content"], {"draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}
    r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    return r["choices"][0]["text"], {}


def _scrape(srv: Launched) -> dict[str, float]:
    """specserve's speculative counters: drafts and accepted in total, drafted/accepted per source."""
    try:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := _SOURCE.match(line.strip()):
            key = f"{m.group(2)}:{m.group(1)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
        elif m := _TOTAL.match(line.strip()):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def replay(srv: Launched, llama: bool, convs: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """The conversations, `concurrency` at a time, each turn after the one before."""
    before = {} if llama else _scrape(srv)
    counters = {"draft_n": 0, "draft_n_accepted": 0}

    def one(conv: dict[str, Any]) -> list[str]:
        texts = []
        for turn in conv["turns"]:
            text, c = _turn(srv, llama, turn["prompt_ids"], len(turn["output_ids"]))
            texts.append(text)
            for k, v in c.items():
                counters[k] += v
        return texts

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(one, convs))
    wall = time.perf_counter() - t0
    tokens = sum(len(t["output_ids"]) for c in convs for t in c["turns"])
    out: dict[str, Any] = {"conversations": len(convs), "turns": sum(len(c["turns"]) for c in convs), "tokens": tokens,
                           "wall_s": wall, "output_tok_s": tokens / wall, "texts": texts}
    if llama:
        if counters["draft_n"]:
            out["sources"] = {"ngram": {"drafted": counters["draft_n"], "accepted": counters["draft_n_accepted"]}}
        return out
    after = _scrape(srv)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if d.get("drafts"):
        out["accept_length"] = 1 + d.get("accepted_tokens", 0.0) / d["drafts"]
    out["sources"] = {k.split(":")[0]: {"drafted": int(d[k]), "accepted": int(d.get(k.split(":")[0] + ":accepted", 0))}
                      for k in d if k.endswith(":draft") and d[k]}
    return out


def _start(a: argparse.Namespace, name: str, threads: int) -> Launched:
    port = free_port()
    argv = (llama_server_argv(name, a.model_path, port, threads, a.speculative_draft_model_path,
                              parallel=max(a.concurrency), ctx=8192)
            if is_llama_server(name) else specserve_argv(a.model_path, port, threads, config_flags(name, "--launch")))
    print(f"== {name}: {' '.join(argv)}")
    return launch(argv, port, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))


def run_replay(a: argparse.Namespace) -> dict[str, Any]:
    if not a.launch or not a.model_path:
        raise ValueError("--replay needs --launch CONFIG... and --model-path (the GGUF every server loads)")
    if a.restart and not a.prime:
        raise ValueError("--restart restarts a server between --prime's replay and the measured one: give --prime")
    from ..loading.checkpoint import resolve_model_path

    a.model_path = str(resolve_model_path(a.model_path))  # a model name (smollm2-135m) for llama-server too
    doc = json.loads(Path(a.replay).read_text())
    convs = conversations(doc, a.split)
    if not convs:
        raise ValueError(f"{a.replay} has no {a.split} conversations")
    if a.repeat < 1:
        raise ValueError("--repeat: at least 1")
    threads = a.num_threads or os.cpu_count() or 1
    measured: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in a.launch}
    failed: dict[str, str] = {}
    # NOTE: the servers take turns, repeat after repeat: a host's speed drifts over minutes (shared VMs), and
    # one server measured in a slow minute would carry the drift into its ratio
    for rep, c in ((rep, c) for rep in range(a.repeat) for c in a.concurrency):
        for name in (n for n in a.launch if n not in failed):
            try:
                r = _measure(a, name, threads, convs, doc, c)
            except (RuntimeError, OSError) as e:  # one server that fails: the others still run
                print(f"{name}: failed\n{e}")
                failed[name] = str(e)
                continue
            measured[name].setdefault(f"{c} in flight", []).append(r)
            print(f"{name}, {c} in flight{f' (repeat {rep + 1})' if a.repeat > 1 else ''}: {r['output_tok_s']:.1f} "
                  f"tok/s, accept length {r.get('accept_length')}, sources {r.get('sources')}")
    results: dict[str, Any] = {}
    for name, modes in measured.items():
        results[name] = {"runs": {m: median_run(rs) for m, rs in modes.items()}}
        if name in failed:
            results[name]["error"] = failed[name]
    _compare(results)
    return results


def _measure(a: argparse.Namespace, name: str, threads: int, convs: list[dict[str, Any]], doc: dict[str, Any],
             c: int) -> dict[str, Any]:
    """One replay of convs, c at a time, on a fresh server (--prime: after the primed replay, --restart)."""
    llama = is_llama_server(name)
    # NOTE: a fresh server per run: caches warmed by the same conversations would flatter the later runs (a
    # --prefix-cache-dir is the exception a configuration asks for)
    srv = _start(a, name, threads)
    if a.prime:
        replay(srv, llama, conversations(doc, a.prime), c)
        if a.restart:
            srv.stop()
            srv = _start(a, name, threads)
    with srv:
        r = replay(srv, llama, convs, c)
        r.update(ready_s=srv.ready_s, peak_rss_gib=srv.peak_rss_gib())
    return r


def _compare(results: dict[str, Any]) -> None:
    """Ratios to plain and to llama-server, greedy texts against plain decoding's on the same engine; a table."""
    ok = {n: r for n, r in results.items() if r.get("runs") and "error" not in r}
    for name, r in ok.items():
        ref = ok.get("llama-server" if is_llama_server(name) else "plain")
        for mode, run in r["runs"].items():
            for base in ("plain", "llama-server", "llama-server+ngram"):
                b = ok.get(base, {}).get("runs", {}).get(mode)
                if b and base != name:
                    run[f"vs_{base}"] = run["output_tok_s"] / b["output_tok_s"]
            if ref is not None and ref is not r:
                run["text_equals_plain"] = run["texts"] == ref["runs"][mode]["texts"]
    if not ok:
        return
    modes = list(next(iter(ok.values()))["runs"])
    print(f"\n{'config':<44}" + "".join(f"{m:>34}" for m in modes))
    for name, r in ok.items():
        cells = []
        for m in modes:
            run = r["runs"][m]
            tau = f" τ{run['accept_length']:.2f}" if run.get("accept_length") else ""
            same = {True: " =", False: " !=", None: ""}[run.get("text_equals_plain")]
            cells.append(f"{run['output_tok_s']:.1f} tok/s {run.get('vs_plain', 1.0):.2f}x{tau}{same}")
        print(f"{name:<44}" + "".join(f"{c:>34}" for c in cells))


def run(a: argparse.Namespace) -> dict[str, Any]:
    if (a.record is None) == (a.replay is None):
        raise ValueError("give one of --record FILE (record the tool loop) and --replay FILE (replay it)")
    if a.record is not None:
        from .agent_record import record_tool_loop

        return record_tool_loop(a)
    r = run_replay(a)
    path = record("agentic", a, r, {"replay": {"file": a.replay, "split": a.split}})
    print(f"wrote {path}")
    return r
