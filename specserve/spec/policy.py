"""Verify-window policies: how many draft tokens each request verifies this step.

One object per engine, called around the drafter without the engine knowing which it is:
  idle(batch) → bool                True: nobody drafts this step (the engine skips the drafter and plan)
  plan(reqs, limits) → windows      before drafting (limits: what pages, max_tokens, context allow)
  cut(reqs, proposal, windows)      after drafting: the prefix of each proposal to verify
  observe(stats)                    after the step (measured time, drafting requests, tokens)
  floor                             cumulative confidence below which drafting may stop
`fixed`: every request verifies K (bounded by its limits).
`confidence`: each request keeps the prefix whose cumulative draft confidence Π_{j≤i} c_j (DSpark's
confidence head; otherwise the draft probability of each chosen token; for drafters with neither,
the request's acceptance so far) stays ≥ --speculative-confidence-threshold: windows are ragged.
`cost`: windows that maximise expected tokens per second of measured verify cost (spec/cost.py).
Block drafters (DFlash, DSpark) draft their whole block in one forward whatever the window, and
EAGLE-2 trees cost their depth whatever the node count, so for them `cost` plans only who drafts
and cuts after drafting, with the marginal gains taken from the cumulative draft confidence of each
position (tree: of each node's path) instead of α_b^{k+1}.
A new policy: a subclass here with `@register_policy` (its `name` and `help` are --speculative-window's
choice and help: the registry is the one list).
"""
from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .. import kernels
from ..config import EngineConfig
from ..core import Proposal, Request
from ..models import fused
from .cost import (AcceptTrials, CostModel, DraftCost, acceptance_estimate, cost_windows, draft_time,
                   pooled_acceptance)
from .gate import DraftGate

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

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        #: each running request's acceptance per draft source, and every request's (the prior of each estimate)
        self.trials = AcceptTrials()

    def bind(self, runner: "ModelRunner", drafter: "Drafter") -> None:
        """Called once the target runner and the drafter exist (measure what the policy needs)."""

    def idle(self, batch: int) -> bool:
        """True when no request of a `batch`-request step will draft: the engine then skips the drafter's
        per-request bookkeeping and plan (their windows are 0)."""
        return False

    def plan(self, reqs: list[Request], limits: list[int]) -> list[int]:
        return list(limits)

    def draft_model_off(self, reqs: list[Request], batch: int, k: int) -> None:
        """Before a draft model prefills `reqs` (heading for a `batch`-request decode, windows ≤ k): set
        req.draft_off where it should not (its prefill is a forward of its own). Default: never."""

    def draft_model_back(self, reqs: list[Request], k: int) -> None:
        """Before planning a decode step of `reqs`: clear draft_off where the draft model should catch up and draft
        again. Default: never (nothing is turned off)."""

    def cut(self, reqs: list[Request], proposal: Proposal, windows: list[int]) -> list[int]:
        return windows

    def observe(self, stats: StepStats) -> None:
        """Learn from the step just run."""

    def release(self, req: Request) -> None:
        """Forget a finished request's state."""
        self.trials.release(req.request_id)


_POLICIES: dict[str, type[WindowPolicy]] = {}


def register_policy(cls: type[WindowPolicy]) -> type[WindowPolicy]:
    _POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, config: EngineConfig) -> WindowPolicy:
    return _POLICIES[name](config)


def policy_names() -> tuple[str, ...]:
    return tuple(_POLICIES)


def policies_help() -> str:
    return "; ".join(f"{n} = {c.help}" for n, c in _POLICIES.items())


@register_policy
class FixedPolicy(WindowPolicy):
    name = "fixed"
    help = "K for every request"


@register_policy
class ConfidencePolicy(WindowPolicy):
    name = "confidence"
    help = "the prefix whose cumulative draft confidence stays >= --speculative-confidence-threshold"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.threshold = self.floor = config.value("speculative_confidence_threshold")

    def cut(self, reqs: list[Request], proposal: Proposal, windows: list[int]) -> list[int]:
        return confidence_windows(accept_curves(reqs, proposal, windows, self.trials), self.threshold)


@register_policy
class CostPolicy(WindowPolicy):
    """Owns the measured curves (the target's step, corrected online; a model drafter's per-position forward),
    the measured per-request draft cost and the empirical DraftGate."""

    name = "cost"
    help = ("per-request windows maximising expected tokens per second of a measured verify-cost curve "
            "(0 = plain)")
    #: drafters stop a chain once it is < 20% likely to be accepted this far. NOTE: measured, not derived: the
    #: window maths verifies positions down to ~10% at batch 1, but the table's calibration (held-out chat) is
    #: ~20% optimistic on other text, and AUTO ran 1.198x plain at 0.02, 1.220-1.222x at 0.2-0.3 (batch 8: same);
    #: with the gate's plain re-measurements thinned out (AUTO vs plain, batch 1): 1.337x at 0.3, 1.364x at 0.2,
    #: 1.373x at 0.15
    floor = 0.2
    #: after this many plans in a row at one batch size that drafted nothing, that size skips planning ...
    IDLE_AFTER = 8
    #: ... for this many steps. NOTE: at batch 16 the plan drafted nothing in 2,016 of 2,016 steps, while each
    #: step paid ~1% for the requests' draft sources and the plan; at batch 1 a plan drafts nothing ~1 step in 3
    #: but rarely 8 times in a row, and a skipped step there could have drafted a prompt lookup
    IDLE_STEPS = 16
    #: windows are planned on acceptance plus this many standard deviations of the source's pooled rate.
    #: NOTE: on the mean alone an unlucky start never recovers: the 1.5B pair's 0.5B draft had 3 of its first 7
    #: positions accepted (0.75 over a whole run), no window paid at 0.44, so nothing more was tested and AUTO
    #: ran plain for the rest of the run (GSM8K + Alpaca: 0.99x plain where STANDALONE ran 1.15x). The bound
    #: shrinks as 1/sqrt(positions tested), so a source that does not pay is soon planned on its mean
    OPTIMISM = 1.0

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.cost_model: CostModel | None = None
        self.draft_cost_model: CostModel | None = None
        self.draft_cost = DraftCost()
        self.draft_gate = DraftGate()
        self.whole = False  # the drafter pays for its whole window: plan who drafts, cut after drafting
        self.drafter: "Drafter | None" = None
        self.arm: str | None = None  # the costliest draft source planned this step (the gate's arm)
        self.forced: list[bool] = []  # requests whose source the gate explores this step
        self.draft_predicted = 0.0  # the model drafter's curve time for the windows planned this step
        self.empty_plans: dict[int, int] = {}  # batch size → plans in a row that drafted nothing
        self.skip: dict[int, int] = {}  # batch size → steps left that skip planning

    def _key(self, runner: "ModelRunner") -> str:
        m = runner.model
        tp = f"-tp{m.tp.world}" if getattr(m, "tp", None) else ""  # a shard's step costs differ from the whole model's
        # NOTE: curves measured with other kernels (an edited checkout) are stale: the sources' digest is in the key
        kern = f"-k{kernels.source_digest()[:8]}" if fused.enabled() else ""
        kvd = f"-kv{runner.kv.dtype}" if runner.kv.dtype != m.dtype else ""  # a bf16 pool: faster at long contexts
        return "".join(c if c.isalnum() else "_" for c in f"{m.cfg.name}-{m.dtype}-{self.config.quantization}{kvd}{tp}{kern}")

    def bind(self, runner: "ModelRunner", drafter: "Drafter") -> None:
        super().bind(runner, drafter)
        self.cost_model = CostModel.cached(runner, self._key(runner))
        draft_runner = getattr(drafter, "runner", None)  # model drafters draft position by position
        if draft_runner is not None:
            self.draft_cost_model = CostModel.cached(draft_runner, "draft-" + self._key(draft_runner))
        self.whole = drafter.drafts_whole_window
        self.drafter = drafter

    def idle(self, batch: int) -> bool:
        left = self.skip.get(batch, 0)
        if left:
            self.skip[batch] = left - 1
        return left > 0

    def plan(self, reqs: list[Request], limits: list[int]) -> list[int]:
        sources = [r.draft_source for r in reqs]  # set by the engine before planning
        gate = {s: self.draft_gate.allow(len(reqs), s) for s in dict.fromkeys(sources)}
        self.forced = [gate[s] == "explore" for s in sources]  # at least one draft: measure this source
        open_limits = [w if gate[s] != "closed" else 0 for w, s in zip(limits, sources)]
        plan, _ = cost_windows(reqs, open_limits, self.cost_model, self.draft_cost_model, self.draft_cost.cost(reqs),
                               trials=self.trials, optimism=self.OPTIMISM)
        plan = [max(k, min(w, 1)) if f else k for w, k, f in zip(limits, plan, self.forced)]
        if self.whole:  # the cost model picks who drafts; the window is cut after drafting
            plan = [w if k else 0 for w, k in zip(limits, plan)]
        self.draft_predicted = draft_time(self.draft_cost_model, sum(1 for k in plan if k), max(plan, default=0))
        drafting = [s for s, k in zip(sources, plan) if k]
        self.arm = max(drafting, key=self.drafter.sources.index) if drafting else None  # the costliest one
        b = len(reqs)
        self.empty_plans[b] = 0 if drafting else self.empty_plans.get(b, 0) + 1
        if self.empty_plans[b] >= self.IDLE_AFTER:  # NOTE: arm and draft_predicted stay None/0 while skipping
            self.skip[b] = self.IDLE_STEPS
        return plan

    def draft_model_off(self, reqs: list[Request], batch: int, k: int) -> None:
        if self.draft_cost_model is not None and reqs and not self.draft_pays(batch, k):
            for r in reqs:
                r.draft_off = True

    def draft_model_back(self, reqs: list[Request], k: int) -> None:
        """Back on where drafting pays at this batch size (the batch shrank) for requests with at least as many
        tokens left to generate as the draft model must catch up on (its forward over the whole context: ~1/3
        of the target's prefill on the 1.5B pair, where a drafted token saves ~1/5 of a decode step)."""
        back = [r for r in reqs if r.draft_off and r.params.max_tokens - len(r.output_ids) >= r.seq_len]
        if back and self.draft_pays(len(reqs), k):
            for r in back:
                r.draft_off = False

    def draft_pays(self, batch: int, k: int) -> bool:
        """The cost model's plan for `batch` requests like those seen so far (the source's pooled acceptance,
        its measured cost per drafting request) drafts for one of them. NOTE: the 1.5B Q4_K_M target with its
        0.5B draft, 2 cores: a draft position pays up to batch 4, none at batch 8 (t(16) = 1.6 t(8)), where
        prefilling the draft for the prompts alone cost AUTO 12% of plain's time (chat and code prompts, 32 new
        tokens). Not the gate: a source it closes is explored again later, which a skipped request cannot be
        (asking it shut the draft model off at batch 1 after a few noisy steps: AUTO + draft 1.56x llama.cpp in
        one run of `bench real` on the 1.5B pair, 1.80x in the next without it)."""
        source = self.drafter.sources[-1]
        a = min(pooled_acceptance(self.trials, source)[0], 0.999)  # NOTE: the mean, not `plan`'s upper bound
        gains = [[a ** (j + 1) for j in range(k)]] * batch
        over = [max(0.0, self.draft_cost.per_request.get(source, 0.0))] * batch
        plan, _ = cost_windows([None] * batch, [k] * batch, self.cost_model, self.draft_cost_model, over, gains)
        return any(plan)

    def cut(self, reqs: list[Request], proposal: Proposal, windows: list[int]) -> list[int]:
        if not self.whole:
            return windows
        curves = accept_curves(reqs, proposal, windows, self.trials)
        # NOTE: the drafts exist: drafting is paid for, only verifying them costs from here. An explored source
        # is not forced to verify a draft either: it drafted (plan forced that), and which drafts to verify is
        # the cost model's choice, as when it is open. Forcing the first one verified its least likely drafts
        # too, and the gate measured the source slower than it runs open.
        return cost_windows(reqs, [len(c) for c in curves], self.cost_model, None, 0.0, curves)[0]

    def observe(self, stats: StepStats) -> None:
        if stats.after_prefill:
            return
        self.cost_model.observe(stats.batch + stats.draft_tokens, stats.seconds - stats.draft_seconds)
        self.draft_cost.observe(stats.draft_seconds, self.draft_predicted, stats.drafted, self.arm)
        self.draft_gate.observe(stats.batch, self.arm if stats.drafted else None, stats.seconds, stats.emitted)


def accept_curves(reqs: list[Request], proposal: Proposal, windows: list[int],
                  trials: AcceptTrials | None = None) -> list[list[float]]:
    """Per request, P(draft positions 1..i all accepted) for i = 1..min(drafted, window): the
    cumulative product of the drafter's per-token confidence (a NaN entry: the request's acceptance
    estimate), or α^i from the request's acceptance so far. For a tree entry i is P(node i accepted) = the
    product over its path, which is non-increasing in the tree's best-first order, so cutting a prefix keeps
    the most likely nodes."""
    out = []
    for b, r in enumerate(reqs):
        n = min(len(proposal.tokens[b]), windows[b])
        c = proposal.confidence[b] if proposal.confidence is not None else None
        par = proposal.parents[b] if proposal.parents is not None else None
        if c is not None and len(c) >= n:
            # NOTE: plain floats (a window is a few tokens: torch ops per step cost more than the arithmetic);
            # the same double products as a cumprod in float64
            xs = c[:n].tolist()
            if any(map(math.isnan, xs)):  # NaN: that token's source has no score of its own
                fill = acceptance_estimate(r, trials)
                xs = [fill if math.isnan(x) else x for x in xs]
            v: list[float] = []
            for i, x in enumerate(xs):
                prev = (v[par[i]] if par[i] >= 0 else 1.0) if par is not None else (v[-1] if v else 1.0)
                v.append(min(max(x, 0.0), 1.0) * prev)
            out.append(v)
        else:
            a = acceptance_estimate(r, trials)
            out.append([a ** (i + 1) for i in range(n)])
    return out


def confidence_windows(curves: list[list[float]], threshold: float) -> list[int]:
    """The longest prefix whose cumulative acceptance probability stays ≥ threshold."""
    return [sum(1 for p in c if p >= threshold) for c in curves]  # curves are non-increasing
