"""HYBRID over a draft model (prompt lookup on long matches, the draft model elsewhere), what AUTO picks when
--speculative-draft-model-path names a model, and the draft model's confidence stop: greedy output == plain
output with both sources drafting, the exact target distribution at T > 0, flags checked by name."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import specserve.drafters.lookups as lookups
from specserve import LLM, SamplingParams

from tests.engine_helpers import fixed_curves
from tests.dist import engine_vs_exact_joint
from tests.spec_helpers import assert_no_leak, check_stats, drive
from tests.tiny import reference_greedy, save_tiny_hf_dir, target_and_draft_dirs, tiny_config, tiny_state_dict


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return target_and_draft_dirs(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("algo", ["HYBRID", "AUTO"])
def test_hybrid_over_draft_model_greedy_equals_plain(dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                     algo: str) -> None:
    used = {"lookup": 0, "model": 0}
    real_lookup = lookups.RequestLookups.__call__
    monkeypatch.setattr(lookups.RequestLookups, "__call__", lambda *a: (r := real_lookup(*a)) and used.update(
        lookup=used["lookup"] + 1) or r)
    llm = LLM(dirs["target"], dtype="float64", speculative_algorithm=algo, speculative_draft_model_path=dirs["small"],
              speculative_num_draft_tokens=4, page_size=4, max_prefill_tokens=9)
    eng = llm.engine
    assert eng.drafter.label == "HYBRID(NGRAM+STANDALONE)"
    inner = eng.drafter.learned
    real_propose = inner.propose
    monkeypatch.setattr(inner, "propose", lambda reqs, w: used.update(model=used["model"] + any(w.windows)) or
                        real_propose(reqs, w))
    rng = random.Random(3)
    plan = [(i, [rng.randrange(97) for _ in range(rng.randint(2, 10))] * rng.randint(1, 3),
             SamplingParams(temperature=0, max_tokens=30)) for i in range(5)]
    reqs = drive(llm, plan)
    for (_, prompt, sp), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(eng.model, prompt, sp.max_tokens)
    # NOTE: under AUTO (`cost` windows) the draft model does not pay for these short prompts at batch 2-5 and is
    # off for every request: it is asked to draft only under HYBRID's fixed windows
    assert used["lookup"] > 0 and (used["model"] > 0 or algo == "AUTO"), used
    check_stats(eng, reqs)
    assert_no_leak(eng)
    assert inner.state == {} and inner.kv.allocator.num_free == inner.kv.allocator.num_pages


def test_hybrid_over_draft_model_sampling_matches_target_distribution(tmp_path: Path) -> None:
    """One-hot lookups and the draft model's sampled q mixed in one batch reproduce the exact target joint."""
    V, L, N = 3, 5, 2500
    cfg = tiny_config("llama", vocab=V)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    draft = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=12), tmp_path / "d")
    llm = LLM(target, dtype="float64", speculative_algorithm="HYBRID", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=3, speculative_ngram_min_match=2, max_running_requests=256)
    fit = engine_vs_exact_joint(llm, [1, 2, 1, 2], L, SamplingParams(temperature=6.0, max_tokens=L, top_p=0.95), N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0


def test_draft_model_stops_below_the_confidence_floor(dirs: dict[str, str]) -> None:
    """With the confidence window, the draft model stops a request once its cumulative confidence is below the
    threshold (it would not be verified), so it drafts fewer than K; the output stays the target's."""
    kw = dict(dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs["small"],
              speculative_num_draft_tokens=8)
    prompts = [[5, 6, 7, 8], [1, 2, 3], [9, 9, 4]]
    drafted = {}
    for thr in (0.0, 0.5):
        window = {} if thr == 0 else dict(speculative_window="confidence", speculative_confidence_threshold=thr)
        llm = LLM(dirs["target"], **kw, **window)
        seen: list[list[float]] = []
        real = llm.engine.drafter.propose

        def spy(reqs, w, real=real, seen=seen):  # noqa: ANN001, ANN202
            p = real(reqs, w)
            seen.extend(c.tolist() for c, t in zip(p.confidence, p.tokens) if t)
            return p
        llm.engine.drafter.propose = spy
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        for p, o in zip(prompts, outs):
            assert o.token_ids == reference_greedy(llm.engine.model, p, 16)
        assert all(0 < c <= 1 for cs in seen for c in cs)
        cum = [torch.tensor(cs).cumprod(0).tolist() for cs in seen]
        if thr:  # drafting stops at the first position whose cumulative confidence falls below the floor
            assert all(all(x >= thr for x in c[:-1]) for c in cum)
        drafted[thr] = sum(len(c) for c in seen) / len(seen)
    assert drafted[0.5] < drafted[0.0]


def test_hybrid_over_draft_model_refuses_block_flags(dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="--speculative-block-size applies to block drafters .* is a draft model"):
        LLM(dirs["target"], dtype="float64", speculative_algorithm="HYBRID",
            speculative_draft_model_path=dirs["small"], speculative_block_size=4)


def test_draft_model_skips_its_prefill_where_drafting_does_not_pay(dirs: dict[str, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`cost` windows: verifying is cheap up to 2 tokens and dear beyond, so a draft position pays at batch 1
    only. Requests admitted towards a batch of 4 never run the draft model (no prefill forward, no drafts,
    lookups still drafted); a request alone afterwards does, and so does one of the batch once it runs alone
    with enough tokens left; every output is the target's greedy one."""
    from specserve.cost.curve import CostModel
    from specserve.cost.gate import DraftGate

    curve, draft = CostModel([(1, 1.0), (2, 1.05), (3, 3.0), (64, 70.0)]), CostModel([(1, 0.01), (64, 0.02)])
    fixed_curves(monkeypatch, curve, draft)
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    llm = LLM(dirs["target"], dtype="float64", speculative_algorithm="AUTO", speculative_draft_model_path=dirs["small"],
              speculative_num_draft_tokens=4, speculative_window="cost", page_size=4)
    eng, inner = llm.engine, llm.engine.drafter.learned
    assert eng.policy.draft_pays(1, 4) and not eng.policy.draft_pays(4, 4)
    tokens = {"forward": 0, "drafted": 0}
    real_fwd, real_propose = inner.runner.forward, inner.propose
    monkeypatch.setattr(inner.runner, "forward", lambda pts, starts, ids, *a, **k: tokens.update(
        forward=tokens["forward"] + sum(map(len, ids))) or real_fwd(pts, starts, ids, *a, **k))
    monkeypatch.setattr(inner, "propose", lambda reqs, w: (p := real_propose(reqs, w)) and tokens.update(
        drafted=tokens["drafted"] + sum(map(len, p.tokens))) or p)
    stage, real_plan, seen = eng.draft_stage, eng.draft_stage.plan, []  # per planned request: (id, model off, source)
    monkeypatch.setattr(stage, "plan", lambda reqs: (p := real_plan(reqs)) and seen.extend(
        (r.request_id, r.request_id in stage.model_off, s) for r, s in zip(reqs, p.sources)) or p)
    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(9)] for _ in range(4)] + [[3, 4, 5, 6, 7] * 3]
    sp = SamplingParams(temperature=0, max_tokens=8)  # < the context: never worth the draft model's catch-up
    reqs = drive(llm, [(0, p, sp) for p in prompts[:4]])
    assert tokens == {"forward": 0, "drafted": 0}
    assert seen and all(off and s == "lookup" for _, off, s in seen)  # off: HYBRID's free lookups only
    alone = SamplingParams(temperature=0, max_tokens=16)  # >= its prompt: worth the draft model's prefill
    reqs += drive(llm, [(0, prompts[4], alone)])
    assert tokens["forward"] >= len(prompts[4]) and tokens["drafted"] > 0
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference_greedy(eng.model, p, r.params.max_tokens)
    assert_no_leak(eng)
    # the draft model is back once the batch shrinks to where it pays, for a request with tokens enough left:
    # it catches up on the whole context, then drafts
    tokens.update(forward=0, drafted=0)
    long = SamplingParams(temperature=0, max_tokens=30)
    plan = [(0, p, SamplingParams(temperature=0, max_tokens=3) if i else long) for i, p in enumerate(prompts[:4])]
    seen.clear()
    reqs = drive(llm, plan)
    back = [off for rid, off, _ in seen if rid == reqs[0].request_id]
    assert tokens["forward"] >= len(prompts[0]) and tokens["drafted"] > 0 and back[0] and not back[-1]
    for (_, p, s), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(eng.model, p, s.max_tokens)
    assert_no_leak(eng)


@pytest.mark.parametrize("algo", ["HYBRID", "AUTO"])
def test_draft_vocab_applies_to_hybrid_over_a_draft_model(dirs: dict[str, str], algo: str) -> None:
    """--speculative-draft-vocab reaches the draft model under HYBRID/AUTO too (it was refused there); over a
    learned drafter it is refused by name."""
    prompts = [[1, 2, 3, 4, 1, 2, 3], [9, 8, 7]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(dirs["target"], dtype="float64", speculative_algorithm=algo, speculative_draft_model_path=dirs["small"],
              speculative_draft_vocab="none")
    want = [reference_greedy(llm.engine.model, p, 12) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    with pytest.raises(ValueError, match="--speculative-draft-vocab applies to a draft model"):
        LLM(dirs["target"], dtype="float64", speculative_algorithm="HYBRID", speculative_draft_vocab="none")


def test_table_drafts_where_the_draft_model_is_off(dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """AUTO's chain past the draft model: where `cost` turns the model off for a request (here: a long prompt
    asking for a short answer, whose draft prefill does not pay), the n-gram table drafts for it (source "table")
    where prompt lookup finds nothing, and the output is the target's greedy one."""
    import numpy as np

    from specserve.cost.curve import CostModel
    from specserve.cost.gate import DraftGate
    from specserve.drafters.ngram_table import NgramTable

    fixed_curves(monkeypatch, CostModel([(1, 1.0), (64, 1.5)]), CostModel([(1, 0.05), (64, 3.2)]))
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    target = LLM(dirs["target"], dtype="float64").engine.model
    prompt = list(range(3, 43))  # no 3-token repeat: prompt lookup drafts nothing
    g = reference_greedy(target, prompt, 12)
    table, _ = NgramTable.build([(np.array(prompt + g), np.array([False] * 40 + [True] * 12))], vocab_size=97,
                                max_n=3, min_count=1, target=target.cfg.name)
    table.save(tmp_path / "table")
    llm = LLM(dirs["target"], dtype="float64", speculative_algorithm="AUTO", speculative_draft_model_path=dirs["small"],
              speculative_num_draft_tokens=4, speculative_window="cost", page_size=4,
              speculative_ngram_table=str(tmp_path / "table"), speculative_suffix_cache_tokens=0)
    eng = llm.engine
    assert eng.drafter.sources == ("lookup", "table", "learned")
    reqs = drive(llm, [(0, prompt, SamplingParams(temperature=0, max_tokens=8))])
    assert reqs[0].output_ids == g[:8]
    drafted, accepted = eng.stats.by_source["table"]
    assert drafted > 0 and accepted > 0 and "learned" not in eng.stats.by_source
    check_stats(eng, reqs)
    assert_no_leak(eng)
