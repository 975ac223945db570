"""Verify-window policies: how many draft tokens each request verifies this step.

The draft stage (speculative/draft.py) calls one per engine around the drafter:
  idle(batch) → bool                  True: nobody drafts this step (the stage skips sources and plan)
  plan(reqs, plan) → windows          before drafting: plan.sources (who drafts for each request) and
                                      plan.windows (the most each may verify: pages, max_tokens, context)
  cut(reqs, plan, proposal) → windows after drafting: the prefix of each proposal to verify
  observe(stats)                      after the step (measured time, drafting requests, tokens)
  draft_pays(batch, k) → bool         whether a draft model's own forwards pay at this batch size
  prefill_pays(context, left) → bool  whether a draft model's forward over `context` tokens pays for a request
                                      with `left` tokens still to generate
  release(request_id)                 forget a finished request
  calibrate(busy) → bool              one piece of measurement (idle, or between steps under load); True while
                                      more is left
and reads `floor` (cumulative confidence below which drafting may stop) and `trials` (acceptance per draft
source, which the commit stage records).
`fixed`: every request verifies K (bounded by its limits).
`confidence`: each request keeps the prefix whose cumulative draft confidence Π_{j≤i} c_j (DSpark's
confidence head; otherwise the draft probability of each chosen token; for drafters with neither,
the request's acceptance so far) stays ≥ --speculative-confidence-threshold: windows are ragged.
`cost` (cost_policy.py): windows that maximise expected tokens per second of measured verify cost.
A new policy: a subclass with `@register_policy` in a module named in `_MODULES` (its `name` and `help` are
--speculative-window's choice and help: the registry is the one list).
"""
from __future__ import annotations

import importlib
from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..config import EngineConfig
from ..core import DraftPlan, Proposal, Request
from .acceptance import AcceptTrials, accept_curves, confidence_windows

if TYPE_CHECKING:
    from ..drafters.base import Drafter
    from ..runtime.runner import ModelRunner


@dataclass
class StepStats:
    """One decode step as the policy sees it afterwards."""

    seconds: float
    batch: int  # decoding requests
    drafted: int  # requests that drafted
    emitted: int  # tokens emitted (accepted drafts + one each)
    #: a prefill forward ran since the last decode step. NOTE: the first small forward after a large one runs
    #: ~1.5 ms slow here (AMX/cache after-effects), so such steps are outliers the cost policy does not learn from
    after_prefill: bool = False
    draft_tokens: int = 0  # draft tokens verified (after the window cut)
    draft_seconds: float = 0.0  # of `seconds`, the drafter's propose


class WindowPolicy(ABC):
    name: ClassVar[str]
    help: ClassVar[str]  # --speculative-window's help for it
    floor: float = 0.0

    def __init__(self, config: EngineConfig, runner: "ModelRunner | None" = None,
                 drafter: "Drafter | None" = None) -> None:
        """`runner`, `drafter`: the target's runner and the drafter, for a policy that measures them."""
        self.config = config
        #: each running request's acceptance per draft source, and every request's (the prior of each estimate)
        self.trials = AcceptTrials()

    @classmethod
    def floor_for(cls, config: EngineConfig) -> float:
        """`floor` before the policy exists (the drafter is built first, and stops drafting below it)."""
        return cls.floor

    def idle(self, batch: int) -> bool:
        """True when no request of a `batch`-request step will draft: the stage then skips the drafter's
        per-request sources and the plan (every window is 0)."""
        return False

    def plan(self, reqs: list[Request], plan: DraftPlan) -> list[int]:
        return list(plan.windows)

    def cut(self, reqs: list[Request], plan: DraftPlan, proposal: Proposal) -> list[int]:
        return plan.windows

    def observe(self, stats: StepStats) -> None:
        """Learn from the step just run."""

    def draft_pays(self, batch: int, k: int) -> bool:
        """Whether a draft model's forwards pay for requests in a `batch`-request decode (windows ≤ k). Default:
        always (nothing is turned off)."""
        return True

    def prefill_pays(self, context: int, left: int) -> bool:
        """Whether a draft model's forward over a request's `context` tokens (its prefill, or its catch-up) pays
        for the `left` tokens it may still generate. Default: always (the windows are the user's)."""
        return True

    def release(self, request_id: str) -> None:
        """Forget a finished request's state."""
        self.trials.release(request_id)

    def calibrate(self, busy: bool = False) -> bool:
        """One piece of measurement (one forward); True while more is left. busy: requests are running (their
        pages are held, so a forward the pool cannot hold now waits for later)."""
        return False

    def measures_under_load(self) -> bool:
        """calibrate(busy=True) has a piece to run: measurement that may share the time of running requests."""
        return False


_POLICIES: dict[str, type[WindowPolicy]] = {}
#: modules whose import registers policies (beside this one)
_MODULES = ("cost_policy",)


def register_policy(cls: type[WindowPolicy]) -> type[WindowPolicy]:
    _POLICIES[cls.name] = cls
    return cls


def policies() -> dict[str, type[WindowPolicy]]:
    for m in _MODULES:
        importlib.import_module(f"{__package__}.{m}")
    return _POLICIES


def make_policy(name: str, config: EngineConfig, runner: "ModelRunner | None" = None,
                drafter: "Drafter | None" = None) -> WindowPolicy:
    return policies()[name](config, runner, drafter)


def policy_names() -> tuple[str, ...]:
    return tuple(policies())


def policies_help() -> str:
    return "; ".join(f"{n} = {c.help}" for n, c in policies().items())


@register_policy
class FixedPolicy(WindowPolicy):
    name = "fixed"
    help = "K for every request"


@register_policy
class ConfidencePolicy(WindowPolicy):
    name = "confidence"
    help = "the prefix whose cumulative draft confidence stays >= --speculative-confidence-threshold"

    def __init__(self, config: EngineConfig, runner: "ModelRunner | None" = None,
                 drafter: "Drafter | None" = None) -> None:
        super().__init__(config)
        self.threshold = self.floor = self.floor_for(config)

    @classmethod
    def floor_for(cls, config: EngineConfig) -> float:
        return config.value("speculative_confidence_threshold")

    def cut(self, reqs: list[Request], plan: DraftPlan, proposal: Proposal) -> list[int]:
        return confidence_windows(accept_curves(reqs, plan, proposal, self.trials), self.threshold)
