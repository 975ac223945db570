"""Shared helpers of the speculative-engine tests (tests/test_spec_*.py and the drafter, tree, lattice and
draft-window tests): building an LLM with a drafter, driving an engine through a join plan, checking
that nothing leaks, from-scratch K/V, engine-wide vs per-request speculation counters, random plans,
and the `verify_mode` fixture that runs a test under both ragged verify modes (compact, padded).
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.cache.kv_pool import KVPool
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from specserve.runtime.runner import ModelRunner


V = 97
SYN = "SYNTHETIC"
NGRAM = "NGRAM"


def make_llm(model, algo: str | None = None, K: int = 4, rate: float = 0.7, **opts) -> LLM:  # noqa: ANN001
    opts.setdefault("kv_cache_memory", "512KiB")
    if algo:
        opts.update(speculative_algorithm=algo, speculative_num_draft_tokens=K)
        if algo == SYN:
            opts["speculative_synthetic_accept_rate"] = rate
    return LLM.from_model(model, **opts)


def drive(llm: LLM, plan: list[tuple[int, list[int], SamplingParams]], on_step=None, max_steps: int = 3000):  # noqa: ANN001, ANN201
    """plan: (engine step at which the request joins, prompt, params). Returns requests in plan order."""
    eng = llm.engine
    order = sorted(range(len(plan)), key=lambda i: plan[i][0])
    reqs: list = [None] * len(plan)
    step = 0
    while order or eng.has_unfinished():
        while order and plan[order[0]][0] <= step:
            i = order.pop(0)
            reqs[i] = eng.add_request(plan[i][1], plan[i][2], request_id=f"p{i}")
        eng.step()
        step += 1
        if on_step:
            on_step(eng, step)
        assert step < max_steps, "engine made no progress"
    return reqs


def assert_no_leak(eng) -> None:  # noqa: ANN001
    assert not eng.has_unfinished() and eng.requests == {}
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_pages
    d = eng.drafter
    if d is not None and hasattr(d, "kv"):
        assert d.state == {}
        assert d.kv.allocator.num_free == d.kv.allocator.num_pages


def fresh_kv(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """K/V of ids from one from-scratch forward, per layer [len(ids), kv_heads, head_dim]."""
    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    ModelRunner(model, kv).forward([pt], [0], [ids], [[]])
    slots = torch.tensor(kv.slots(pt, 0, len(ids)))
    return [k[slots] for k in kv.k], [v[slots] for v in kv.v]


def check_stats(eng, reqs) -> None:  # noqa: ANN001
    """Engine-wide counters equal the per-request sums; per-request counters are self-consistent."""
    s = eng.stats
    assert s.num_drafts == sum(r.spec_verify_ct for r in reqs)
    assert s.num_draft_tokens == sum(r.spec_draft_tokens for r in reqs)
    assert s.num_accepted_tokens == sum(r.spec_accepted_tokens for r in reqs)
    width = max([len(s.accepted_tokens_per_pos)] + [len(r.spec_accepted_per_pos) for r in reqs])
    per_pos = [0] * width
    for r in reqs:
        for i, c in enumerate(r.spec_accepted_per_pos):
            per_pos[i] += c
    assert per_pos == s.accepted_tokens_per_pos + [0] * (width - len(s.accepted_tokens_per_pos))
    assert sum(s.accepted_tokens_per_pos) == s.num_accepted_tokens
    for r in reqs:
        assert sum(r.spec_accepted_per_pos) == r.spec_accepted_tokens <= r.spec_draft_tokens
        assert all(a >= b for a, b in zip(r.spec_accepted_per_pos, r.spec_accepted_per_pos[1:]))
        assert all(c <= r.spec_verify_ct for c in r.spec_accepted_per_pos)
        assert r.spec_draft_tokens <= r.spec_verify_ct * eng.draft_stage.lookahead(r)  # forced grammar drafts may exceed K
        # every emitted token is the prefill's first token, a verify's bonus/correction, an accepted
        # draft or a plain-decode token: accepted drafts never exceed what was emitted
        if r.finish_reason != "error":
            assert r.spec_accepted_tokens + r.spec_verify_ct <= max(len(r.output_ids) - 1, 0) + (r.spec_verify_ct > 0)


def rand_plan(rng: random.Random, n: int, max_join: int = 6) -> list[tuple[int, list[int], SamplingParams]]:
    plan = []
    for i in range(n):
        L = rng.choice([1, 2, 5, 9, 14, 23, 31])
        if rng.random() < 0.5:  # repetitive prompt: gives NGRAM something to match
            unit = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
            prompt = (unit * L)[:L]
        else:
            prompt = [rng.randrange(V) for _ in range(L)]
        kw: dict = dict(temperature=0, max_tokens=rng.randint(8, 36))
        if i % 4 == 3:
            kw.update(repetition_penalty=1.3)
        elif i % 5 == 4:
            kw.update(presence_penalty=0.6, frequency_penalty=0.4)
        plan.append((rng.randint(0, max_join), prompt, SamplingParams(**kw)))
    return plan


@pytest.fixture(params=["compact", "padded"])
def verify_mode(request, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("SPECSERVE_SPECULATIVE_VERIFY_PACKING", request.param)
    return request.param
