"""SYNTHETIC acceptance behaves as configured (rate 1: every draft accepted, rate 0: none, rate 0.5: the
expected acceptance length) and the engine-wide speculation counters equal the per-request sums, also
with sampled requests, joins and an abort.
"""
from __future__ import annotations

import random

import pytest

from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, check_stats, make_llm
from tests.tiny import reference_greedy, tiny_model


@pytest.mark.parametrize("K", [3, 8])
def test_synthetic_acceptance_extremes(K: int) -> None:
    model = tiny_model("llama", seed=9)
    prompts = [[1, 2, 3], [50, 51, 52, 53, 54], [7]]
    rounds = 3
    mt = 1 + rounds * (K + 1)
    llm = make_llm(model, SYN, K, rate=1.0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=mt))
    for o, p in zip(outs, prompts):
        mi = o.meta_info
        assert "SYNTHETIC" in mi["speculative_algorithm"] and "test" in mi["speculative_algorithm"]
        assert mi["spec_verify_ct"] == rounds and mi["spec_accept_length"] == K + 1
        assert mi["spec_draft_tokens"] == mi["spec_accepted_tokens"] == rounds * K
        assert mi["spec_accepted_per_pos"] == [rounds] * K
        assert o.token_ids == reference_greedy(model, p, mt)
    assert llm.engine.stats.acceptance_length == K + 1
    # rate 0: every draft is wrong → one token per verify; the last step has no room for a draft
    llm0 = make_llm(model, SYN, K, rate=0.0)
    outs0 = llm0.generate(prompts, SamplingParams(temperature=0, max_tokens=mt))
    for o, ref in zip(outs0, outs):
        mi = o.meta_info
        assert o.token_ids == ref.token_ids
        assert mi["spec_accept_length"] == 1.0 and mi["spec_accepted_tokens"] == 0
        assert mi["spec_verify_ct"] == mt - 2 and mi["spec_accepted_per_pos"] == [0] * K
    assert llm0.engine.stats.acceptance_length == 1.0
    assert LLM.from_model(model).generate([[1]], SamplingParams(max_tokens=2))[0].meta_info.get(
        "spec_verify_ct") is None


def test_synthetic_acceptance_rate_half() -> None:
    model = tiny_model("llama", seed=9)
    K, rate = 4, 0.5
    llm = make_llm(model, SYN, K, rate=rate)
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(5)] for _ in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60))
    expected = 1 + sum(rate ** i for i in range(1, K + 1))  # 1.9375 before end effects
    s = llm.engine.stats
    assert s.num_drafts > 100
    assert abs(s.acceptance_length - expected) < 0.3, s.acceptance_length
    assert s.accepted_tokens_per_pos[0] / s.num_drafts == pytest.approx(rate, abs=0.12)


def test_engine_stats_equal_request_sums() -> None:
    model = tiny_model("qwen3", seed=12)
    rng = random.Random(12)
    for algo in (NGRAM, SYN):
        llm = make_llm(model, algo, 5, rate=0.6, page_size=4, kv_cache_memory="64KiB")
        eng = llm.engine
        reqs = []
        for i in range(8):
            L = rng.randint(2, 10)
            unit = [rng.randrange(V) for _ in range(2)]
            kw = dict(temperature=0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=i)
            reqs.append(eng.add_request((unit * L)[:L], SamplingParams(max_tokens=rng.randint(5, 30), **kw)))
            eng.step()
        eng.step()
        eng.abort(reqs[0].request_id)
        while eng.has_unfinished():
            eng.step()
        assert eng.stats.num_drafts > 0
        check_stats(eng, reqs)
        assert eng.stats.acceptance_length == pytest.approx(
            1 + sum(r.spec_accepted_tokens for r in reqs) / sum(r.spec_verify_ct for r in reqs))
        assert_no_leak(eng)
