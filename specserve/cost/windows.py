"""The `cost` policy's window choice: per-request windows k_b that maximise expected emitted tokens per second,

    maximise  Σ_b E_b(k_b) / t(Σ_b (k_b + 1)),    E_b(k) = (1 − α_b^{k+1}) / (1 − α_b)

where α_b is request b's per-position acceptance so far (acceptance.py) and t the measured curve (curve.py).
Greedy: start every window at 0 and keep adding the draft position with the largest marginal gain α_b^{k_b+1}
while the ratio improves. A window of 0 is plain decoding for that request, so the batch is never planned
slower than plain decoding. Drafting costs what DraftCost measured per drafting request of each source
(the draft stage is timed on its own), plus, for model drafters (STANDALONE, SYNTHETIC), their measured
forward time per draft position; a last empirical guard (DraftGate, gate.py) compares measured seconds per
token of steps with and without drafting, so a drafter whose gain and cost nearly cancel is switched off
where it measures slower.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core import Request
from .acceptance import AcceptTrials, acceptance_estimate
from .curve import CostModel

DEFAULT_SOURCE = "draft"  # a drafter's one source (drafters/base.py `Drafter.sources`)


@dataclass
class DraftCost:
    """Seconds per drafting request of each draft source, from the drafter's propose, timed on its own (EMA):
    a lookup, a table walk, or a learned drafter's forward and catch-up. Model drafters that draft position by
    position have their forward curve besides (cost_windows' `draft_step`): what it misses is learned here.
    Per source, since HYBRID's free lookups must not be charged its learned drafter's forward (a step counts
    for its costliest source)."""

    per_request: dict[str, float] = field(default_factory=dict)
    decay: float = 0.9

    def cost(self, sources: list[str]) -> list[float]:
        """Seconds each request would add by drafting from its source this step (the estimate, never below 0)."""
        return [max(0.0, self.per_request.get(s, 0.0)) for s in sources]

    def observe(self, seconds: float, predicted: float, active: int, source: str | None) -> None:
        """One draft stage: `seconds` measured, `predicted` by the model drafter's curve (0 for others)."""
        if active == 0 or source is None:
            return
        # NOTE: samples below zero are kept (only the estimate's use is clamped): clamping each sample biased
        # the mean upwards and shut off drafts that paid
        x = (seconds - predicted) / active
        self.per_request[source] = self.decay * self.per_request.get(source, x) + (1 - self.decay) * x


def draft_time(draft_step: CostModel | None, active: int, longest: int) -> float:
    """A model drafter's curve time: one draft forward over the `active` drafting requests per position of
    the longest window (0 for drafters without a forward curve)."""
    return draft_step(active) * longest if draft_step is not None and active and longest else 0.0


def step_time(cost: CostModel, draft_step: CostModel | None, n_tokens: int, active: int, longest: int) -> float:
    """The curves' time of one step: a verify forward over `n_tokens` packed tokens, plus draft_time."""
    return cost(n_tokens) + draft_time(draft_step, active, longest)


def cost_windows(reqs: list[Request], limits: list[int], cost: CostModel, draft_step: CostModel | None = None,
                 per_request: float | list[float] = 0.0, gains: list[list[float]] | None = None,
                 trials: AcceptTrials | None = None, optimism: float = 0.0,
                 sources: list[str] | None = None) -> tuple[list[int], float]:
    """Greedy maximisation of expected tokens per second (module docstring; exact for one request). With `draft_step`
    (a model drafter's forward time over m tokens), a step also pays draft_step(#drafting) for each
    draft position up to the longest window, since model drafters draft position by position;
    `per_request` (DraftCost: one value, or one per request) is charged for every drafting request.
    `gains[b][j]`: P(positions 1..j+1 accepted) (from `accept_curves`); default α_b^{j+1}, α_b from
    acceptance_estimate from `trials` of each request's source in `sources` (default: the one source "draft"),
    raised by `optimism` standard deviations.
    Returns the windows and the curves' predicted step time for them (without `per_request`)."""
    sources = sources or [DEFAULT_SOURCE] * len(reqs)
    alphas = [] if gains is not None else [acceptance_estimate(r.request_id, s, trials, optimism)
                                           for r, s in zip(reqs, sources)]
    over = per_request if isinstance(per_request, list) else [per_request] * len(reqs)

    def gain(b: int, j: int) -> float:
        return gains[b][j] if gains is not None else alphas[b] ** (j + 1)

    if len(reqs) == 1:  # NOTE: one request: every window scored on the real curve, exact and ~5x cheaper
        tokens, best_k, best_t = 1.0, 0, step_time(cost, draft_step, 1, 0, 0)
        best = tokens / best_t
        for n in range(1, limits[0] + 1):
            tokens += gain(0, n - 1)
            t = step_time(cost, draft_step, 1 + n, 1, n)
            if (ratio := tokens / (t + over[0])) > best:
                best_k, best, best_t = n, ratio, t
        return [best_k], best_t

    def plan(curve: CostModel, order: list[int] | None) -> tuple[list[int], list[int], float]:
        """Add draft positions one at a time: along `order`, or else greedily while the ratio improves.
        Returns (the positions added in order, the windows of the best prefix, its step time)."""
        k = [0] * len(reqs)
        tokens, n, active, longest, charged = float(len(reqs)), len(reqs), 0, 0, 0.0  # every request emits 1
        best_t = step_time(curve, draft_step, n, 0, 0)
        best, best_k = tokens / best_t, list(k)
        added: list[int] = []
        done: set[int] = set()  # requests whose next position did not pay (their later ones gain less)
        todo = iter(order) if order is not None else None
        while True:
            if todo is not None:
                b = next(todo, None)
                if b is None:
                    break
            else:  # largest marginal gain first; among equals, one that does not lengthen the longest window
                cands = [(gain(b, k[b]), -(k[b] + 1 > longest), b) for b in range(len(reqs))
                         if k[b] < limits[b] and b not in done]
                if not cands:
                    break
                b = max(cands)[2]
            g = gain(b, k[b])
            a2, l2 = active + (k[b] == 0), max(longest, k[b] + 1)
            c2 = charged + (over[b] if k[b] == 0 else 0.0)
            t = step_time(curve, draft_step, n + 1, a2, l2)
            ratio = (tokens + g) / (t + c2)
            if todo is None and ratio <= best:  # NOTE: not a stop: another request may be cheaper to open
                done.add(b)
                continue
            k[b] += 1
            added.append(b)
            tokens, n, active, longest, charged = tokens + g, n + 1, a2, l2, c2
            if ratio > best:
                best, best_k, best_t = ratio, list(k), t
        return added, best_k, best_t

    # NOTE: the measured curve has steps (the GEMM takes rows 8 at a time: 9 tokens cost far more than 8, 16
    # hardly more than 9), so one more position can look worse than none while eight more pay. The greedy
    # follows the curve's lower convex hull (an optimistic guide), then the best prefix of what it added is
    # chosen on the real curve.
    order, _, _ = plan(cost.hull, None)
    _, k, t = plan(cost, order)
    return k, t
