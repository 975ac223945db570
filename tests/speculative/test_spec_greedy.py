"""Greedy speculative output equals plain output, token for token, for any K, drafter (SYNTHETIC, NGRAM),
verify mode, page size, prefill chunking and batch composition — also under preemption in a tiny KV
pool and when padding a verify window runs up to the model's last position — with engine counters
equal to the per-request sums and nothing leaked.
"""
from __future__ import annotations

import random

import pytest

from specserve.core import SamplingParams
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, check_stats, drive, make_llm, rand_plan
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)
from tests.tiny import reference_greedy, tiny_model


GRID_K = [1, 2, 3, 4, 5, 6, 8, 11, 13, 16]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_spec_equals_plain(seed: int, verify_mode: str) -> None:
    arch = ("llama", "qwen2", "qwen3")[seed % 3]
    model = tiny_model(arch, seed=seed)
    K = GRID_K[seed]
    algo = SYN if seed % 2 == 0 else NGRAM
    rate = (0.0, 0.5, 0.9, 1.0)[(seed // 2) % 4]
    page_size = (1, 4, 16)[seed % 3]
    max_prefill = (7, 64, 2048)[(seed // 3) % 3]
    rng = random.Random(100 + seed)
    plan = rand_plan(rng, 6)
    # one sampled neighbour: its randomness must not disturb the greedy requests
    plan.append((1, [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=20, seed=seed)))
    opts = dict(page_size=page_size, max_prefill_tokens=max_prefill)
    plain = drive(make_llm(model, **opts), plan)
    llm = make_llm(model, algo, K, rate, **opts)
    assert llm.engine.verify_mode == verify_mode
    spec = drive(llm, plan)
    for (_, prompt, sp), a, b in zip(plan, plain, spec):
        if sp.greedy:
            assert b.output_ids == a.output_ids, (b.request_id, algo, K, rate)
            assert b.finish_reason == a.finish_reason
    if seed == 0:  # plain itself against the full-recompute oracle
        for (_, prompt, sp), a in zip(plan, plain):
            if sp.greedy and not sp.needs_penalties:
                assert a.output_ids == reference_greedy(model, prompt, sp.max_tokens)
    assert llm.engine.stats.num_drafts > 0
    if algo == SYN and rate == 1.0:
        greedy = [r for r, (_, _, sp) in zip(spec, plan) if sp.greedy and not sp.needs_penalties]
        assert all(r.spec_accepted_tokens == r.spec_draft_tokens for r in greedy)
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("algo", [SYN, NGRAM])
def test_greedy_spec_equals_plain_every_k(algo: str) -> None:
    model = tiny_model("llama", seed=21)
    rng = random.Random(algo)
    plan = rand_plan(rng, 3, max_join=3)
    plain = [r.output_ids for r in drive(make_llm(model, page_size=4), plan)]
    for K in range(1, 17):
        llm = make_llm(model, algo, K, rate=0.8, page_size=4)
        spec = drive(llm, plan)
        assert [r.output_ids for r in spec] == plain, K
        check_stats(llm.engine, spec)
        assert_no_leak(llm.engine)


@pytest.mark.parametrize("algo,K", [(SYN, 4), (SYN, 16), (NGRAM, 8)])
def test_greedy_spec_equals_plain_under_preemption(algo: str, K: int, verify_mode: str) -> None:
    """A tiny pool: requests are preempted and recomputed, drafts lose their windows, the SYNTHETIC
    draft pool runs out; the output never changes."""
    model = tiny_model("qwen2", seed=5)
    rng = random.Random(K)
    plan = [(rng.randint(0, 4), [rng.randrange(V) for _ in range(rng.randint(2, 9))],
             SamplingParams(temperature=0, max_tokens=rng.randint(10, 24))) for _ in range(7)]
    plain = drive(make_llm(model, page_size=4), plan)
    mem = "48KiB" if algo == SYN else "24KiB"  # SYNTHETIC gives half the budget to its draft pool
    llm = make_llm(model, algo, K, rate=0.9, kv_cache_memory=mem, page_size=4, max_prefill_tokens=8)
    spec = drive(llm, plan)
    assert sum(r.num_preemptions for r in spec) > 0
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


def test_padded_verify_near_context_end() -> None:
    """Padding a short window up to a neighbour's width must not run past the model's positions."""
    model = tiny_model("llama", seed=0, max_position_embeddings=40)
    for mode in ("compact", "padded"):
        for ps in (4, 16):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPECSERVE_SPECULATIVE_VERIFY_PACKING", mode)
                plan = [(0, [1], SamplingParams(temperature=0, max_tokens=36)),
                        (0, list(range(1, 24)), SamplingParams(temperature=0, max_tokens=100)),
                        (0, list(range(1, 33)), SamplingParams(temperature=0, max_tokens=100))]
                plain = drive(make_llm(model, page_size=ps), plan)
                llm = make_llm(model, SYN, 8, rate=1.0, page_size=ps)
                spec = drive(llm, plan)
                assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
                assert [r.seq_len for r in spec[1:]] == [40, 40]
                assert_no_leak(llm.engine)
