"""Shared pieces of the bench commands: engine flags, prompt loading, run records."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ..config import EngineConfig, parse_field
from ..flags import add_engine_args
from .machine import machine_info
from .workloads import WORKLOADS, Messages, from_jsonl, load


def add_prompt_args(p: argparse.ArgumentParser, default: str = "humaneval") -> None:
    p.add_argument("model", nargs="?", default=None, help="target (default smollm2-135m)")
    p.add_argument("--workload", nargs="+", default=[default], help=f"one or more of {', '.join(WORKLOADS)}")
    p.add_argument("--prompts", default=None, help="JSONL file of prompts instead of --workload")
    p.add_argument("--prompt-field", default="prompt", help="field of --prompts holding the prompt text")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/<cmd>-<time>.json)")
    add_engine_args(p)


def workloads(a: argparse.Namespace) -> dict[str, list[Messages]]:
    if a.prompts:
        return {Path(a.prompts).stem: from_jsonl(a.prompts, a.prompt_field)[: a.num_prompts]}
    return {w: load(w, a.num_prompts) for w in a.workload}


def _ver(pkg: str) -> str | None:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def record(cmd: str, a: argparse.Namespace, results: Any, extra: dict[str, Any] | None = None) -> Path:
    """Write results with the machine, versions, model, drafter and flags that produced them."""
    out = Path(a.output) if a.output else Path("bench/results") / f"{cmd}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": cmd, "args": {k: v for k, v in vars(a).items() if not callable(v)},
        "machine": machine_info(),
        "versions": {p: _ver(p) for p in ("specserve", "torch", "transformers", "llama-cpp-python")},
        "results": results, **(extra or {}),
    }
    out.write_text(json.dumps(doc, indent=1, default=str))
    return out


def config_args(a: argparse.Namespace, spec: str, flag: str) -> tuple[argparse.Namespace, str, str]:
    """One configuration named on the command line: ALGO[+WINDOW][:flag=value...] (e.g. NGRAM+cost,
    EAGLE3:speculative-eagle-topk=4; ALGO `plain` = no speculation). Returns the bench's arguments with that
    algorithm, window and flags set, the algorithm and the window."""
    head, *overrides = spec.split(":")
    algo, _, window = head.partition("+")
    a2 = argparse.Namespace(**vars(a))
    a2.speculative_algorithm = None if algo == "plain" else algo
    if window:
        a2.speculative_window = window
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if key not in fields or not value:
            raise ValueError(f"{flag} {spec!r}: {o!r} is not flag=value for an engine flag")
        setattr(a2, key, parse_field(value, fields[key], source=f"{flag} {spec}"))
    return a2, algo, window



def config_flags(spec: str, flag: str) -> list[str]:
    """A configuration (config_args' ALGO[+WINDOW][:flag=value...]) as `specserve serve` flags."""
    head, *overrides = spec.split(":")
    algo, _, window = head.partition("+")
    out = ["--speculative-algorithm", "NONE" if algo == "plain" else algo]
    out += ["--speculative-window", window] if window else []
    for o in overrides:
        key, _, value = o.partition("=")
        if not key or not value:
            raise ValueError(f"{flag} {spec!r}: {o!r} is not flag=value for an engine flag")
        out += [f"--{key.lstrip('-')}", value]
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tok/s (the lower middle of an even count), with every run's tok/s beside it."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        out["output_tok_s_runs"] = [r["output_tok_s"] for r in runs]
    return out
