"""The suffix index over past requests (drafters/suffix.py, lookups.py): what it drafts (the longest match's
continuation, by majority, depth bounded by the match), its bounded ring (evicted documents never match), its
file (round trip; another vocabulary, a damaged file: ignored with a warning), and in the engine: greedy ==
plain with the source drafting, the exact target distribution at T > 0, and a restarted engine drafting from
the index it saved."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest

from specserve.core import DraftPlan, Request, SamplingParams
from specserve.drafters.suffix import ANCHOR, SuffixIndex
from specserve.engine.llm import LLM
from tests.dist import engine_vs_exact_joint
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS
from tests.spec_helpers import assert_no_leak, check_stats, drive
from tests.tiny import reference_greedy, save_tiny_hf_dir, tiny_config, tiny_model, tiny_state_dict

V = 97


def test_draft_follows_the_longest_match_by_majority() -> None:
    idx = SuffixIndex(1024)
    idx.add([1, 2, 3, 4, 5, 6, 7, 8])
    idx.add([9, 2, 3, 4, 5, 6, 7, 40])
    idx.add([9, 2, 3, 4, 5, 6, 7, 40])
    # the context's last 5 tokens match all three; two continue with 40 after 7
    assert idx.draft([0, 3, 4, 5, 6, 7], 4) == [40]
    # a longer match (9 2 3 4 5) is the two later documents alone: they agree all the way
    assert idx.draft([9, 2, 3, 4, 5], 8) == [6, 7, 40]
    # depth is bounded by the match length (DEPTH_PER_MATCH = 1): a 4-token match drafts at most 4
    idx.add([11, 12, 13, 14] + list(range(50, 70)))
    assert idx.draft([11, 12, 13, 14], 16) == [50, 51, 52, 53]
    assert idx.draft([11, 12, 13, 14], 2) == [50, 51]
    # shorter than the anchor, or no occurrence: nothing
    assert idx.draft([12, 13, 14], 4) == [] and idx.draft([1, 1, 1, 1], 4) == []


def test_split_votes_stop_the_draft() -> None:
    idx = SuffixIndex(1024)
    for follow in (60, 61, 62):
        idx.add([1, 2, 3, 4, 5, follow])
    assert idx.draft([1, 2, 3, 4, 5], 4) == []  # no token keeps half the voters
    idx.add([1, 2, 3, 4, 5, 60])
    assert idx.draft([1, 2, 3, 4, 5], 4) == [60]  # 2 of 4


def test_the_ring_is_bounded_and_evicted_documents_never_match() -> None:
    idx = SuffixIndex(64)
    before = idx.nbytes
    idx.add([1, 2, 3, 4, 5, 6, 7])
    assert idx.draft([1, 2, 3, 4], 3) == [5, 6, 7]
    rng = random.Random(0)
    for _ in range(20):  # 20 × 21 tokens through a 64-slot ring
        idx.add([rng.randrange(100, 200) for _ in range(20)])
    assert idx.nbytes == before
    assert idx.draft([1, 2, 3, 4], 3) == []
    last = [300, 301, 302, 303, 304, 305]
    idx.add(last)
    assert idx.draft(last[:4], 2) == [304, 305]
    # a document longer than the ring keeps its end
    idx.add(list(range(1000, 1100)))
    assert idx.draft([1096, 1097, 1098, 1099], 4) == [] and idx.draft([1090, 1091, 1092, 1093], 3) == [
        1094, 1095, 1096]


def test_a_cleared_index_drafts_nothing_it_saw_and_indexes_again() -> None:
    idx = SuffixIndex(64)
    idx.add([1, 2, 3, 4, 5, 6, 7])
    idx.clear()
    assert idx.draft([1, 2, 3, 4], 3) == [] and idx.documents == 0 and idx.dirty
    idx.add([1, 2, 3, 4, 8, 9])
    assert idx.draft([1, 2, 3, 4], 3) == [8, 9]


def test_save_and_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    idx = SuffixIndex(256, "vocab-a")
    idx.add([1, 2, 3, 4, 5, 6, 7])
    path = tmp_path / "suffix.npz"
    idx.save(path)
    back = SuffixIndex.load(path, 256, "vocab-a")
    assert back.documents == 1 and back.draft([1, 2, 3, 4], 3) == [5, 6, 7]
    with caplog.at_level(logging.WARNING, logger="specserve.drafters"):
        other = SuffixIndex.load(path, 256, "vocab-b")  # another vocabulary: its ids mean other strings
        resized = SuffixIndex.load(path, 512, "vocab-a")
    assert other.documents == resized.documents == 0 and other.draft([1, 2, 3, 4], 3) == []
    assert caplog.text.count("another vocabulary or layout") == 2
    data = path.read_bytes()
    for damaged in (data[: len(data) // 2], data[:200] + bytes(b ^ 0xFF for b in data[200:260]) + data[260:]):
        path.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specserve.drafters"):
            bad = SuffixIndex.load(path, 256, "vocab-a")
        assert bad.documents == 0 and bad.draft([1, 2, 3, 4], 3) == []
        assert "unreadable" in caplog.text


def _suffix_llm(model, **opts) -> LLM:  # noqa: ANN001
    # own-context lookup needs a 4-token match, so the index is what drafts for prompts that do not repeat
    opts = {"kv_cache_memory": "512KiB", "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
            "speculative_ngram_min_match": 4, "speculative_ngram_max_match": 4, "speculative_ngram_table": "none",
            **opts}
    return LLM.from_model(model, **opts)


def _plan(rng: random.Random, prompts: list[list[int]], n: int) -> list:
    """n requests, each a prompt of the set (so later ones continue what earlier ones wrote), two at a time
    (max_running_requests)."""
    return [(0, rng.choice(prompts), SamplingParams(temperature=0, max_tokens=rng.randint(20, 40))) for i in range(n)]


@pytest.mark.parametrize("window", ["fixed", "cost"])
def test_suffix_source_greedy_equals_plain(window: str) -> None:
    model = tiny_model(vocab=V, seed=3)
    llm = _suffix_llm(model, speculative_window=window, max_running_requests=2)
    assert llm.engine.drafter.sources == ("lookup", "suffix")
    rng = random.Random(4)
    prompts = [[rng.randrange(V) for _ in range(6)] for _ in range(3)]
    plan = _plan(rng, prompts, 9)
    reqs = drive(llm, plan)
    for r, (_, prompt, sp) in zip(reqs, plan):
        assert r.output_ids == reference_greedy(model, prompt, sp.max_tokens)
    drafted, accepted = llm.engine.stats.by_source["suffix"]
    assert accepted > 0 and accepted <= drafted
    check_stats(llm.engine, reqs)
    assert_no_leak(llm.engine)


def test_no_suffix_index_when_its_budget_is_zero() -> None:
    llm = _suffix_llm(tiny_model(vocab=V, seed=3), speculative_suffix_cache_tokens=0)
    assert llm.engine.drafter.lookups.index is None and llm.engine.drafter.sources == ("lookup",)
    with pytest.raises(ValueError, match="--speculative-suffix-cache-tokens must be >= 0"):
        _suffix_llm(tiny_model(vocab=V, seed=3), speculative_suffix_cache_tokens=-1)


def test_suffix_source_matches_target_distribution(tmp_path: Path) -> None:
    cfg = tiny_config("llama", vocab=3, layers=2)
    d = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    llm = LLM(d, dtype="float64", kv_cache_memory="512KiB", speculative_algorithm="NGRAM",
              speculative_num_draft_tokens=3, speculative_ngram_min_match=4, speculative_ngram_max_match=4,
              speculative_window="fixed", max_running_requests=8)
    fit = engine_vs_exact_joint(llm, [1, 2, 0, 0, 2, 1], DIST_LEN, DIST_PARAMS, DIST_N)
    assert fit.ok, fit
    drafted, accepted = llm.engine.stats.by_source["suffix"]
    assert drafted > 0 and accepted > 0


def test_a_restarted_engine_drafts_from_the_saved_index(tmp_path: Path) -> None:
    model = tiny_model(vocab=V, seed=3)
    rng = random.Random(4)
    prompt = [rng.randrange(V) for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=30)
    with _suffix_llm(model, prefix_cache_dir=str(tmp_path)) as llm:
        llm.generate([prompt], sp)
        assert "suffix" not in llm.engine.stats.by_source  # the first request had nothing to draft from
    assert list(tmp_path.glob("suffix-*.npz"))
    with _suffix_llm(model, prefix_cache_dir=str(tmp_path)) as llm:
        assert llm.engine.drafter.lookups.index.documents == 2  # the prompt (at its first decode step), the output
        out = llm.generate([prompt], sp)[0]
        assert out.token_ids == reference_greedy(model, prompt, 30)
        assert llm.engine.stats.by_source["suffix"][1] > 0
    # without the directory a new engine starts empty
    llm = _suffix_llm(model)
    assert llm.engine.drafter.lookups.index.documents == 0


def test_index_tokens_skip_the_prefix_cache_hit() -> None:
    """A prompt's cached prefix was written by the request that cached it: only the rest and the output are
    added (a multi-turn conversation would otherwise fill the ring with copies of its history)."""
    from specserve.drafters.lookups import Lookups, RequestLookups

    lk = Lookups(RequestLookups(4, 4), SuffixIndex(256))
    r = Request("r", list(range(10, 30)), SamplingParams(temperature=0))
    r.output_ids, r.cached_tokens, r.finish_reason = [1, 2, 3, 4, 5], 16, "stop"
    lk.release(r)
    assert lk.index.end == 4 + 5 + 1  # 4 prompt tokens past the hit, the output, the separator
    r2 = Request("r2", list(range(10, 30)), SamplingParams(temperature=0))
    r2.output_ids, r2.finish_reason = [9, 9, 9, 9, 9], None  # preempted, not finished: teaches nothing
    lk.release(r2)
    assert lk.index.documents == 1
    assert np.array_equal(lk.index.tokens[:9], [26, 27, 28, 29, 1, 2, 3, 4, 5])


def test_a_longer_match_in_the_index_wins_over_prompt_lookup() -> None:
    """Prompt lookup takes the most recent occurrence of the context's last ≤ 4 tokens; where the index matches
    more than that, its continuation is the right one of a repeated phrase's: it drafts. The request's own
    prompt joins the index at its first decode step (before: nothing)."""
    from specserve.drafters.lookups import Lookups, RequestLookups

    lk = Lookups(RequestLookups(1, 4), SuffixIndex(1024))
    phrase = [50, 51, 52, 53]
    prompt = [1, 2, 3, 4, 5, 6] + phrase + [7, 8] + [9, 9, 9] + phrase + [60, 61] + [1, 2, 3, 4, 5, 6] + phrase
    r = Request("r", prompt, SamplingParams(temperature=0))
    # lookup: the latest occurrence of 50 51 52 53 continues 60 61; the index matches 1..6 + phrase: 7 8
    assert lk.own(r, 2) == [60, 61]
    assert lk.source(r) == "suffix" and lk.draft(r, "suffix", 2) == [7, 8]
    assert lk.index.documents == 1
    short = Request("s", [9, 1, 2, 3, 9, 1, 2, 3], SamplingParams(temperature=0))
    assert lk.source(short) == "lookup"  # a 4-token match: prompt lookup's own
