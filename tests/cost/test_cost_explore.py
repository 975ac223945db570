"""The `cost` policy plans on an upper confidence bound of acceptance: an unlucky start does not stop a draft
source that pays from ever being tested again, and one that does not pay is soon planned on its mean."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.core import DraftPlan, Request
from specserve.cost.curve import CostModel
from specserve.cost.acceptance import acceptance_estimate
from specserve.cost.policy import make_policy

# ms, near the 1.5B Q4_K_M target and its 0.5B draft on 2 cores: at acceptance 0.44 one draft position does not
# pay (1.44 tokens in 95 ms against 1 in 61), at 0.61 it does, at 0.75 two do
TARGET = CostModel([(1, 61.0), (2, 70.0), (3, 72.0), (4, 74.0), (5, 79.0)])
DRAFT = CostModel([(1, 25.0), (2, 26.0)])


def _policy(accepted: int, tested: int):  # noqa: ANN202
    pol = make_policy("cost", EngineConfig(model="unused"))
    pol.cost_model, pol.draft_cost_model = TARGET, DRAFT
    pol.drafter = SimpleNamespace(sources=["draft"])
    pol.draft_gate.allow = lambda batch, source="draft": "open"  # the gate leaves the windows to the plan
    pol.trials.pooled["draft"] = [accepted, tested]
    return pol


def _plan(pol) -> int:  # noqa: ANN001
    r = Request("r", [1, 2, 3], SamplingParams())
    return pol.plan([r], DraftPlan(["draft"], [4]))[0]


def test_an_unlucky_start_is_tested_again() -> None:
    """3 of the first 7 positions accepted (a source that accepts 0.75 over a run): no window pays at the mean
    0.44, so planning on the mean drafted nothing ever again; the bound (0.61) drafts, and the trials grow."""
    pol = _policy(3, 7)
    r = Request("x", [1], SamplingParams())
    assert acceptance_estimate(r.request_id, "draft", pol.trials) == pytest.approx(4 / 9)
    assert acceptance_estimate(r.request_id, "draft", pol.trials, 1.0) == pytest.approx(4 / 9 + (4 / 9 * 5 / 9 / 10) ** 0.5)
    pol.OPTIMISM = 0.0
    assert _plan(pol) == 0  # the deadlock: nothing drafted, nothing learned
    pol.OPTIMISM = 1.0
    assert _plan(pol) >= 1


def test_a_source_that_does_not_pay_is_planned_on_its_mean() -> None:
    """The same mean over 700 tested positions: the bound has shrunk to it, and nothing is drafted."""
    assert _plan(_policy(300, 700)) == 0


def test_a_source_that_pays_gets_its_window() -> None:
    assert _plan(_policy(525, 700)) >= 2
