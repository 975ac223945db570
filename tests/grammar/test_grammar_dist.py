"""Structured output at temperature > 0: under a grammar, the engine's tokens follow the masked target
distribution exactly — plain decoding with forced-token drafts (one-hot rule), DSpark with `sample`
and `block` acceptance (the drafter's q masked too), EAGLE-3 chains and trees (sample-and-match walk).
The grammar is independent of the backend here: a Python function states which tokens it allows."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specserve.core import SamplingParams
from tests.dist import engine_vs_exact_joint
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, random_drafter_llm
from tests.grammar_setup import tiny_tokenizer

AB = tiny_tokenizer(["a", "b"])  # token 0 = a, 1 = b, 2 = EOS
# within DIST_LEN = 5 tokens EOS is never allowed (the regex needs 6+); after a only b (a forced draft)
REGEX = "(ab|b){6}(ab|b)*"
PARAMS = replace(DIST_PARAMS, regex=REGEX)


def allowed(seq: list[int]) -> torch.Tensor:
    """What REGEX allows after `seq` (len(seq) < 5; as its own matcher would say)."""
    return torch.tensor([True, True, False]) if not seq or seq[-1] != 0 else torch.tensor([False, True, False])


@pytest.mark.parametrize("algo,rule,opts", [
    (None, "auto", {}),
    ("dspark", "sample", {}),
    ("dspark", "block", {}),
    ("eagle3", "sample", {}),
    ("eagle3", "auto", {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4, "speculative_num_steps": None}),
])
def test_grammar_sampling_matches_masked_target(tmp_path: Path, algo: str | None, rule: str, opts: dict) -> None:
    llm = random_drafter_llm(tmp_path, algo or "dspark", rule, tokenizer=AB, **opts)
    if algo is None:  # plain decoding: the same target without the drafter, forced drafts on
        from specserve.engine.llm import LLM

        llm = LLM.from_model(llm.engine.model, tokenizer=AB, grammar_forced_drafts=4, max_running_requests=256)
    fit = engine_vs_exact_joint(llm, [1, 2], DIST_LEN, PARAMS, DIST_N, allowed)
    outs = fit.outs
    assert all(o.error is None for o in outs)
    assert all(2 not in o.token_ids and o.finish_reason == "length" for o in outs)
    assert fit.ok, fit
    assert sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs) > 0 or algo is None
    assert llm.engine.stats.num_accepted_tokens > 0  # drafts (or forced drafts) were accepted


def test_unmasked_control_fails(tmp_path: Path) -> None:
    """Negative control: the same engine without the grammar is far from the masked law (the test has power)."""
    llm = random_drafter_llm(tmp_path, "dspark", "sample", tokenizer=AB)
    fit = engine_vs_exact_joint(llm, [1, 2], DIST_LEN, DIST_PARAMS, DIST_N // 5, allowed)
    assert not fit.ok, fit
