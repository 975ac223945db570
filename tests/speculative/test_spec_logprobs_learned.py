"""Logprobs under the learned drafters (EAGLE-3 chains and EAGLE-2 trees, DFlash, DSpark; the tiny
trained drafters of tests/drafter_setup.py on an fp64 target): greedy logprobs (chosen token and top-n
alternatives, ids and values, every emitted token including bonus/correction tokens) equal plain
decoding's, and seeded sampled logprobs equal a full-recompute reference of the tokens emitted.

Regressions caught: logprobs taken from the wrong verify row (off by one, or a tree's node order
instead of its accepted path order after compaction), from processed instead of raw logits, from the
draft's distribution, or missing for tokens emitted in a multi-token accept.
"""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.drafter_setup import _spec_llm, _target
from tests.tiny import ref_logits

TREE = {"speculative_eagle_topk": 3, "speculative_num_steps": 3}
CASES = [("eagle3", {}), ("dflash", {}), ("dspark", {}), ("eagle3", TREE), ("mtp", {"speculative_eagle_topk": 2})]
IDS = ["eagle3", "dflash", "dspark", "eagle3-tree", "mtp-tree"]
PROMPTS = [[1, 2, 3, 4, 5, 6], [40, 41], [7] * 9, [60, 70, 80, 90, 11]]
N, TOP = 24, 5


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9  # fp64 target: only batch-shape rounding differs


@pytest.mark.parametrize("algo,opts", CASES, ids=IDS)
def test_greedy_logprobs_equal_plain(trained: dict, algo: str, opts: dict) -> None:
    sp = SamplingParams(temperature=0, max_tokens=N, logprobs=TOP)
    llm = _spec_llm(trained, algo, **opts)
    spec = llm.generate(PROMPTS, sp)
    plain = LLM.from_model(llm.engine.model, kv_cache_memory="512KiB").generate(PROMPTS, sp)
    assert llm.engine.stats.num_accepted_tokens > 0  # multi-token accepts happened
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(b.token_ids) == N
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.token_id == la.token_id and _close(lb.logprob, la.logprob)
            assert [i for i, _ in lb.top] == [i for i, _ in la.top] and len(lb.top) == TOP
            assert all(_close(x, y) for (_, x), (_, y) in zip(la.top, lb.top))


@pytest.mark.parametrize("algo,opts", CASES, ids=IDS)
def test_sampled_logprobs_match_reference(trained: dict, algo: str, opts: dict) -> None:
    """Sampled (seeded) under the drafter: every reported logprob and top-n alternative is the raw
    target distribution at the emitted prefix (recomputed from scratch), top-k support holds, and
    the same seeds reproduce the same tokens."""
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=N, logprobs=2, seed=11)
    llm = _spec_llm(trained, algo, **opts)
    outs = llm.generate(PROMPTS, sp)
    assert llm.engine.stats.num_accepted_tokens > 0
    model = _target()
    for o, p in zip(outs, PROMPTS):
        assert len(o.logprobs) == len(o.token_ids) == N
        rows = ref_logits(model, p + o.token_ids[:-1])[len(p) - 1 :]
        lps = torch.log_softmax(rows, dim=-1)
        for lp, t, row, lrow in zip(o.logprobs, o.token_ids, rows, lps):
            assert lp.token_id == t and _close(lp.logprob, float(lrow[t]))
            vals, ids = lrow.topk(2)
            assert [i for i, _ in lp.top] == ids.tolist()
            assert all(_close(x, float(v)) for (_, x), v in zip(lp.top, vals))
            assert int((row > row[t]).sum()) < 5  # top_k support holds under speculation
    again = _spec_llm(trained, algo, **opts).generate(PROMPTS, sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
