"""Logprobs under speculation: greedy logprobs (chosen and top-n, bonus token included) equal plain
decoding's, and sampled logprobs equal a full-recompute reference, with top-k support kept and seeded
output reproducible.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from tests.spec_helpers import NGRAM, SYN, make_llm
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)
from tests.tiny import ref_logits, tiny_model


@pytest.mark.parametrize("algo,K", [(SYN, 4), (SYN, 9), (NGRAM, 3)])
def test_logprobs_spec_equal_plain(algo: str, K: int, verify_mode: str) -> None:
    model = tiny_model("qwen2", dtype=torch.float32, seed=2)
    with torch.no_grad():  # logits of a few units, as real LMs: fp32 batch-shape noise stays ~3e-6
        model.lm_head.mul_(0.3)
    prompts = [[1, 2, 3, 1, 2, 3], [40, 41], [7] * 11, [60, 70, 80, 90]]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    plain = make_llm(model, page_size=4).generate(prompts, sp)
    llm = make_llm(model, algo, K, rate=0.8, page_size=4)
    spec = llm.generate(prompts, sp)
    assert llm.engine.stats.num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(b.token_ids) == 24
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.token_id == la.token_id
            assert abs(lb.logprob - la.logprob) <= 1e-5
            assert [i for i, _ in lb.top] == [i for i, _ in la.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) <= 1e-5


def test_sampled_logprobs_under_spec_match_reference() -> None:
    model = tiny_model("llama", seed=4)
    llm = make_llm(model, SYN, 6, rate=0.9)
    prompts = [[3, 3, 3, 3], [9, 8, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, top_k=5, max_tokens=20, logprobs=2, seed=11))
    assert llm.engine.stats.num_accepted_tokens > 0
    for o, p in zip(outs, prompts):
        rows = ref_logits(model, p + o.token_ids[:-1])[len(p) - 1 :]
        lps = torch.log_softmax(rows, dim=-1)
        for lp, t, row, lrow in zip(o.logprobs, o.token_ids, rows, lps):
            assert abs(lp.logprob - float(lrow[t])) < 1e-9
            assert int((row > row[t]).sum()) < 5  # top_k support holds under speculation
    again = make_llm(model, SYN, 6, rate=0.9).generate(prompts, SamplingParams(
        temperature=0.7, top_k=5, max_tokens=20, logprobs=2, seed=11))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible
