"""The power of the engine-level distribution test (tests/dist.py) that the learned-drafter, hybrid,
lattice, standalone and grammar distribution tests share: on one setup (a random DSpark drafter, the
exact joint of the first 5 tokens over a 3-token vocabulary, 2500 seeded requests), the real acceptance
rules pass and deliberately biased ones FAIL, so a passing distribution test means something.
Slow (~20-40 s each: 2500 engine requests).

Biases: the ratio test min(1, 1.2·p/q) (accepts too often: over-weights the draft's favourite tokens),
and a correction drawn from p instead of the residual max(p − q, 0) (double-counts tokens the draft
already proposed). Measured (deterministic seeds): X² 224 (sample), 219 (block) against a bar of 336;
1.2× ratio bias 394 (eagle3: 462), no residual 742. Total variation, the old statistic, put the 1.2× bias
at 0.147 against a bar of 0.162: undetected.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import ACCEPT_STAGE, biased_ratio_rule, engine_vs_exact_joint, no_residual_rule
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, random_drafter_llm

BIASED = {"ratio-1.2": biased_ratio_rule(1.2), "no-residual": no_residual_rule}


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sample", "block", "ratio-1.2", "no-residual"])
def test_distribution_test_passes_real_rules_and_fails_biased_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   rule: str) -> None:
    if rule in BIASED:  # the stage calls accept_sample for --speculative-accept sample
        monkeypatch.setattr(f"{ACCEPT_STAGE}.accept_sample", BIASED[rule])
    llm = random_drafter_llm(tmp_path, "dspark", "block" if rule == "block" else "sample")
    fit = engine_vs_exact_joint(llm, [1, 2], DIST_LEN, DIST_PARAMS, DIST_N)
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0  # the rule under test did run
    if rule in BIASED:
        assert not fit.ok, f"a biased rule passed: {fit}"
    else:
        assert fit.ok, fit
