"""The draft confidence a learned drafter records (what `confidence` windows and the `cost` policy's cuts
read) is the probability of the token it drafted, under the distribution it drew that token from — not the
top probability of the row, which overstates it wherever a draft is sampled (T > 0) or masked (a grammar)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.core import Proposal, SamplingParams
from tests.drafter_setup import random_drafter_llm


@pytest.mark.parametrize("algo", ["eagle3", "mtp", "dflash"])
def test_confidence_is_q_of_the_drafted_token(tmp_path: Path, algo: str) -> None:
    llm = random_drafter_llm(tmp_path, algo, "auto")
    drafter, seen = llm.engine.drafter, []
    propose = drafter.propose

    def record(reqs: list, window: list[int]) -> Proposal:
        p = propose(reqs, window)
        seen.append(p)
        return p

    drafter.propose = record
    llm.generate([[0, 1, 2, 1]] * 4, SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True))
    checked = below_top = 0
    for p in seen:
        for toks, q, c in zip(p.tokens, p.q, p.confidence):
            if not toks:
                continue
            want = q[torch.arange(len(toks)), torch.tensor(toks)]
            assert torch.allclose(c.to(want.dtype), want), (toks, c, want)
            checked += len(toks)
            below_top += int((want < q.amax(dim=-1) - 1e-9).sum())
    assert checked > 20 and below_top > 0  # sampled drafts that were not the row's top token were seen
