"""The draft confidence a drafter records (what `confidence` windows, the drafters' early stop and the `cost`
policy's cuts read). A sampled draft's confidence is E_{x~q}[q(x)] = Σ q², the drafted token's probability in
expectation — a function of the row alone, since a cut that reads the drawn token's own q(x) biases the output
(shown below: the exact-distribution test fails with it); never the row's top probability, which overstates a
sampled draft's chance. An argmax draft's confidence is its own probability."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specserve.runtime.sampling as sampling
from specserve.core import DraftPlan, Proposal, SamplingParams
from tests.dist import engine_vs_exact_joint
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, random_drafter_llm


def _record(llm) -> list[Proposal]:  # noqa: ANN001
    drafter, seen = llm.engine.drafter, []
    propose = drafter.propose

    def record(reqs: list, plan: DraftPlan) -> Proposal:
        p = propose(reqs, plan)
        seen.append(p)
        return p

    drafter.propose = record
    return seen


@pytest.mark.parametrize("algo", ["eagle3", "mtp", "dflash"])
def test_sampled_confidence_is_the_expected_q_of_the_row(tmp_path: Path, algo: str) -> None:
    llm = random_drafter_llm(tmp_path, algo, "auto")
    seen = _record(llm)
    llm.generate([[0, 1, 2, 1]] * 4, SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True))
    checked = below_top = 0
    for p in seen:
        for toks, q, c in zip(p.tokens, p.q, p.confidence):
            if not toks:
                continue
            want = (q * q).sum(dim=-1)
            assert torch.allclose(c.to(want.dtype), want), (toks, c, want)
            checked += len(toks)
            below_top += int((want < q.amax(dim=-1) - 1e-9).sum())
    assert checked > 20 and below_top > 0  # rows whose top probability would have overstated the confidence


N = 4 * DIST_N  # at DIST_N an unbiased eagle3 run sits at the bar (X² 305 vs 304); 4× the samples: 190 vs 295


@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_confidence_windows_at_t_above_0_keep_the_target_distribution(tmp_path: Path, algo: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Confidence windows cut sampled drafts and the output is still the exact target joint; with the drawn
    token's own q as its confidence (the negative control) the same test fails."""
    opts = dict(speculative_window="confidence", speculative_confidence_threshold=0.3)
    fit = engine_vs_exact_joint(random_drafter_llm(tmp_path / "ok", algo, "sample", **opts), [1, 2, 1, 2],
                                DIST_LEN, DIST_PARAMS, N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0
    import specserve.drafters.learned as learned

    drawn: list[int] = []
    monkeypatch.setattr(learned, "sample", lambda q, g: drawn.append(sampling.sample(q, g)) or drawn[-1])
    monkeypatch.setattr(learned, "expected_q", lambda q: q[drawn[-1]])  # the biased confidence: q(token)
    bad = engine_vs_exact_joint(random_drafter_llm(tmp_path / "bad", algo, "sample", **opts), [1, 2, 1, 2],
                                DIST_LEN, DIST_PARAMS, N)
    assert not bad.ok, bad
