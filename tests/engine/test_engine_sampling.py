"""Sampling parameters of the plain engine: truncation to one token equals greedy; top-k, top-p and min_p
keep every sample in their support; temperature scales the distribution as predicted; seeds are
reproducible and independent of neighbours, joins and preemption; unseeded requests differ; n samples.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.core import SamplingParams
from tests.engine_helpers import (  # noqa: F401, F811
    PROMPTS, _sample, assert_no_leak, greedy_ref, llama, make_llm, output_rows, rand_prompt, run,
)
from tests.tiny import ref_logits


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.9, min_p=0.5),
                                dict(temperature=1e-4)])
def test_truncation_to_one_token_equals_greedy(llama, kw) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    params = dict(temperature=1.3, max_tokens=12, seed=5)
    params.update(kw)
    outs = _sample(llm, PROMPTS, **params)
    for o, p in zip(outs, PROMPTS):
        assert o.token_ids == greedy_ref(llama, p, 12)


def _probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)


def test_top_k_top_p_min_p_support(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    T = 1.5
    cases = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=5, top_p=0.7, min_p=0.05), {}]
    outside = {}
    for ci, kw in enumerate(cases):
        outs = _sample(llm, PROMPTS * 2, temperature=T, max_tokens=12, n=2, **kw)
        violations = 0
        for o, p in zip(outs, PROMPTS * 2):
            for c in o.outputs:
                rows = output_rows(llama, p, c.token_ids)
                for row, t in zip(rows, c.token_ids):
                    pr = _probs(row, T)
                    ok = True
                    if "top_k" in kw:
                        ok &= int((row > row[t]).sum()) < kw["top_k"]
                    if "top_p" in kw:
                        ok &= float(pr[pr > pr[t]].sum()) < kw["top_p"] + 1e-9
                    if "min_p" in kw:
                        ok &= float(pr[t]) >= kw["min_p"] * float(pr.max()) - 1e-12
                    if not kw:  # unrestricted sampling must leave the top-3 sometimes: the tests above mean something
                        ok = int((row > row[t]).sum()) < 3
                    violations += not ok
        outside[ci] = violations
    assert outside[0] == outside[1] == outside[2] == outside[3] == 0
    assert outside[4] > 0


def test_temperature_scales_the_distribution(llama) -> None:  # noqa: ANN001
    """top_k=2 leaves a two-token distribution: P(top-1) = sigmoid((l1 - l2) / T)."""
    llm = make_llm(llama)
    prompt = None
    for cand in ([1, 2, 3], [4, 5], [10, 11, 12], [20], [30, 31], [40, 41, 42], [5], [6, 7]):
        row = ref_logits(llama, cand)[-1]
        top = torch.topk(row, 2).values
        gap = float(top[0] - top[1])
        if 0.3 < gap < 2.5:
            prompt = cand
            break
    assert prompt is not None
    best = int(row.argmax())
    N = 256
    for T in (0.5, 2.0):
        toks = []
        for s in range(N // 64):
            out = _sample(llm, [prompt], temperature=T, top_k=2, max_tokens=1, n=64, seed=1000 * s + 1)[0]
            toks += [c.token_ids[0] for c in out.outputs]
        assert set(toks) <= set(torch.topk(row, 2).indices.tolist())
        p = 1 / (1 + math.exp(-gap / T))
        freq = toks.count(best) / N
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / N) + 0.01, (T, freq, p)


def test_seeds_reproducible_and_independent_of_neighbours(llama) -> None:  # noqa: ANN001
    p = [3, 1, 4, 1, 5]
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = make_llm(llama).generate([p], sp)[0].token_ids
    assert make_llm(llama).generate([p], sp)[0].token_ids == alone
    assert make_llm(llama, seed=99).generate([p], sp)[0].token_ids == alone  # engine seed irrelevant when seeded
    other = make_llm(llama).generate([p], SamplingParams(temperature=1.0, max_tokens=16, seed=1235))[0].token_ids
    assert other != alone
    # in a crowded batch, joining mid-way, under preemption in a tiny pool: same tokens
    rng = random.Random(5)
    llm = make_llm(llama, kv_cache_memory="24KiB", page_size=4, max_prefill_tokens=5)
    eng = llm.engine
    neighbours = []
    for i in range(3):
        neighbours.append(eng.add_request(rand_prompt(rng, 6), SamplingParams(temperature=1.0, max_tokens=14)))
    eng.step()
    eng.step()
    target = eng.add_request(p, sp)
    for i in range(3):
        neighbours.append(eng.add_request(rand_prompt(rng, 4), SamplingParams(temperature=0, max_tokens=12)))
        eng.step()
    run(eng)
    assert target.output_ids == alone
    assert sum(r.num_preemptions for r in neighbours + [target]) > 0
    assert_no_leak(eng)


def test_unseeded_requests_differ_but_engine_seed_reproduces(llama) -> None:  # noqa: ANN001
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a = [o.token_ids for o in make_llm(llama, seed=7).generate([[1, 2]] * 3, sp)]
    b = [o.token_ids for o in make_llm(llama, seed=7).generate([[1, 2]] * 3, sp)]
    assert a == b and len({tuple(x) for x in a}) > 1


def test_n_samples(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, n=4))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.token_ids == out.outputs[0].token_ids
    # seeded: sample i uses seed + i
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=40))[0]
    for i, c in enumerate(out.outputs):
        single = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, seed=40 + i))[0]
        assert c.token_ids == single.token_ids
    # greedy: n identical copies
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, n=3))[0]
    assert all(c.token_ids == greedy_ref(llama, [1, 2, 3], 8) for c in out.outputs)
    assert_no_leak(llm.engine)
