"""The `cost` window policy's measurements: the verify cost curve, what it misses, and a guard.

CostModel: t(n), seconds of one target forward over n packed tokens, measured densely for
n = 1..17 (where the windows of small batches fall) and sparser beyond, cached per machine.
`cost_windows` chooses per-request windows k_b that maximise expected emitted tokens per second,

    maximise  Σ_b E_b(k_b) / t(Σ_b (k_b + 1)),    E_b(k) = (1 − α_b^{k+1}) / (1 − α_b)

where α_b is request b's per-position acceptance so far (Beta(1, 1) prior). Greedy: start every
window at 0 and keep adding the draft position with the largest marginal gain α_b^{k_b+1} while the
ratio improves. A window of 0 is plain decoding for that request, so the batch is never planned
slower than plain decoding. Model drafters (STANDALONE, SYNTHETIC) add their own measured forward
time per draft position; what the curves miss per drafting request is learned online from measured
steps (StepOverhead), and a last empirical guard (DraftGate) compares measured seconds per token of
steps with and without drafting, so a drafter whose gain and cost nearly cancel is switched off
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
#: verify sizes the cost curve is measured at: every n up to 17, then sparser
COST_SIZES = tuple(range(1, 18)) + (24, 32, 48, 64)


@dataclass
class CostModel:
    """t(n): seconds of one target forward over n packed tokens, piecewise linear between points."""

    points: list[tuple[int, float]]

    def __call__(self, n: int) -> float:
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) / (n1 - n0) * (n - n1)

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
            return cls([tuple(p) for p in json.loads(path.read_text())])
        model = cls.measure(runner)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.points))
        return model


def acceptance_estimate(r: Request) -> float:
    """Per-position acceptance of the source drafting for r this step: accepted drafts / positions tested
    (a rejection ends a chain), Beta(1, 1) prior. Per source, so HYBRID's lookups are not judged by its
    learned drafter's record (or the reverse)."""
    accepted, tested = r.source_trials.get(r.draft_source, (0, 0))
    return (accepted + 1) / (tested + 2)


@dataclass
class StepOverhead:
    """What the measured curves miss, learned from real decode steps (EMA): a per-step residual of
    steps where nobody drafted, and seconds per drafting request (draft lookup or forward, per-request
    acceptance, ragged attention) from steps where some did — per draft source, since HYBRID's free
    lookups must not be charged its learned drafter's forward (a step counts for its costliest source)."""

    base: float = 0.0
    per_request: dict[str, float] = field(default_factory=dict)
    decay: float = 0.9

    def cost(self, reqs: list[Request]) -> list[float]:
        """Seconds each request would add by drafting this step (its source's estimate, never below 0)."""
        return [max(0.0, self.per_request.get(r.draft_source, 0.0)) for r in reqs]

    def observe(self, elapsed: float, predicted: float, active: int, source: str | None = None) -> None:
        residual = elapsed - predicted
        if active == 0 or source is None:
            self.base = self.decay * self.base + (1 - self.decay) * residual
        else:
            # NOTE: samples below zero are kept (only the estimate's use is clamped): clamping each sample
            # biased the mean upwards (measured: 2.1 ms for NGRAM where steps showed 0.9 ms), which shut off
            # lookups that paid
            per = (residual - self.base) / active
            self.per_request[source] = self.decay * self.per_request.get(source, per) + (1 - self.decay) * per


@dataclass
class DraftGate:
    """Empirical guard of the `cost` policy: per batch-size bucket (powers of two) and per draft source
    (a drafter's `sources`: HYBRID has a free prompt lookup and a learned drafter that costs a forward),
    an EMA of seconds per emitted token over decode steps whose costliest drafting source was that one,
    and over steps that did not draft. Once both are measured, a source may draft only while it measures
    faster than plain decoding; its closed arm is re-tried after `explore` steps of that bucket, then at
    doubling intervals while it keeps losing (up to `max_explore`), so a change of workload or context
    length is noticed at a bounded cost. The cost model still chooses the windows whenever
    drafting is allowed; the gate only catches what the model misestimates (a drafter whose gain and cost
    nearly cancel), bounding the loss to the exploration steps. Gating per source keeps the free lookups
    on while a learned drafter that does not pay is off."""

    warmup: int = 3
    explore: int = 20
    max_explore: int = 320
    decay: float = 0.8
    stats: dict = field(default_factory=dict)  # bucket → {"plain": [n, ema], source: [n, ema], "steps", "wait"}

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def _bucket(self, batch: int) -> dict:
        return self.stats.setdefault(self.bucket(batch), {"plain": [0, 0.0], "steps": {}, "wait": {}})

    def allow(self, batch: int, source: str = "draft") -> str:
        """"open" (the cost model plans the windows), "closed" (no drafts from this source), or "explore"
        (the cost model plans the windows, but at least one position is drafted whatever it says: the source's
        cost and acceptance get measured, e.g. while warming up, or when a one-off slow step once made it look
        too dear). NOTE: not the full window: a batch-16 warm-up of HYBRID's 7-token lookups verified ~128
        tokens a step, each such step costing ~4 plain ones."""
        st = self._bucket(batch)
        arm = st.setdefault(source, [0, 0.0])
        step = st["steps"][source] = st["steps"].get(source, 0) + 1
        measured = arm[0] >= self.warmup
        wait = st["wait"]  # source → [steps since its last exploration, the current interval]
        if not measured:
            below = self._loses_below(batch, source)
            if below is None:  # measure each arm first
                return "explore"
            wait.setdefault(source, [0, below])
        if st["plain"][0] < self.warmup:
            return "closed"
        if measured and arm[1] <= st["plain"][1]:
            wait[source] = [0, self.explore]
            return "closed" if step % self.explore == 0 else "open"
        # NOTE: a closed source is explored after `explore` steps, then twice as long each time it still loses
        # (up to max_explore): exploring a learned drafter that does not pay costs several decode steps (its
        # forward and catch-up; measured ~4x a step for the shipped DSpark on SmolLM2 w4a8)
        since, interval = wait.setdefault(source, [0, self.explore])
        if since + 1 >= interval:
            wait[source] = [0, min(2 * interval, self.max_explore)]
            return "explore"
        wait[source][0] = since + 1
        return "closed"

    def _loses_below(self, batch: int, source: str) -> int | None:
        """If `source` measured slower than plain decoding in the largest smaller bucket where both were
        measured: that bucket's exploration interval for it, else None. NOTE: drafting pays less as the batch
        grows (verifying more tokens costs more once the GEMMs are compute-bound), so such a source starts
        closed here, explored no more often than below, instead of warming up (each batch-8 exploration of
        the shipped DSpark cost ~3.5 plain steps: its catch-up over every position since the last one)."""
        b = self.bucket(batch) // 2
        while b >= 1:
            st = self.stats.get(b)
            if st and st["plain"][0] >= self.warmup and st.get(source, [0])[0] >= self.warmup:
                return st["wait"].get(source, [0, self.explore])[1] if st[source][1] > st["plain"][1] else None
            b //= 2
        return None

    def observe(self, batch: int, source: str | None, seconds: float, tokens: int) -> None:
        """One decode step: `source` = the costliest source that drafted, None = nobody drafted."""
        arm = self._bucket(batch).setdefault(source or "plain", [0, 0.0])
        x = seconds / max(tokens, 1)
        arm[1] = x if arm[0] == 0 else self.decay * arm[1] + (1 - self.decay) * x
        arm[0] += 1


def step_time(cost: CostModel, draft_step: CostModel | None, n_tokens: int, active: int, longest: int) -> float:
    """The curves' time of one step: a verify forward over `n_tokens` packed tokens, plus (model
    drafters) one draft forward over the `active` drafting requests per position of the longest window."""
    return cost(n_tokens) + (draft_step(active) * longest if draft_step is not None and longest else 0.0)


def windows_time(cost: CostModel, draft_step: CostModel | None, windows: list[int]) -> float:
    """step_time of a step verifying these windows (each request also verifies its bonus token)."""
    return step_time(cost, draft_step, sum(windows) + len(windows), sum(1 for w in windows if w), max(windows, default=0))


def cost_windows(reqs: list[Request], limits: list[int], cost: CostModel, draft_step: CostModel | None = None,
                 per_request: float | list[float] = 0.0, gains: list[list[float]] | None = None, base: float = 0.0
                 ) -> tuple[list[int], float]:
    """Greedy maximisation of expected tokens per second (module docstring). With `draft_step`
    (a model drafter's forward time over m tokens), a step also pays draft_step(#drafting) for each
    draft position up to the longest window, since model drafters draft position by position;
    `per_request` (StepOverhead: one value, or one per request) is charged for every drafting request.
    `gains[b][j]`: P(positions 1..j+1 accepted) (from `accept_curves`); default α_b^{j+1}.
    `base` (StepOverhead.base): what every step costs beyond the curves, drafting or not. NOTE: it belongs in
    every ratio: without it, at batch 8 (curve 9.9 ms, real step 15.8: the curve is one request at context
    128) extra verify tokens looked 1.6x dearer than they are and lookups that paid were never planned.
    Returns the windows and the curves' predicted step time for them (without `per_request` and `base`)."""
    alphas = [min(acceptance_estimate(r), 0.999) for r in reqs]
    over = per_request if isinstance(per_request, list) else [per_request] * len(reqs)
    base = max(0.0, base)
    guide = cost.hull

    def gain(b: int, j: int) -> float:
        return gains[b][j] if gains is not None else alphas[b] ** (j + 1)

    def plan(curve: CostModel, order: list[int] | None) -> tuple[list[int], list[int], float]:
        """Add draft positions one at a time: along `order`, or else greedily while the ratio improves.
        Returns (the positions added in order, the windows of the best prefix, its step time)."""
        k = [0] * len(reqs)
        tokens, n, active, longest, charged = float(len(reqs)), len(reqs), 0, 0, 0.0  # every request emits 1
        best_t = step_time(curve, draft_step, n, 0, 0)
        best, best_k = tokens / (best_t + base), list(k)
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
            a2, l2, c2 = active + (k[b] == 0), max(longest, k[b] + 1), charged + (over[b] if k[b] == 0 else 0.0)
            t = step_time(curve, draft_step, n + 1, a2, l2)
            ratio = (tokens + g) / (t + base + c2)
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
    order, _, _ = plan(guide, None)
    _, k, t = plan(cost, order)
    return k, t
