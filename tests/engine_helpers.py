"""Shared helpers of the plain (non-speculative) engine tests (tests/test_engine_*.py): building an LLM,
full-recompute logits rows and cached greedy references, driving an engine to completion, leak checks,
the module-scoped tiny llama fixture and the shared prompts.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from tests.tiny import ref_logits, reference_greedy, tiny_model


V = 97  # tiny_model vocabulary


def make_llm(model, **opts) -> LLM:  # noqa: ANN001
    opts.setdefault("kv_cache_memory", "256KiB")
    return LLM.from_model(model, **opts)


def output_rows(model, prompt: list[int], out: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Row j: the raw logits that produced out[j]."""
    seq = prompt + out[:-1]
    return ref_logits(model, seq)[len(prompt) - 1 :]


def run(eng, max_steps: int = 5000) -> int:  # noqa: ANN001
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return steps


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


_REF: dict[tuple, list[int]] = {}


def greedy_ref(model, prompt: list[int], n: int, key=None) -> list[int]:  # noqa: ANN001
    k = (id(model) if key is None else key, tuple(prompt))
    if k not in _REF or len(_REF[k]) < n:
        _REF[k] = reference_greedy(model, prompt, n)
    return _REF[k][:n]


def assert_no_leak(eng) -> None:  # noqa: ANN001
    assert not eng.has_unfinished()
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_pages
    assert eng.requests == {}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


def _sample(llm: LLM, prompts, **kw):  # noqa: ANN001, ANN202
    return llm.generate(prompts, SamplingParams(**kw))


PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [50, 60, 70, 80, 90, 10, 20], [33]]


def fixed_curves(monkeypatch: pytest.MonkeyPatch, target, draft=None) -> None:  # noqa: ANN001
    """The cost policy plans on these step-cost curves (CostModels) instead of this machine's timings: loaded as
    if cached and already checked (nothing left to measure); `draft` for a draft model's runner."""
    from pathlib import Path

    from specserve.cost.curve import Calibration, CostModel

    def load(cls, runner, key, cache_dir=None):  # noqa: ANN001, ANN202
        model = draft if key.startswith("draft-") and draft is not None else target
        return model, Calibration(runner, model, Path(), [], probing=False)

    monkeypatch.setattr(CostModel, "load", classmethod(load))
