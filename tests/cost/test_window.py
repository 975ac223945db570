"""Window policy `cost`: the verify-cost curve, the greedy window choice, and losslessness."""
from __future__ import annotations

import itertools

import pytest
import torch

from specserve.config import EngineConfig

from specserve import LLM, SamplingParams
from specserve.core import DraftPlan, Proposal, Request
from specserve.cost.acceptance import AcceptTrials
from specserve.cost.curve import CostModel
from specserve.cost.windows import DraftCost, cost_windows
from specserve.cost.gate import DraftGate
from specserve.cost.acceptance import accept_curves

from tests.engine_helpers import fixed_curves
from tests.tiny import reference_greedy, tiny_model


TRIALS = AcceptTrials()  # the requests' acceptance the policies read (no pooled record)
_ids = itertools.count()


def _req(accepted: int, trials: int) -> Request:
    r = Request(f"r{next(_ids)}", [1], SamplingParams())
    TRIALS.per_request[r.request_id] = {"draft": [accepted, trials]}
    return r


def test_free_verify_takes_full_windows() -> None:
    flat = CostModel([(1, 1.0), (64, 1.0 + 1e-9)])
    assert cost_windows([_req(5, 10), _req(0, 0)], [4, 3], flat, trials=TRIALS)[0] == [4, 3]


@pytest.mark.parametrize("gains", [[0.9, 0.8, 0.5, 0.1, 0.05], [0.3, 0.29, 0.28, 0.27, 0.26], [0.05, 0.04, 0.0, 0.0, 0.0]])
@pytest.mark.parametrize("over", [0.0, 0.3])
def test_one_request_gets_the_best_window_on_the_real_curve(gains: list[float], over: float) -> None:
    """Batch 1: the window maximises expected tokens per second exactly, over every prefix of the curve
    (which has a step: 5 tokens cost much more than 4, 6 hardly more than 5)."""
    curve = CostModel([(1, 1.0), (2, 1.05), (4, 1.3), (5, 1.9), (6, 1.95)])
    cum = [1 + sum(gains[:n]) for n in range(6)]
    rate = [cum[n] / (curve(1 + n) + (over if n else 0.0)) for n in range(6)]
    k, t = cost_windows([_req(0, 0)], [5], curve, per_request=over, gains=[gains], trials=TRIALS)
    assert k == [rate.index(max(rate))] and t == curve(1 + k[0])


def test_accept_curves_chain_tree_and_nan() -> None:
    """P(positions 1..i accepted): the running product of the clamped confidences along the chain, or along each
    node's path in a tree; NaN (no score of its own) reads the request's acceptance estimate; no confidence at
    all: α^i."""
    r = _req(3, 4)  # (3 + 4·0.5) / (4 + 4) = 0.625 with no pooled record
    chain = Proposal(tokens=[[5, 6, 7, 8]], confidence=[torch.tensor([0.9, float("nan"), 1.5, -0.1])])
    assert accept_curves([r], DraftPlan(["draft"], [4]), chain, TRIALS)[0] == pytest.approx([0.9, 0.9 * 0.625, 0.9 * 0.625, 0.0])
    assert accept_curves([r], DraftPlan(["draft"], [2]), chain, TRIALS)[0] == pytest.approx([0.9, 0.9 * 0.625])
    tree = Proposal(tokens=[[5, 6, 7, 8]], parents=[[-1, -1, 0, 2]], confidence=[torch.tensor([0.8, 0.5, 0.5, 0.4])])
    assert accept_curves([r], DraftPlan(["draft"], [4]), tree, TRIALS)[0] == pytest.approx([0.8, 0.5, 0.4, 0.16])
    bare = Proposal(tokens=[[5, 6, 7]])
    assert accept_curves([r], DraftPlan(["draft"], [3]), bare, TRIALS)[0] == pytest.approx([0.625, 0.625**2, 0.625**3])


def test_poor_acceptance_and_linear_cost_choose_plain_decoding() -> None:
    linear = CostModel([(1, 1.0), (64, 64.0)])  # every verified token costs a full step
    assert cost_windows([_req(0, 50), _req(1, 40)], [4, 4], linear, trials=TRIALS)[0] == [0, 0]


def test_cost_windows_never_plan_below_plain() -> None:
    cost = CostModel([(1, 1.0), (8, 1.5), (32, 6.0)])
    reqs = [_req(a, 20) for a in (0, 5, 10, 18)]
    k, predicted = cost_windows(reqs, [8] * 4, cost, trials=TRIALS)
    assert predicted == pytest.approx(cost(sum(k) + 4))
    alphas = [(a + 1) / (t + 2) for a, t in (TRIALS.per_request[r.request_id]["draft"] for r in reqs)]
    expected = sum((1 - a ** (kb + 1)) / (1 - a) for a, kb in zip(alphas, k))
    assert expected / cost(sum(k) + 4) >= 4 / cost(4)
    assert k[3] >= k[0]  # the request that accepts more gets at least as long a window


def test_draft_cost_shortens_windows() -> None:
    verify = CostModel([(1, 1.0), (64, 1.5)])  # verifying extra tokens is nearly free
    reqs = [_req(6, 10), _req(6, 10)]  # α ≈ 0.58
    free, _ = cost_windows(reqs, [6, 6], verify, trials=TRIALS)
    cheap, _ = cost_windows(reqs, [6, 6], verify, draft_step=CostModel([(1, 0.05), (64, 0.1)]), trials=TRIALS)
    dear, _ = cost_windows(reqs, [6, 6], verify, draft_step=CostModel([(1, 1.0), (64, 2.0)]), trials=TRIALS)
    assert free == [6, 6]
    assert sum(dear) < sum(cheap) <= sum(free)
    assert dear == [0, 0]  # a draft step as dear as a target step never pays at α ≈ 0.58


def test_draft_cost_learns_per_request_cost_and_stops_drafting() -> None:
    dc = DraftCost()
    for _ in range(40):
        dc.observe(seconds=1.0, predicted=0.0, active=2, source="draft")  # 0.5 s per drafting request
    assert dc.per_request["draft"] == pytest.approx(0.5, rel=0.05)
    verify = CostModel([(1, 1.0), (64, 1.5)])
    reqs = [_req(6, 10), _req(6, 10)]
    assert cost_windows(reqs, [4, 4], verify, trials=TRIALS)[0] != [0, 0]
    assert cost_windows(reqs, [4, 4], verify, per_request=dc.cost(["draft"] * 2), trials=TRIALS)[0] == [0, 0]


def test_draft_cost_is_what_a_model_drafters_curve_misses() -> None:
    dc = DraftCost()
    for i in range(400):
        dc.observe(seconds=1.0 + (0.3 if i % 2 else -0.1), predicted=1.0, active=1, source="draft")
    assert dc.per_request["draft"] == pytest.approx(0.1, abs=0.03)  # samples below zero count
    dc.per_request["draft"] = -0.05
    assert dc.cost(["draft"]) == [0.0]  # the estimate is used clamped


def test_draft_cost_is_per_source() -> None:
    """HYBRID: the learned drafter's forward makes its requests dear; a lookup request stays cheap."""
    dc = DraftCost(decay=0.5)
    for _ in range(10):
        dc.observe(seconds=2.0, predicted=0.0, active=1, source="learned")
        dc.observe(seconds=0.01, predicted=0.0, active=1, source="lookup")
    lookup, learned = _req(6, 10), _req(6, 10)
    sources = ["lookup", "learned"]
    for r, src in zip((lookup, learned), sources):
        TRIALS.per_request[r.request_id] = {src: [6, 10]}
    assert dc.cost(sources) == pytest.approx([0.01, 2.0], rel=0.05)
    verify = CostModel([(1, 1.0), (64, 1.5)])
    cost = dc.cost(sources)
    assert cost_windows([lookup, learned], [4, 4], verify, per_request=cost, trials=TRIALS, sources=sources)[0][1] == 0
    assert cost_windows([lookup, learned], [4, 4], verify, per_request=cost, trials=TRIALS, sources=sources)[0][0] > 0


@pytest.mark.parametrize("algo,rate", [("NGRAM", None), ("SYNTHETIC", 0.9), ("SYNTHETIC", 0.0)])
def test_cost_policy_is_lossless_and_adapts(monkeypatch: pytest.MonkeyPatch, algo: str, rate) -> None:  # noqa: ANN001
    # a fixed curve (extra verify tokens cost 10% of a step each) keeps the test independent of this
    # machine's timings; measuring and caching are tested below
    curve, draft = CostModel([(1, 1.0), (64, 7.3)]), CostModel([(1, 0.02), (64, 0.05)])
    fixed_curves(monkeypatch, curve, draft)
    # ...and so does opening the empirical gate (it compares real step times; tested on its own below)
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    m = tiny_model("llama")
    opts = dict(speculative_algorithm=algo, speculative_num_draft_tokens=6, speculative_window="cost")
    if rate is not None:
        opts["speculative_synthetic_accept_rate"] = rate
    llm = LLM.from_model(m, **opts)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11], [7] * 12]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(m, p, 30)
    # every decode row of every request is counted once, at the window it was given: the histogram's
    # total equals the decode steps and its mean the drafted tokens (fails if a row is skipped, counted
    # twice, or recorded before the policy cut it)
    counts = llm.engine.stats.window_counts
    assert sum(k * c for k, c in enumerate(counts)) == sum(o.meta_info["spec_draft_tokens"] for o in outs)
    # a decode step emits its accepted drafts + 1 (windows never pass max_tokens), after the prefill's token
    steps = [29 - o.meta_info["spec_accepted_tokens"] for o in outs]
    assert sum(counts) == sum(steps)
    for o, n in zip(outs, steps):
        assert o.meta_info["spec_mean_window"] == pytest.approx(o.meta_info["spec_draft_tokens"] / n)
    if rate == 0.0:  # nothing is ever accepted: the policy falls back to plain decoding, then stops planning
        assert counts[0] > sum(counts[1:]) and llm.engine.policy.skip  # (idle steps: the equality above holds)
    if rate == 0.9:
        assert sum(counts[1:]) > counts[0]


def test_cost_policy_drafts_at_least_one_position_of_an_explored_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source the gate explores drafts at least one position even where the cost model (say, a one-off slow
    step that inflated its overhead) would give it none; an open source still follows the cost model."""
    from specserve.cost.cost_policy import CostPolicy

    pol = CostPolicy(EngineConfig(speculative_algorithm="NGRAM", speculative_window="cost"))
    pol.cost_model, pol.draft_cost_model, pol.whole = CostModel([(1, 1.0), (64, 1.5)]), None, False
    pol.trials = TRIALS
    pol.drafter = type("D", (), {"sources": ("lookup", "learned")})()
    pol.draft_cost.per_request = {"learned": 100.0, "lookup": 100.0}  # both look far too dear
    a, b = _req(6, 10), _req(6, 10)
    plan = DraftPlan(["lookup", "learned"], [4, 4])
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": {"lookup": "open"}.get(source, "explore"))
    assert pol.plan([a, b], plan) == [0, 1] and pol.arm == "learned"
    pol.draft_cost.per_request = {}  # cheap again: the explored source gets the cost model's window
    assert pol.plan([a, b], plan)[1] > 1


def test_an_explored_source_forces_a_few_requests_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exploring a source forces drafts for EXPLORE_REQUESTS requests of the batch, in turn, not for all of
    them: a learned drafter that drafted nothing for a while catches up on every request it drafts for (the
    rows it skipped), and a batch of 16 paying that at once cost ~2 decode steps per exploration."""
    from specserve.cost.cost_policy import CostPolicy

    pol = CostPolicy(EngineConfig(speculative_algorithm="DSPARK", speculative_window="cost"))
    pol.cost_model, pol.draft_cost_model, pol.whole = CostModel([(1, 1.0), (64, 1.5)]), None, False
    pol.trials = TRIALS
    pol.drafter = type("D", (), {"sources": ("learned",)})()
    pol.draft_cost.per_request = {"learned": 100.0}  # far too dear: only the exploration drafts
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "explore")
    reqs = [_req(6, 10) for _ in range(16)]
    seen = []
    for _ in range(8):
        windows = pol.plan(reqs, DraftPlan(["learned"] * 16, [4] * 16))
        assert sum(1 for w in windows if w) == pol.EXPLORE_REQUESTS
        seen += [i for i, w in enumerate(windows) if w]
    assert sorted(seen) == list(range(16))  # every request in turn
    assert sum(1 for w in pol.plan(reqs[:2], DraftPlan(["learned"] * 2, [4] * 2)) if w) == 2


def test_cost_policy_idles_a_batch_size_whose_plans_draft_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """IDLE_AFTER plans in a row that draft nothing at one batch size make that size skip the next IDLE_STEPS
    plans (idle() is True, counted down per step); one plan that drafts resets the streak; other sizes plan."""
    from specserve.cost.cost_policy import CostPolicy

    pol = CostPolicy(EngineConfig(speculative_algorithm="NGRAM", speculative_window="cost"))
    pol.cost_model, pol.draft_cost_model, pol.whole = CostModel([(1, 1.0), (64, 1.5)]), None, False
    pol.trials = TRIALS
    pol.drafter = type("D", (), {"sources": ("draft",)})()
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    reqs = [_req(6, 10), _req(6, 10)]
    pol.draft_cost.per_request = {"draft": 100.0}  # drafting looks far too dear: every plan is empty
    for _ in range(pol.IDLE_AFTER - 1):
        assert not pol.idle(2) and pol.plan(reqs, DraftPlan(["draft"] * 2, [4, 4])) == [0, 0]
    pol.draft_cost.per_request = {}  # one plan that drafts resets the streak
    assert not pol.idle(2) and pol.plan(reqs, DraftPlan(["draft"] * 2, [4, 4])) != [0, 0]
    pol.draft_cost.per_request = {"draft": 100.0}
    for _ in range(pol.IDLE_AFTER):
        assert not pol.idle(2)
        pol.plan(reqs, DraftPlan(["draft"] * 2, [4, 4]))
    assert [pol.idle(2) for _ in range(pol.IDLE_STEPS)] == [True] * pol.IDLE_STEPS
    assert not pol.idle(2) and not pol.idle(3)  # planned again (and it stays empty: idle again after it)
    pol.plan(reqs, DraftPlan(["draft"] * 2, [4, 4]))
    assert pol.idle(2)
