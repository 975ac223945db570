"""The `cost` window policy's measurements: the verify cost curve, the draft cost, and a guard.

CostModel: t(n), seconds of one decode step that verifies n packed tokens, measured densely for
n = 1..17 (where the windows of small batches fall) and sparser beyond, cached per machine, then
corrected online from the real steps (`observe`): a forward at context 128 is not the step the engine
runs (longer contexts, sampling, commit; measured here ~0.43 ms per extra verify token where the offline
curve said ~0.3, and 15.8 ms at batch 8 where it said 9.9).
`cost_windows` chooses per-request windows k_b that maximise expected emitted tokens per second,

    maximise  Σ_b E_b(k_b) / t(Σ_b (k_b + 1)),    E_b(k) = (1 − α_b^{k+1}) / (1 − α_b)

where α_b is request b's per-position acceptance so far (Beta(1, 1) prior). Greedy: start every
window at 0 and keep adding the draft position with the largest marginal gain α_b^{k_b+1} while the
ratio improves. A window of 0 is plain decoding for that request, so the batch is never planned
slower than plain decoding. Drafting costs what DraftCost measured per drafting request of each source
(the draft stage is timed on its own), plus, for model drafters (STANDALONE, SYNTHETIC), their measured
forward time per draft position; a last empirical guard (DraftGate, gate.py) compares measured seconds per
token of steps with and without drafting, so a drafter whose gain and cost nearly cancel is switched off
where it measures slower.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ..core import Request

#: bumped when CostModel.measure changes (3: ascending sizes, medians of 5, non-decreasing)
CURVE_VERSION = 3
#: a cached curve whose t(n) at a probe size differs from a fresh timing by more than this share is measured again
STALE = 0.3
PROBE_SIZES = (1, 5)
#: the hull (cost_windows' guide) is rebuilt after this many online corrections of the curve, not after each
HULL_EVERY = 32
#: verify sizes the cost curve is measured at: every n up to 17, then sparser
COST_SIZES = tuple(range(1, 18)) + (24, 32, 48, 64)


@dataclass
class CostModel:
    """t(n): seconds of one target forward over n packed tokens, piecewise linear between points."""

    points: list[tuple[int, float]]
    _observed: int = field(default=0, repr=False, compare=False)  # online corrections since the hull was built

    def __call__(self, n: int) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) / (n1 - n0) * (n - n1)

    def observe(self, n: int, seconds: float, rate: float = 0.05) -> None:
        """Move the curve towards a real step's time at n tokens (the two points around n, by their share of
        the interpolation); n beyond the last point teaches nothing."""
        pts = self.points
        for i, (n1, t1) in enumerate(pts):
            if n <= n1:
                if n == n1 or i == 0:
                    shares = [(i, 1.0)]
                else:
                    n0 = pts[i - 1][0]
                    shares = [(i - 1, (n1 - n) / (n1 - n0)), (i, (n - n0) / (n1 - n0))]
                # NOTE: a step's time has outliers (a stall, a page fault): each pulls the curve by at most 20%
                # of its value, so the curve tracks the typical step, not the mean of a heavy tail
                t = self(n)
                err = min(max(seconds - t, -0.2 * t), 0.2 * t)
                for j, w in shares:
                    pts[j] = (pts[j][0], pts[j][1] + rate * w * err)
                self._observed += 1
                if self._observed >= HULL_EVERY:  # NOTE: a guide a few steps stale is fine; one per step is work
                    self._observed = 0
                    self.__dict__.pop("hull", None)  # recomputed at its next use
                return

    @cached_property
    def hull(self) -> "CostModel":
        """The lower convex hull of the points: over a step of the curve, the cost per added token averaged
        across the step (cost_windows' guide; computed once per curve, not per decode step)."""
        h: list[tuple[int, float]] = []
        for x, y in self.points:
            # drop the last point while it lies on or above the chord from the one before it to (x, y)
            while len(h) >= 2 and (h[-1][1] - h[-2][1]) * (x - h[-2][0]) >= (y - h[-2][1]) * (h[-1][0] - h[-2][0]):
                h.pop()
            h.append((x, y))
        return CostModel(h)

    @staticmethod
    def measure(runner, sizes: tuple[int, ...] = COST_SIZES, repeats: int = 5, ctx: int = 128) -> "CostModel":  # noqa: ANN001
        """Time forwards of n new tokens over a `ctx`-token context: the median of `repeats` after a warm-up,
        size by size in ascending order. NOTE: not interleaved: a small forward timed right after a large one
        measured 1.5 ms slower than a decode step really costs (SmolLM2 w4a8, Xeon: the large ones use AMX).
        A forward over more tokens never costs less, so a size measured above a larger one is lowered to it."""
        kv = runner.kv
        med: dict[int, float] = {}
        for n in sizes:
            pt: list[int] = []
            try:
                kv.ensure(pt, ctx + n)
            except Exception:  # noqa: BLE001 - pool too small for this size: stop measuring
                kv.release(pt)
                break
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                t = time.perf_counter()
                runner.forward([pt], [ctx], [[0] * n], [list(range(n))])
                times.append(time.perf_counter() - t)
            kv.release(pt)
            med[n] = sorted(times[1:])[len(times[1:]) // 2]
        pts, low = [], float("inf")
        for n in sorted(med, reverse=True):  # running minimum from the largest size down
            low = min(low, med[n])
            pts.append((n, low))
        pts.reverse()
        return CostModel(pts if len(pts) > 1 else pts + [(pts[0][0] + 1, pts[0][1])])

    @classmethod
    def cached(cls, runner, key: str, cache_dir: Path | None = None) -> "CostModel":  # noqa: ANN001
        """Measured once per model/dtype/threads on this machine and cached as JSON."""
        cache_dir = cache_dir or Path.home() / ".cache" / "specserve" / "cost"
        # NOTE: the measuring method's version in the name: curves cached by an older method are not reused
        path = cache_dir / f"{key}-t{torch.get_num_threads()}-curve{CURVE_VERSION}.json"
        if path.exists():
            cached = cls([tuple(p) for p in json.loads(path.read_text())])
            # NOTE: a curve measured while something else loaded the machine (or before the VM changed speed)
            # is wrong for as long as it is cached: one measured at 4x the real step time made `cost` draft
            # nothing; another had the right t(1) but t(5) 1.6x too dear, and verified 4 drafts far less often
            # than they paid. A decode step and a batch-1 verify of 4 drafts are timed at every start (~70 ms);
            # either off by > STALE, the curve is re-measured.
            now = cls.measure(runner, sizes=PROBE_SIZES)
            if all(abs(now(n) - cached(n)) <= STALE * cached(n) for n in PROBE_SIZES):
                return cached
        model = cls.measure(runner)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.points))
        return model


#: weight, in tested positions, of the source's acceptance over all requests in a request's own estimate
POOLED_WEIGHT = 4.0


@dataclass
class AcceptTrials:
    """Accepted / tested draft positions per draft source (a rejection ends a chain), for each running request
    (keyed by request id; `release` frees a finished request's) and pooled over every request. The window
    policy owns it; the commit stage records into it."""

    per_request: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    pooled: dict[str, list[int]] = field(default_factory=dict)

    def record(self, r: Request, accepted: int, tested: int) -> None:
        """r's verify this step, credited to the source that drafted for it (r.draft_source)."""
        for st in (self.per_request.setdefault(r.request_id, {}).setdefault(r.draft_source, [0, 0]),
                   self.pooled.setdefault(r.draft_source, [0, 0])):
            st[0], st[1] = st[0] + accepted, st[1] + tested

    def release(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)


def acceptance_estimate(r: Request, trials: AcceptTrials | None = None, optimism: float = 0.0) -> float:
    """Per-position acceptance of the source drafting for r this step: accepted drafts / positions tested
    (`trials`; Beta(1, 1) without them), shrunk towards that source's rate over all requests. NOTE: a new
    request is judged by what its source achieved so far, not by a blind 0.5: prompt lookups are accepted
    ~0.8 of the time here, and a 0.5 prior cut the first windows of every request. Per source, so HYBRID's
    lookups are not judged by its learned drafter's record.
    `optimism` z: plus z standard deviations of the source's pooled rate (its Beta posterior), an upper
    confidence bound that shrinks as the source is tested (`cost_windows`' planning)."""
    own = trials.per_request.get(r.request_id, {}) if trials else {}
    accepted, tested = own.get(r.draft_source, (0, 0))
    prior, bonus = pooled_acceptance(trials, r.draft_source, optimism)
    return min((accepted + POOLED_WEIGHT * prior) / (tested + POOLED_WEIGHT) + bonus, 0.999)


def pooled_acceptance(trials: AcceptTrials | None, source: str, optimism: float = 0.0) -> tuple[float, float]:
    """A source's acceptance over all requests (the mean of its Beta(1, 1) posterior), and `optimism` standard
    deviations of that posterior."""
    pa, pt = trials.pooled.get(source, (0, 0)) if trials else (0, 0)
    prior = (pa + 1) / (pt + 2)
    return prior, optimism * (prior * (1 - prior) / (pt + 3)) ** 0.5


@dataclass
class DraftCost:
    """Seconds per drafting request of each draft source, from the drafter's propose, timed on its own (EMA):
    a lookup, a table walk, or a learned drafter's forward and catch-up. Model drafters that draft position by
    position have their forward curve besides (cost_windows' `draft_step`): what it misses is learned here.
    Per source, since HYBRID's free lookups must not be charged its learned drafter's forward (a step counts
    for its costliest source)."""

    per_request: dict[str, float] = field(default_factory=dict)
    decay: float = 0.9

    def cost(self, reqs: list[Request]) -> list[float]:
        """Seconds each request would add by drafting this step (its source's estimate, never below 0)."""
        return [max(0.0, self.per_request.get(r.draft_source, 0.0)) for r in reqs]

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
                 trials: AcceptTrials | None = None, optimism: float = 0.0) -> tuple[list[int], float]:
    """Greedy maximisation of expected tokens per second (module docstring; exact for one request). With `draft_step`
    (a model drafter's forward time over m tokens), a step also pays draft_step(#drafting) for each
    draft position up to the longest window, since model drafters draft position by position;
    `per_request` (DraftCost: one value, or one per request) is charged for every drafting request.
    `gains[b][j]`: P(positions 1..j+1 accepted) (from `accept_curves`); default α_b^{j+1}, α_b from
    acceptance_estimate from `trials` (raised by `optimism` standard deviations).
    Returns the windows and the curves' predicted step time for them (without `per_request`)."""
    alphas = [acceptance_estimate(r, trials, optimism) for r in reqs] if gains is None else []
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
