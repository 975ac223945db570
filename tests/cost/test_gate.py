"""The `cost` policy's empirical gate (cost/gate.py): seconds per token of drafting vs plain steps, per batch
bucket and draft source; warm-up, exploration at doubling intervals, and the standard-error test."""
from __future__ import annotations

import pytest

from specserve.cost.gate import DraftGate


@pytest.mark.parametrize("draft_s,plain_s,expect_draft", [(0.02, 0.03, True), (0.028, 0.03, True), (0.04, 0.03, False)])
def test_draft_gate_follows_the_faster_arm_and_keeps_exploring(draft_s: float, plain_s: float, expect_draft: bool) -> None:
    gate = DraftGate(warmup=2, explore=5, max_explore=20, margin=0.1)
    decisions = []
    for _ in range(80):
        d = gate.allow(4)
        decisions.append(d)
        drafted = d != "closed"
        gate.observe(4, "draft" if drafted else None, (draft_s if drafted else plain_s) * 4, 4)  # s/token of the arm
    assert decisions[:4] == ["explore", "explore", "closed", "closed"]  # warm-up: each arm measured first
    later = decisions[10:]
    closed_at = [i for i, d in enumerate(decisions) if d == "closed"][2:]  # after the warm-up's two
    if expect_draft and draft_s < 0.9 * plain_s:  # open, 33% faster: plain re-measured after 5, 10, 20, 20 steps
        assert decisions[4:9] == ["open"] * 4 + ["closed"]
        assert [b - a for a, b in zip(closed_at, closed_at[1:])] == [10, 20, 20, 20]
    elif expect_draft:  # open, 7% faster (within the margin): plain decoding is measured again every 5th step
        assert closed_at[0] == 8 and {b - a for a, b in zip(closed_at, closed_at[1:])} == {5}
        assert set(later) == {"closed", "open"}
    else:  # closed; explored again after 5 steps, then 10, then every 20 (the cap)
        explored = [i for i, d in enumerate(decisions) if d == "explore"][2:]
        assert explored[0] == 8 and [b - a for a, b in zip(explored, explored[1:])] == [10, 20, 20, 20]
        assert set(later) == {"closed", "explore"}
    assert gate.bucket(3) == gate.bucket(4) == 4 and gate.bucket(1) == 1 and gate.bucket(5) == 8


@pytest.mark.parametrize("steps,expect_open", [
    # 6 ms for 1 token and 7 ms for 3, alternating: 13 ms / 4 tokens = 3.25 ms per token beats plain decoding's
    # 3.5, although the mean of the per-step ratios (4.17 ms) does not
    ([(0.006, 1), (0.007, 3)], True),
    # noisy and clearly slower: 9 ms for 1 token, twice, then 9.5 ms for 2 → 6.9 ms per token against 3.5
    ([(0.009, 1), (0.009, 1), (0.0095, 2)], False),
])
def test_draft_gate_compares_seconds_per_token_of_sums(steps: list, expect_open: bool) -> None:
    gate = DraftGate(warmup=2, explore=5)
    drafted = 0
    for _ in range(80):
        if gate.allow(1) == "closed":
            gate.observe(1, None, 0.0035, 1)
        else:
            gate.observe(1, "draft", *steps[drafted % len(steps)])
            drafted += 1
    assert (drafted > 50) == expect_open, drafted


def test_draft_gate_starts_closed_at_larger_batches_for_a_source_that_loses() -> None:
    """A source measured slower than plain at batch 1 is not warmed up with full-window drafts at batch 8:
    it starts closed there and is explored after `explore` steps; a source that paid at batch 1 warms up."""
    gate = DraftGate(warmup=2, explore=5)
    per_token = {"lookup": 0.02, "learned": 0.05, None: 0.03}
    for _ in range(12):  # batch 1: both sources and plain measured
        for src in ("lookup", "learned"):
            d = gate.allow(1, src)
            gate.observe(1, src if d != "closed" else None, per_token[src if d != "closed" else None], 1)
    assert gate.allow(8, "learned") == "closed" and gate.allow(8, "lookup") == "explore"
    decisions = []
    for _ in range(12):
        d = gate.allow(8, "learned")
        decisions.append(d)
        gate.observe(8, "learned" if d != "closed" else None, per_token["learned" if d != "closed" else None] * 8, 8)
    assert decisions.count("explore") == 1 and decisions[:2] == ["closed", "closed"]


def test_draft_gate_judges_each_source_on_its_own() -> None:
    """HYBRID: a free lookup that pays stays open while a learned drafter that costs more than it gains is
    closed (explored, i.e. drafted in full to be measured again, at growing intervals)."""
    gate = DraftGate(warmup=2, explore=5)
    per_token = {"lookup": 0.02, "learned": 0.05, None: 0.03}
    opened = {"lookup": [], "learned": []}
    for step in range(60):
        allowed = {s: gate.allow(1, s) for s in ("lookup", "learned")}
        src = ("learned" if step % 2 else "lookup") if step < 30 else "learned"  # which one this request needs
        for s in opened:
            opened[s].append(allowed[s])
        arm = src if allowed[src] != "closed" else None
        gate.observe(1, arm, per_token[arm], 1)
    later = {s: opened[s][10:] for s in opened}  # after warm-up
    # pays (33% faster than plain): open, plain decoding re-measured 5, then 10, then 20 steps after the warm-up
    assert [i for i, d in enumerate(opened["lookup"]) if d == "closed"][-3:] == [10, 20, 40]
    assert later["lookup"].count("closed") == 3
    explored = [i for i, d in enumerate(opened["learned"]) if d == "explore"][4:]  # after its warm-up
    assert explored == [10, 20, 40]  # does not pay: explored again at doubling intervals
    assert later["learned"].count("closed") == len(later["learned"]) - 3
