"""HYBRID (n-gram lookup on long matches, the learned drafter elsewhere): greedy output == plain output
with either learned runtime underneath (block: DSpark; chain: EAGLE-3), both halves actually drafting;
at T > 0 the exact target distribution with the learned drafter's q and one-hot lookups mixed in one
batch; flags checked by name."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

import specserve.drafters.lookups as lookups
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from tests.dist import engine_vs_exact_joint
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, _target, random_drafter_llm
from tests.spec_helpers import assert_no_leak, check_stats, drive
from tests.tiny import reference_greedy


@pytest.mark.parametrize("algo,opts", [("dspark", {}), ("dspark", {"speculative_ngram_min_match": 1}),
                                       ("eagle3", {"speculative_num_draft_tokens": 3})])
def test_hybrid_greedy_equals_plain(trained: dict, monkeypatch: pytest.MonkeyPatch, algo: str, opts: dict) -> None:
    used = {"lookup": 0, "learned": 0}
    real_lookup = lookups.RequestLookups.__call__
    monkeypatch.setattr(lookups.RequestLookups, "__call__", lambda *a: (r := real_lookup(*a)) and used.update(
        lookup=used["lookup"] + 1) or r)
    llm = LLM.from_model(_target(), speculative_algorithm="HYBRID", kv_cache_memory="512KiB",
                         speculative_draft_model_path=str(trained["artifacts"][algo]), **opts)
    learned = llm.engine.drafter.learned
    real_propose = learned.propose
    monkeypatch.setattr(learned, "propose", lambda reqs, w: used.update(learned=used["learned"] + any(w.windows)) or
                        real_propose(reqs, w))
    rng = random.Random(7)
    plan = [(i, [rng.randrange(97) for _ in range(rng.randint(2, 10))], SamplingParams(temperature=0, max_tokens=40))
            for i in range(4)]
    reqs = drive(llm, plan)
    for (_, prompt, sp), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(_target(), prompt, sp.max_tokens)
    assert used["lookup"] > 0 and used["learned"] > 0, used
    assert llm.engine.stats.num_accepted_tokens > 0
    check_stats(llm.engine, reqs)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("rule", ["sample", "block"])
def test_hybrid_sampling_matches_target_distribution(tmp_path: Path, rule: str) -> None:
    llm = random_drafter_llm(tmp_path, "dspark", rule, speculative_algorithm="HYBRID", speculative_ngram_min_match=2)
    fit = engine_vs_exact_joint(llm, [1, 2, 1, 2], DIST_LEN, DIST_PARAMS, DIST_N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0


def test_hybrid_flags() -> None:
    with pytest.raises(ValueError, match="--speculative-eagle-topk does not apply to --speculative-algorithm HYBRID"):
        LLM.from_model(_target(), speculative_algorithm="HYBRID", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="none ships"):
        LLM.from_model(_target(), speculative_algorithm="HYBRID")


def test_ngram_index_equals_the_scan() -> None:
    """NgramIndex (incremental, per request) answers what ngram_lookup's scan of the whole context does, for
    contexts that grow by 1..5 tokens a step, every k, and a context that is not an extension (re-indexed)."""
    from specserve.drafters.lookups import NgramIndex, ngram_lookup

    rng = random.Random(0)
    for min_match, max_match in ((1, 4), (3, 4), (2, 2), (1, 1)):
        for _ in range(20):
            idx, ids = NgramIndex(min_match, max_match), []
            for _ in range(30):
                ids = ids + [rng.randrange(4) for _ in range(rng.randint(1, 5))]  # small vocabulary: many matches
                k = rng.randint(0, 6)
                assert idx.lookup(ids, k) == ngram_lookup(ids, min_match, max_match, k), (ids, k)
            other = [rng.randrange(4) for _ in range(len(ids) // 2)]
            assert idx.lookup(other, 3) == ngram_lookup(other, min_match, max_match, 3)
