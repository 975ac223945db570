"""`specserve bench prefix --restart`: the prefix cache's disk tier across a restart.

Per round: one prompt, ~--system-tokens of reference material (HumanEval functions, as `bench prefix`'s system
prompt) and a question (plain text: any tokenizer, no chat template needed). An engine without a disk tier answers it (the uncached run, and the cold TTFT without the tier's
writes); then on a fresh empty --prefix-cache-dir: build the engine, send the prompt (cold: nothing cached; its
pages are written as they enter the cache), send it again (a RAM hit), close the engine (its queued pages
written), build a new engine on the same directory and time its first request on the same prompt (the restart). Every answer
must equal the uncached one (greedy).
Reported per round and as medians: TTFT cold without and with the tier / RAM hit / after the restart, cached tokens
after the restart, engine builds, and the tier's costs per page: the engine thread's copy-out (save), the writer
thread's checksum + write, the read + check + copy-in at admission (load).
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..core import SamplingParams
from ..flags import config_from_args
from .common import record
from .workloads import load


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.page"))


def run(a: argparse.Namespace) -> dict[str, Any]:
    from ..engine.llm import LLM
    from .prefix import _material

    given = a.prefix_cache_dir
    if given and Path(given).exists() and any(Path(given).iterdir()):
        raise ValueError(f"--prefix-cache-dir {given}: bench prefix --restart needs an empty directory (its first "
                         "request must be cold)")
    base = Path(given) if given else Path(tempfile.mkdtemp(prefix="specserve-prefix-restart-"))
    sp = SamplingParams(temperature=0, max_tokens=a.max_new_tokens)
    rounds: list[dict[str, Any]] = []
    try:
        for i in range(a.restart_rounds):
            d = base / f"round{i}"
            cfg = dataclasses.replace(config_from_args(a, a.model), prefix_cache_dir=str(d))
            plain = LLM.from_config(dataclasses.replace(cfg, prefix_cache_dir=None, prefix_cache_disk_budget=None))
            questions = load("mtbench")
            prompt = ("You answer questions about the following reference code.\n\n"
                      + _material(plain.engine.tokenizer, a.system_tokens)
                      + "\n\nQuestion: " + questions[i % len(questions)][-1]["content"] + "\nAnswer:")
            uncached = plain.generate([prompt], sp)[0]
            plain.close()
            del plain
            t0 = time.perf_counter()
            first = LLM.from_config(cfg)
            build_cold = time.perf_counter() - t0
            cold = first.generate([prompt], sp)[0]
            ram = first.generate([prompt], sp)[0]
            eng = first.engine
            tier, store = eng.prefix.cache.disk, eng.prefix.store
            t0 = time.perf_counter()
            first.close()
            flush = time.perf_counter() - t0
            saved, save_s = tier.stats.saved, tier.stats.save_s
            written, write_s, written_bytes = store.stats.written, store.stats.write_s, store.stats.written_bytes
            del first, eng, tier
            t0 = time.perf_counter()
            second = LLM.from_config(cfg)
            build_restart = time.perf_counter() - t0
            again = second.generate([prompt], sp)[0]
            tier2 = second.engine.prefix.cache.disk
            if not (uncached.token_ids == cold.token_ids == ram.token_ids == again.token_ids):
                raise RuntimeError(f"round {i}: an answer with the disk tier differs from the uncached one")
            r = {"prompt_tokens": cold.meta_info["prompt_tokens"], "ttft_cold_no_tier_s": uncached.meta_info["ttft"],
                 "ttft_cold_s": cold.meta_info["ttft"],
                 "ttft_ram_hit_s": ram.meta_info["ttft"], "ttft_restart_s": again.meta_info["ttft"],
                 "cached_tokens_restart": again.meta_info["cached_tokens"],
                 "restart_vs_cold": again.meta_info["ttft"] / cold.meta_info["ttft"],
                 "build_cold_s": build_cold, "build_restart_s": build_restart, "close_flush_s": flush,
                 "pages_saved": saved, "save_ms_per_page": 1e3 * save_s / max(saved, 1),
                 "pages_written": written, "write_ms_per_page": 1e3 * write_s / max(written, 1),
                 "bytes_per_page": written_bytes / max(written, 1), "dir_bytes": _dir_bytes(d),
                 "pages_loaded": tier2.stats.loaded, "load_ms_per_page": 1e3 * tier2.stats.load_s / max(tier2.stats.loaded, 1),
                 "outputs_equal": True}
            second.close()
            del second, tier2
            rounds.append(r)
            print(f"round {i + 1}/{a.restart_rounds}: {r['prompt_tokens']} prompt tokens; TTFT cold "
                  f"{r['ttft_cold_no_tier_s']:.3f} s without the tier, {r['ttft_cold_s']:.3f} s with it, "
                  f"RAM hit {r['ttft_ram_hit_s']:.3f} s, after restart {r['ttft_restart_s']:.3f} s "
                  f"({r['cached_tokens_restart']} cached, {r['restart_vs_cold']:.3f} of cold)")
    finally:
        if not given:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "outputs_equal"}
    out = {"rounds": rounds, "median": med, "outputs_equal": all(r["outputs_equal"] for r in rounds)}
    print(f"\nmedian of {len(rounds)}: TTFT cold {med['ttft_cold_no_tier_s']:.3f} s without the tier, "
          f"{med['ttft_cold_s']:.3f} s with it, after restart {med['ttft_restart_s']:.3f} s "
          f"= {med['restart_vs_cold']:.3f} of cold (RAM hit {med['ttft_ram_hit_s']:.3f} s); "
          f"{med['cached_tokens_restart']:.0f} of {med['prompt_tokens']:.0f} tokens from disk\n"
          f"per page ({med['bytes_per_page'] / 1024:.0f} KiB): save {med['save_ms_per_page']:.3f} ms on the engine thread, "
          f"write {med['write_ms_per_page']:.3f} ms on the writer thread, load {med['load_ms_per_page']:.3f} ms; "
          f"engine build {med['build_cold_s']:.2f} s empty dir, {med['build_restart_s']:.2f} s populated; "
          f"{torch.get_num_threads()} threads")
    print(f"wrote {record('prefix-restart', a, out)}")
    return out
