"""Acceptance as the window policies estimate it: accepted / tested draft positions per draft source, per request
and pooled over requests, and the per-position acceptance curves windows are cut on."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core import DraftPlan, Proposal, Request

#: weight, in tested positions, of the source's acceptance over all requests in a request's own estimate
POOLED_WEIGHT = 4.0


@dataclass
class AcceptTrials:
    """Accepted / tested draft positions per draft source (a rejection ends a chain), for each running request
    (keyed by request id; `release` frees a finished request's) and pooled over every request. The window
    policy owns it; the commit stage records into it."""

    per_request: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    pooled: dict[str, list[int]] = field(default_factory=dict)

    def record(self, request_id: str, source: str, accepted: int, tested: int) -> None:
        """A request's verify this step, credited to the source that drafted for it."""
        for st in (self.per_request.setdefault(request_id, {}).setdefault(source, [0, 0]),
                   self.pooled.setdefault(source, [0, 0])):
            st[0], st[1] = st[0] + accepted, st[1] + tested

    def release(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)


def acceptance_estimate(request_id: str, source: str, trials: AcceptTrials | None = None,
                        optimism: float = 0.0) -> float:
    """Per-position acceptance of `source` drafting for a request: accepted drafts / positions tested
    (`trials`; Beta(1, 1) without them), shrunk towards that source's rate over all requests. NOTE: a new
    request is judged by what its source achieved so far, not by a blind 0.5: prompt lookups are accepted
    ~0.8 of the time here, and a 0.5 prior cut the first windows of every request. Per source, so HYBRID's
    lookups are not judged by its learned drafter's record.
    `optimism` z: plus z standard deviations of the source's pooled rate (its Beta posterior), an upper
    confidence bound that shrinks as the source is tested (`cost_windows`' planning)."""
    own = trials.per_request.get(request_id, {}) if trials else {}
    accepted, tested = own.get(source, (0, 0))
    prior, bonus = pooled_acceptance(trials, source, optimism)
    return min((accepted + POOLED_WEIGHT * prior) / (tested + POOLED_WEIGHT) + bonus, 0.999)


def pooled_acceptance(trials: AcceptTrials | None, source: str, optimism: float = 0.0) -> tuple[float, float]:
    """A source's acceptance over all requests (the mean of its Beta(1, 1) posterior), and `optimism` standard
    deviations of that posterior."""
    pa, pt = trials.pooled.get(source, (0, 0)) if trials else (0, 0)
    prior = (pa + 1) / (pt + 2)
    return prior, optimism * (prior * (1 - prior) / (pt + 3)) ** 0.5


def accept_curves(reqs: list[Request], plan: DraftPlan, proposal: Proposal,
                  trials: AcceptTrials | None = None) -> list[list[float]]:
    """Per request, P(draft positions 1..i all accepted) for i = 1..min(drafted, window): the
    cumulative product of the drafter's per-token confidence (a NaN entry: the request's acceptance
    estimate), or α^i from the request's acceptance so far (of its source in `plan`; windows: plan.windows).
    For a tree entry i is P(node i accepted) = the product over its path, which is non-increasing in the tree's best-first order, so cutting a prefix keeps
    the most likely nodes."""
    out = []
    for b, r in enumerate(reqs):
        n = min(len(proposal.tokens[b]), plan.windows[b])
        c = proposal.confidence[b] if proposal.confidence is not None else None
        par = proposal.parents[b] if proposal.parents is not None else None
        if c is not None and len(c) >= n:
            # NOTE: plain floats (a window is a few tokens: torch ops per step cost more than the arithmetic);
            # the same double products as a cumprod in float64
            xs = c[:n].tolist()
            if any(map(math.isnan, xs)):  # NaN: that token's source has no score of its own
                fill = acceptance_estimate(r.request_id, plan.sources[b], trials)
                xs = [fill if math.isnan(x) else x for x in xs]
            v: list[float] = []
            for i, x in enumerate(xs):
                prev = (v[par[i]] if par[i] >= 0 else 1.0) if par is not None else (v[-1] if v else 1.0)
                v.append(min(max(x, 0.0), 1.0) * prev)
            out.append(v)
        else:
            a = acceptance_estimate(r.request_id, plan.sources[b], trials)
            out.append([a ** (i + 1) for i in range(n)])
    return out


def confidence_windows(curves: list[list[float]], threshold: float) -> list[int]:
    """The longest prefix whose cumulative acceptance probability stays ≥ threshold."""
    return [sum(1 for p in c if p >= threshold) for c in curves]  # curves are non-increasing
