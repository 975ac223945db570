"""Window policy `cost`: the verify-cost curve, the greedy window choice, and losslessness."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.core import Request
from specserve.spec.cost import CostModel, DraftGate, StepOverhead, cost_windows

from .tiny import reference_greedy, tiny_model


def _req(accepted: int, trials: int) -> Request:
    r = Request("r", [1], SamplingParams())
    r.spec_accepted_tokens, r.spec_trials = accepted, trials
    return r


def test_cost_model_interpolates_and_extrapolates() -> None:
    c = CostModel([(1, 1.0), (3, 2.0), (5, 4.0)])
    assert c(1) == 1.0 and c(2) == 1.5 and c(4) == 3.0 and c(7) == 6.0 and c(0) == 1.0


def test_free_verify_takes_full_windows() -> None:
    flat = CostModel([(1, 1.0), (64, 1.0 + 1e-9)])
    assert cost_windows([_req(5, 10), _req(0, 0)], [4, 3], flat)[0] == [4, 3]


def test_poor_acceptance_and_linear_cost_choose_plain_decoding() -> None:
    linear = CostModel([(1, 1.0), (64, 64.0)])  # every verified token costs a full step
    assert cost_windows([_req(0, 50), _req(1, 40)], [4, 4], linear)[0] == [0, 0]


def test_cost_windows_never_plan_below_plain() -> None:
    cost = CostModel([(1, 1.0), (8, 1.5), (32, 6.0)])
    reqs = [_req(a, 20) for a in (0, 5, 10, 18)]
    k, predicted = cost_windows(reqs, [8] * 4, cost)
    assert predicted == pytest.approx(cost(sum(k) + 4))
    alphas = [(r.spec_accepted_tokens + 1) / (r.spec_trials + 2) for r in reqs]
    expected = sum((1 - a ** (kb + 1)) / (1 - a) for a, kb in zip(alphas, k))
    assert expected / cost(sum(k) + 4) >= 4 / cost(4)
    assert k[3] >= k[0]  # the request that accepts more gets at least as long a window


def test_draft_cost_shortens_windows() -> None:
    verify = CostModel([(1, 1.0), (64, 1.5)])  # verifying extra tokens is nearly free
    reqs = [_req(6, 10), _req(6, 10)]  # α ≈ 0.58
    free, _ = cost_windows(reqs, [6, 6], verify)
    cheap, _ = cost_windows(reqs, [6, 6], verify, draft_step=CostModel([(1, 0.05), (64, 0.1)]))
    dear, _ = cost_windows(reqs, [6, 6], verify, draft_step=CostModel([(1, 1.0), (64, 2.0)]))
    assert free == [6, 6]
    assert sum(dear) < sum(cheap) <= sum(free)
    assert dear == [0, 0]  # a draft step as dear as a target step never pays at α ≈ 0.58


def test_step_overhead_learns_per_request_cost_and_stops_drafting() -> None:
    oh = StepOverhead()
    for _ in range(20):
        oh.observe(elapsed=1.1, predicted=1.0, active=0)  # plain steps: 0.1 s the curves miss
        oh.observe(elapsed=2.1, predicted=1.0, active=2)  # + 0.5 s per drafting request
    assert oh.base == pytest.approx(0.1, rel=0.05) and oh.per_request == pytest.approx(0.5, rel=0.05)
    verify = CostModel([(1, 1.0), (64, 1.5)])
    reqs = [_req(6, 10), _req(6, 10)]
    assert cost_windows(reqs, [4, 4], verify)[0] != [0, 0]
    assert cost_windows(reqs, [4, 4], verify, per_request=oh.per_request)[0] == [0, 0]


@pytest.mark.parametrize("algo,rate", [("NGRAM", None), ("SYNTHETIC", 0.9), ("SYNTHETIC", 0.0)])
def test_cost_policy_is_lossless_and_adapts(monkeypatch: pytest.MonkeyPatch, algo: str, rate) -> None:  # noqa: ANN001
    # a fixed curve (extra verify tokens cost 10% of a step each) keeps the test independent of this
    # machine's timings; measuring and caching are tested below
    curve, draft = CostModel([(1, 1.0), (64, 7.3)]), CostModel([(1, 0.02), (64, 0.05)])
    monkeypatch.setattr(CostModel, "cached", classmethod(
        lambda cls, runner, key, cache_dir=None: draft if key.startswith("draft-") else curve))
    # ...and so does opening the empirical gate (it compares real step times; tested on its own below)
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch: True)
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
    if rate == 0.0:  # nothing is ever accepted: the policy falls back to plain decoding
        assert counts[0] > sum(counts[1:])
    if rate == 0.9:
        assert sum(counts[1:]) > counts[0]


def test_cost_curve_measured_once_and_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from specserve.cache.kv_pool import KVPool
    from specserve.engine.runner import ModelRunner

    m = tiny_model("llama")
    runner = ModelRunner(m, KVPool(m.cfg, 32, 16, m.dtype))
    first = CostModel.cached(runner, "tiny", cache_dir=tmp_path)
    assert len(first.points) >= 2 and all(t > 0 for _, t in first.points)
    assert runner.kv.allocator.num_free == runner.kv.allocator.num_pages  # measuring leaks no pages
    monkeypatch.setattr(CostModel, "measure", staticmethod(lambda *a, **k: pytest.fail("measured twice")))
    assert CostModel.cached(runner, "tiny", cache_dir=tmp_path).points == first.points


def test_cost_curve_is_dense_where_small_windows_fall(tmp_path) -> None:  # noqa: ANN001
    """Every verify size 1..17 is measured (no interpolation between powers of two), then sparser; a
    cache of the old sparse curve (its old file name) is not reused."""
    from specserve.cache.kv_pool import KVPool
    from specserve.engine.runner import ModelRunner
    from specserve.spec.cost import COST_SIZES

    m = tiny_model("llama")
    runner = ModelRunner(m, KVPool(m.cfg, 32, 16, m.dtype))
    threads = __import__("torch").get_num_threads()
    (tmp_path / f"tiny-t{threads}.json").write_text("[[1, 1.0], [2, 2.0], [4, 4.0]]")  # an old sparse cache
    pts = [n for n, _ in CostModel.cached(runner, "tiny", cache_dir=tmp_path).points]
    assert tuple(pts) == COST_SIZES and pts[:17] == list(range(1, 18)) and pts[17:] == [24, 32, 48, 64]


@pytest.mark.parametrize("draft_s,plain_s,expect_draft", [(0.02, 0.03, True), (0.04, 0.03, False)])
def test_draft_gate_follows_the_faster_arm_and_keeps_exploring(draft_s: float, plain_s: float, expect_draft: bool) -> None:
    gate = DraftGate(warmup=2, explore=5)
    decisions = []
    for _ in range(40):
        d = gate.allow(4)
        decisions.append(d)
        gate.observe(4, d, (draft_s if d else plain_s) * 4, 4)  # seconds per token of the arm taken
    assert decisions[:4] == [True, True, False, False]  # warm-up: each arm measured first
    later = decisions[10:]
    assert sum(later) == (len(later) - sum(1 for s in range(11, 41) if s % 5 == 0) if expect_draft
                          else sum(1 for s in range(11, 41) if s % 5 == 0))  # only exploration steps differ
    assert gate.bucket(3) == gate.bucket(4) == 4 and gate.bucket(1) == 1 and gate.bucket(5) == 8
