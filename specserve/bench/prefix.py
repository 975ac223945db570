"""`specserve bench prefix`: the prefix cache on a multi-turn chat workload, against the same engine with it off.

Workload: one shared system prompt of ~--system-tokens tokens (HumanEval functions as reference material),
--conversations conversations of --turns user turns (MT-Bench questions); every turn resends the whole
conversation, as chat clients do. Each turn runs on the cached engine, then on an engine with
--disable-prefix-cache (interleaved, so load on the machine hits both alike); greedy, so both see the same
history. Reported: time to first token per turn index (cache on/off), turn 2's TTFT against turn 1's cold
one, end-to-end time of all turns (on/off), and prompts that share nothing (no slower with the cache on).
--restart: the disk tier across a restart instead (bench/prefix_restart.py).
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from ..flags import add_engine_args, config_from_args
from ..core import SamplingParams
from .common import record
from .workloads import load


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="target (default smollm2-135m)")
    p.add_argument("--system-tokens", type=int, default=4096, help="shared system prompt length (about)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--unique-prompts", type=int, default=4, help="prompts sharing nothing (~--unique-tokens each)")
    p.add_argument("--unique-tokens", type=int, default=1024)
    p.add_argument("--restart", action="store_true", help="the disk tier (--prefix-cache-dir; default a temporary "
                   "directory): TTFT of a restarted engine's first request on a cached ~--system-tokens prefix "
                   "against the cold one")
    p.add_argument("--restart-rounds", type=int, default=3, help="--restart: cold + restart rounds (median reported)")
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/prefix[-restart]-<time>.json)")
    add_engine_args(p)


def _material(tok: Any, tokens: int, skip: int = 0) -> str:
    """HumanEval prompts concatenated to ~`tokens` tokens (from the skip-th on)."""
    out, n = [], 0
    for conv in load("humaneval")[skip:]:
        text = conv[-1]["content"]
        out.append(text)
        n += len(tok.encode(text, add_special_tokens=False))
        if n >= tokens:
            break
    return "\n\n".join(out)


def _turn(llm: Any, messages: list[dict], sp: SamplingParams) -> tuple[str, dict[str, Any]]:
    o = llm.chat(messages, sp)[0]
    return o.text, o.meta_info


def run(a: argparse.Namespace) -> dict[str, Any]:
    from ..engine.llm import LLM

    if a.restart:
        from . import prefix_restart

        return prefix_restart.run(a)
    cfg = config_from_args(a, a.model)
    on = LLM.from_config(cfg)
    off = LLM.from_model(on.engine.model, on.engine.tokenizer, **{**_explicit(a), "quantization": on.config.quantization or "none", "disable_prefix_cache": True})
    tok = on.engine.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=a.max_new_tokens)
    system = ("You answer questions about the following reference code.\n\n" + _material(tok, a.system_tokens))
    questions = [c[-1]["content"] for c in load("mtbench")]
    rng = random.Random(0)
    ttft: dict[str, list[list[float]]] = {"on": [[] for _ in range(a.turns)], "off": [[] for _ in range(a.turns)]}
    wall = {"on": 0.0, "off": 0.0}
    prompt_tokens: list[int] = []
    cached: list[list[int]] = [[] for _ in range(a.turns)]
    _turn(on, [{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2))  # warm both
    _turn(off, [{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2))
    on.engine.kv.prefix_cache.clear()
    for c in range(a.conversations):
        msgs = [{"role": "system", "content": system}]
        for t in range(a.turns):
            msgs.append({"role": "user", "content": questions[rng.randrange(len(questions))]})
            answers = {}
            for name, llm in (("on", on), ("off", off)):
                t0 = time.perf_counter()
                answers[name], meta = _turn(llm, msgs, sp)
                wall[name] += time.perf_counter() - t0
                ttft[name][t].append(meta["ttft"])
                if name == "on":
                    prompt_tokens.append(meta["prompt_tokens"])
                    cached[t].append(meta["cached_tokens"])
            if answers["on"] != answers["off"]:
                raise RuntimeError(f"conversation {c} turn {t}: cached and cold answers differ")
            msgs.append({"role": "assistant", "content": answers["on"]})
        print(f"conversation {c + 1}/{a.conversations}: TTFT on " +
              " ".join(f"{ttft['on'][t][-1]:.2f}" for t in range(a.turns)) + " s, off " +
              " ".join(f"{ttft['off'][t][-1]:.2f}" for t in range(a.turns)) + " s")
    unique = {"on": 0.0, "off": 0.0}
    for i in range(a.unique_prompts):  # nothing shared: each prompt its own HumanEval slice and a random tag
        text = f"[{rng.getrandbits(64):x}] " + _material(tok, a.unique_tokens, skip=40 + 25 * i)
        for name, llm in (("on", on), ("off", off)):
            t0 = time.perf_counter()
            _turn(llm, [{"role": "user", "content": text}], sp)
            unique[name] += time.perf_counter() - t0
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    r = {
        "system_tokens": len(tok.encode(system, add_special_tokens=False)),
        "prompt_tokens_mean": mean(prompt_tokens), "cached_tokens_per_turn": [mean(x) for x in cached],
        "ttft_on_s": [mean(x) for x in ttft["on"]], "ttft_off_s": [mean(x) for x in ttft["off"]],
        "turn2_vs_cold_turn1": mean(ttft["on"][1]) / mean(ttft["off"][0]) if a.turns > 1 else None,
        "e2e_on_s": wall["on"], "e2e_off_s": wall["off"], "e2e_speedup": wall["off"] / wall["on"],
        "cold_prefill_tok_s": mean([n / x for n, x in zip(prompt_tokens[:: a.turns], ttft["off"][0])]),
        "unique_on_s": unique["on"], "unique_off_s": unique["off"],
        "unique_on_vs_off": unique["on"] / unique["off"] if unique["off"] else None,
        "prefix_stats": vars(on.engine.prefix.stats),
    }
    print(f"\nsystem prompt {r['system_tokens']} tokens; mean prompt {r['prompt_tokens_mean']:.0f}, cached per turn "
          + " ".join(f"{x:.0f}" for x in r["cached_tokens_per_turn"]) + "\nTTFT per turn, cache on : " + " ".join(f"{x:.3f}" for x in r["ttft_on_s"]) +
          " s\nTTFT per turn, cache off: " + " ".join(f"{x:.3f}" for x in r["ttft_off_s"]) +
          f" s\nturn-2 TTFT / cold turn-1 TTFT: {r['turn2_vs_cold_turn1']:.3f}\n"
          f"all turns: {wall['on']:.1f} s on, {wall['off']:.1f} s off: {r['e2e_speedup']:.2f}x\n"
          f"cold prefill {r['cold_prefill_tok_s']:.0f} tok/s\n"
          f"prompts sharing nothing: {unique['on']:.2f} s on, {unique['off']:.2f} s off ({r['unique_on_vs_off']:.3f}x)")
    print(f"engine: {on.config.speculative_algorithm or 'plain'} drafting, {on.engine.kv.allocator.num_pages} KV pages, "
          f"{torch.get_num_threads()} threads")
    print(f"wrote {record('prefix', a, r)}")
    return r


def _explicit(a: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line (the second engine gets the same)."""
    from dataclasses import fields

    from ..config import EngineConfig

    return {f.name: getattr(a, f.name) for f in fields(EngineConfig)  # the disk tier needs the cache on: not for "off"
            if f.name not in ("model", "prefix_cache_dir", "prefix_cache_disk_budget") and getattr(a, f.name, None) is not None}
