"""The `cost` verify-window policy (spec in cost/__init__.py): plans who drafts and how many tokens on the measured
curves, cuts block and tree drafts after drafting, learns from every step."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import kernels
from ..config import EngineConfig
from ..core import DraftPlan, Proposal, Request
from ..models import fused
from .acceptance import accept_curves, pooled_acceptance
from .curve import Calibration, CostModel
from .gate import DraftGate
from .policy import StepStats, WindowPolicy, register_policy
from .windows import DraftCost, cost_windows, draft_time

if TYPE_CHECKING:
    from ..drafters.base import Drafter
    from ..runtime.runner import ModelRunner


@register_policy
class CostPolicy(WindowPolicy):
    """Owns the measured curves (the target's step, corrected online; a model drafter's per-position forward),
    the measured per-request draft cost and the empirical DraftGate."""

    name = "cost"
    help = ("per-request windows maximising expected tokens per second of a measured verify-cost curve "
            "(0 = plain)")
    #: drafters stop a chain once it is < 20% likely to be accepted this far. NOTE: measured, not derived (the
    #: window maths verifies positions down to ~10% at batch 1, but confidence calibrated on one text is
    #: optimistic on others): docs/benchmarks.md, "The cost policy's constants"
    floor = 0.2
    #: after this many plans in a row at one batch size that drafted nothing, that size skips planning ...
    IDLE_AFTER = 8
    #: ... for this many steps. NOTE: a plan that drafts nothing still pays for the requests' draft sources and
    #: the plan; at batch 1 a plan drafts nothing often but rarely 8 times in a row, and a skipped step there
    #: could have drafted a prompt lookup (docs/benchmarks.md, "The cost policy's constants")
    IDLE_STEPS = 16
    #: windows are planned on acceptance plus this many standard deviations of the source's pooled rate.
    #: NOTE: on the mean alone an unlucky start never recovers (no window pays, so nothing more is tested; the
    #: case is in docs/benchmarks.md, "The cost policy's constants"). The bound shrinks as
    #: 1/sqrt(positions tested), so a source that does not pay is soon planned on its mean
    OPTIMISM = 1.0
    #: an explored source is forced to draft for at most this many requests of a step, in turn. NOTE: enough to
    #: measure its cost per drafting request and its acceptance; forcing all of them made every request of a
    #: large batch pay a learned drafter's catch-up over the rows it skipped (SmolLM2 + the shipped DSpark,
    #: batch 16: each such step cost ~2 decode steps, ~5% of a 64-token run that drafted nothing)
    EXPLORE_REQUESTS = 2
    #: a token generated with a draft model saves about this share of a decode step: what its prefill is priced
    #: against at admission. NOTE: measured, not derived: AUTO + draft on the 1.5B/0.5B pair runs 1.2–1.4× plain
    #: (a token at 0.71–0.83 of a step)
    SAVED_PER_TOKEN = 0.2

    def __init__(self, config: EngineConfig, runner: "ModelRunner | None" = None,
                 drafter: "Drafter | None" = None) -> None:
        """Without a runner (tests), `cost_model` and `drafter` are set by hand."""
        super().__init__(config)
        self.cost_model: CostModel | None = None
        self.draft_cost_model: CostModel | None = None
        self.draft_cost = DraftCost()
        self.draft_gate = DraftGate()
        self.whole = False  # the drafter pays for its whole window: plan who drafts, cut after drafting
        self.drafter: "Drafter | None" = None
        self.arm: str | None = None  # the costliest draft source planned this step (the gate's arm)
        self.forced: list[bool] = []  # requests whose source the gate explores this step
        self.explore_turn = 0  # where the next explored step's forced requests start (_explored)
        self.draft_predicted = 0.0  # the model drafter's curve time for the windows planned this step
        self.empty_plans: dict[int, int] = {}  # batch size → plans in a row that drafted nothing
        self.skip: dict[int, int] = {}  # batch size → steps left that skip planning
        self.calibrations: list[Calibration] = []  # the curves' measurements left to do
        if runner is not None and drafter is not None:
            self.cost_model, cal = CostModel.load(runner, self._key(runner))
            self.calibrations.append(cal)
            draft_runner = getattr(drafter, "runner", None)  # model drafters draft position by position
            if draft_runner is not None:
                self.draft_cost_model, cal = CostModel.load(draft_runner, "draft-" + self._key(draft_runner))
                self.calibrations.append(cal)
            self.whole = drafter.drafts_whole_window
            self.drafter = drafter

    def _key(self, runner: "ModelRunner") -> str:
        m = runner.model
        tp = f"-tp{m.tp.world}" if getattr(m, "tp", None) else ""  # a shard's step costs differ from the whole model's
        # NOTE: curves measured with other kernels (an edited checkout) are stale: the sources' digest is in the key
        kern = f"-k{kernels.source_digest()[:8]}" if fused.enabled() else ""
        kvd = f"-kv{runner.kv.dtype}" if runner.kv.dtype != m.dtype else ""  # a bf16 pool: faster at long contexts
        return "".join(c if c.isalnum() else "_" for c in f"{m.cfg.name}-{m.dtype}-{self.config.quantization}{kvd}{tp}{kern}")

    def calibrate(self, busy: bool = False) -> bool:
        for cal in list(self.calibrations):
            if busy and not cal.under_load:
                continue  # a cached curve's check waits for idle time (curve.Calibration)
            if cal.step(busy):
                break
            self.calibrations.remove(cal)
        return bool(self.calibrations)

    def measures_under_load(self) -> bool:
        return any(c.under_load for c in self.calibrations)

    def idle(self, batch: int) -> bool:
        left = self.skip.get(batch, 0)
        if left:
            self.skip[batch] = left - 1
        return left > 0

    def plan(self, reqs: list[Request], plan: DraftPlan) -> list[int]:
        sources, limits = plan.sources, plan.windows
        gate = {s: self.draft_gate.allow(len(reqs), s) for s in dict.fromkeys(sources)}
        self.forced = self._explored([gate[s] == "explore" for s in sources])  # at least one draft: measure it
        open_limits = [w if gate[s] != "closed" else 0 for w, s in zip(limits, sources)]
        windows, _ = cost_windows(reqs, open_limits, self.cost_model, self.draft_cost_model,
                                  self.draft_cost.cost(sources), trials=self.trials, optimism=self.OPTIMISM,
                                  sources=sources)
        windows = [max(k, min(w, 1)) if f else k for w, k, f in zip(limits, windows, self.forced)]
        if self.whole:  # the cost model picks who drafts; the window is cut after drafting
            windows = [w if k else 0 for w, k in zip(limits, windows)]
        self.draft_predicted = draft_time(self.draft_cost_model, sum(1 for k in windows if k), max(windows, default=0))
        drafting = [s for s, k in zip(sources, windows) if k]
        self.arm = max(drafting, key=self.drafter.sources.index) if drafting else None  # the costliest one
        b = len(reqs)
        self.empty_plans[b] = 0 if drafting else self.empty_plans.get(b, 0) + 1
        if self.empty_plans[b] >= self.IDLE_AFTER:  # NOTE: arm and draft_predicted stay None/0 while skipping
            self.skip[b] = self.IDLE_STEPS
        return windows

    def _explored(self, explore: list[bool]) -> list[bool]:
        """Of the requests whose source is explored, the EXPLORE_REQUESTS next in turn."""
        idx = [i for i, e in enumerate(explore) if e]
        if len(idx) <= self.EXPLORE_REQUESTS:
            return explore
        start = self.explore_turn % len(idx)
        self.explore_turn += self.EXPLORE_REQUESTS
        picked = {idx[(start + j) % len(idx)] for j in range(self.EXPLORE_REQUESTS)}
        return [i in picked for i in range(len(explore))]

    def draft_pays(self, batch: int, k: int) -> bool:
        """The cost model's plan for `batch` requests like those seen so far (the source's pooled acceptance,
        its measured cost per drafting request) drafts for one of them. NOTE: not the gate: a source it closes is
        explored again later, which a skipped request cannot be (asking the gate shut the draft model off at
        batch 1 after a few noisy steps; docs/benchmarks.md, "The cost policy's constants"). True without a draft
        model."""
        if self.draft_cost_model is None:
            return True
        source = self.drafter.sources[-1]
        a = min(pooled_acceptance(self.trials, source)[0], 0.999)  # NOTE: the mean, not `plan`'s upper bound
        gains = [[a ** (j + 1) for j in range(k)]] * batch
        over = [max(0.0, self.draft_cost.per_request.get(source, 0.0))] * batch
        plan, _ = cost_windows([None] * batch, [k] * batch, self.cost_model, self.draft_cost_model, over, gains)
        return any(plan)

    def prefill_pays(self, context: int, left: int) -> bool:
        """The draft model's forward over `context` tokens, at its curve's cost per token for its largest measured
        size, against what `left` tokens generated with it save (SAVED_PER_TOKEN of a target decode step each).
        On the 1.5B/0.5B pair a prompt token costs the draft ~0.05 of a target step: it pays for an answer of a
        quarter of the prompt's length or more. True without a draft model."""
        d = self.draft_cost_model
        if d is None or self.cost_model is None:
            return True
        n = d.points[-1][0]
        return left * self.SAVED_PER_TOKEN * self.cost_model(1) >= context * d(n) / n

    def cut(self, reqs: list[Request], plan: DraftPlan, proposal: Proposal) -> list[int]:
        if not self.whole:
            return plan.windows
        curves = accept_curves(reqs, plan, proposal, self.trials)
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
