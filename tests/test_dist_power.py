"""Negative controls for the engine-level distribution tests of learned drafters: the same setup and
pass bar as tests/test_drafters.py::test_sampled_drafts_match_target_distribution (a random drafter,
the exact joint of the first 5 tokens over a 3-token vocabulary, 2500 seeded requests), with the
acceptance rule swapped for a deliberately biased one, must FAIL — so a passing distribution test means
something. The real rule on the same setup passes (the positive half, in test_drafters.py).
Slow (~30-80 s each: 2500 engine requests), hence one drafter (DSpark).

Biases: the ratio test min(1, 1.2·p/q) (accepts too often: over-weights the draft's favourite tokens),
and a correction drawn from p instead of the residual max(p − q, 0) (double-counts tokens the draft
already proposed).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import ACCEPT_STAGE, biased_ratio_rule, engine_vs_exact_joint, no_residual_rule, tv_threshold
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, random_drafter_llm


POWERLESS = pytest.mark.xfail(strict=True, reason=(
    "the joint-TV test over 3^5 cells with N=2500 has a noise floor of ~0.10 and a bar of ~0.16: a 1.2x "
    "ratio bias moves TV only to ~0.15 (measured: dspark 0.147, eagle3 0.157), so it passes undetected. "
    "Strengthen the statistic (per-position marginals, or larger N) and this starts failing as it should"))


@pytest.mark.slow
@pytest.mark.parametrize("bias", ["no-residual", pytest.param("ratio-1.2", marks=POWERLESS)])
def test_biased_rule_fails_the_distribution_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bias: str) -> None:
    rule = biased_ratio_rule(1.2) if bias == "ratio-1.2" else no_residual_rule
    monkeypatch.setattr(f"{ACCEPT_STAGE}.accept_sample", rule)
    llm = random_drafter_llm(tmp_path, "dspark", "sample")
    tv, tv_ref, outs = engine_vs_exact_joint(llm, [1, 2], DIST_LEN, DIST_PARAMS, DIST_N)
    assert sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0  # the biased rule did run
    # measured (deterministic seeds): no-residual TV 0.203 (eagle3: 0.192) against a bar of 0.162
    assert tv > tv_threshold(tv_ref), f"a biased rule passed: TV {tv:.4f} ≤ bar {tv_threshold(tv_ref):.4f}"
