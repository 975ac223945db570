"""The `cost` policy's step-cost curve: t(n), seconds of one decode step that verifies n packed tokens,
measured densely for n = 1..17 (where the windows of small batches fall) and sparser beyond, cached per machine,
then corrected online from the real steps (`observe`): a forward at context 128 is not the step the engine
runs (longer contexts, sampling, commit), so the offline curve alone underprices verify tokens and batches.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

#: bumped when CostModel.measure changes (3: ascending sizes, medians of 5, non-decreasing; 4: distinct tokens)
CURVE_VERSION = 4
#: a cached curve whose t(n) at a probe size differs from a fresh timing by more than this share is measured
#: again, or rescaled where all probes are off by one factor (its t(5)/t(1) holds within this share)
STALE = 0.3
PROBE_SIZES = (1, 5)
#: the hull (cost_windows' guide) is rebuilt after this many online corrections of the curve, not after each
HULL_EVERY = 32
#: verify sizes the cost curve is measured at: every n up to 17, then sparser
COST_SIZES = tuple(range(1, 18)) + (24, 32, 48, 64)
#: a size's time is the median of this many forwards after a warm-up one, over a context of CTX tokens
REPEATS, CTX = 5, 128


def _pages(runner, n: int, ctx: int = CTX) -> list[int] | None:  # noqa: ANN001
    """A page table for a ctx + n-token forward; None when the pool cannot hold it."""
    pt: list[int] = []
    try:
        runner.kv.ensure(pt, ctx + n)
    except Exception:  # noqa: BLE001 - pool too small for this size
        runner.kv.release(pt)
        return None
    return pt


def probe_tokens(n: int, vocab: int) -> list[int]:
    """n distinct token ids spread over the vocabulary, the same for every run. NOTE: a timed forward over one
    repeated token routes every row of a mixture-of-experts target to the same experts, so a verify of n tokens
    would read k experts a layer instead of the union of n routes, and `cost` would price MoE windows far too
    cheap; a dense model's step costs the same whatever the ids."""
    return [(7919 * i + 17) % vocab for i in range(n)]


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


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

    def replace(self, points: list[tuple[int, float]]) -> None:
        """New points (a measurement merged, a rescale): the hull is recomputed at its next use."""
        self.points = points
        self.__dict__.pop("hull", None)

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
    def forward_seconds(runner, page_table: list[int], n: int, ctx: int = CTX) -> float:  # noqa: ANN001
        """One timed forward of n new tokens over a `ctx`-token context held in `page_table`."""
        ids = probe_tokens(n, runner.model.cfg.vocab_size)
        t = time.perf_counter()
        runner.forward([page_table], [ctx], [ids], [list(range(n))])
        return time.perf_counter() - t

    @classmethod
    def time_size(cls, runner, n: int, repeats: int = REPEATS, ctx: int = CTX) -> float | None:  # noqa: ANN001
        """Seconds of a forward of n new tokens over a `ctx`-token context: the median of `repeats` after a
        warm-up; None when the pool cannot hold it."""
        pt = _pages(runner, n, ctx)
        if pt is None:
            return None
        times = [cls.forward_seconds(runner, pt, n, ctx) for _ in range(repeats + 1)]  # the first run warms up
        runner.kv.release(pt)
        return _median(times[1:])

    @classmethod
    def from_times(cls, times: dict[int, float]) -> "CostModel":
        """The curve through measured times. A forward over more tokens never costs less, so a size measured
        above a larger one is lowered to it."""
        pts, low = [], float("inf")
        for n in sorted(times, reverse=True):  # running minimum from the largest size down
            low = min(low, times[n])
            pts.append((n, low))
        pts.reverse()
        return cls(pts if len(pts) > 1 else pts + [(pts[0][0] + 1, pts[0][1])])

    @classmethod
    def measure(cls, runner, sizes: tuple[int, ...] = COST_SIZES, repeats: int = REPEATS,  # noqa: ANN001
                ctx: int = CTX) -> "CostModel":
        """Every size in ascending order, up to the first the pool cannot hold. NOTE: not interleaved: a small
        forward timed right after a large one measured 1.5 ms slower than a decode step really costs (SmolLM2
        w4a8, Xeon: the large ones use AMX)."""
        times: dict[int, float] = {}
        for n in sizes:
            t = cls.time_size(runner, n, repeats, ctx)
            if t is None:
                break
            times[n] = t
        return cls.from_times(times)

    @classmethod
    def load(cls, runner, key: str, cache_dir: Path | None = None) -> tuple["CostModel", "Calibration"]:  # noqa: ANN001
        """The curve cached for model/dtype/threads on this machine, and what is left to measure. NOTE: nothing is
        timed on the way to ready but the two-point curve of a first start: the cached curve's check and a full
        measurement run as a Calibration, piece by piece while the engine idles (engine.idle_work) or between
        its steps under load (engine.step)."""
        cache_dir = cache_dir or Path.home() / ".cache" / "specserve" / "cost"
        # NOTE: the measuring method's version in the name: curves cached by an older method are not reused
        path = cache_dir / f"{key}-t{torch.get_num_threads()}-curve{CURVE_VERSION}.json"
        if path.exists():
            model = cls([tuple(p) for p in json.loads(path.read_text())])
            return model, Calibration(runner, model, path, list(PROBE_SIZES), probing=True, under_load=False)
        model = cls.measure(runner, sizes=PROBE_SIZES, repeats=2)  # a first guess until the full curve is measured
        cal = Calibration(runner, model, path, list(COST_SIZES), probing=False)
        cal.resume()
        return model, cal


@dataclass
class Calibration:
    """A curve's measurement in pieces of one forward each (`step`: while the engine idles, a request that arrives
    meanwhile waits for one forward at most; under load, between steps, in a bounded share of the engine's time),
    replacing `model`'s points size by size as they are timed, cached at `path` when done.
    probing: timing PROBE_SIZES to check a cached curve. NOTE: a curve measured while something else loaded the
    machine is wrong for as long as it is cached (too dear at one size, it verifies those windows far less often
    than they pay): probes off by > STALE, unless by a common factor, the full curve is measured again. Probes off
    by a common factor (the VM's read bandwidth moved: 27–57 GB/s within an hour on one host) rescale it: a
    re-measurement takes ~130 forwards up to 64 tokens of idle time, each delaying a request that arrives during
    it, and the online correction (`observe`) follows the served sizes anyway.
    under_load: pieces may run between steps while requests run (a first start's curve, whose two-point guess is
    all there is); the policy steps the others only while idle (CostPolicy.calibrate), so a cached curve's check
    and its re-measurement wait for idle time. NOTE: forwards timed under
    load share the cores with whatever loads them (on 2 cores, the HTTP clients): a MoE probe under a serving
    benchmark timed t(1) at 2.2× the idle figure, found the curve "stale", and merged t(6) at 3× t(5), which
    priced every larger verify at t(6): windows looked free at 8 in flight.
    """

    runner: object
    model: CostModel
    path: Path
    sizes: list[int]
    probing: bool
    times: dict[int, float] = field(default_factory=dict)
    runs: list[float] = field(default_factory=list)  # the size being timed: its forwards so far (the first warms up)
    under_load: bool = True

    def step(self, busy: bool = False) -> bool:
        """One forward of the size being timed, on pages taken and given back (nothing is held between pieces,
        while requests run); True while more is left. busy: requests hold pages, so a size the pool cannot hold
        now is tried again later (idle, the pool can never hold it: it and every larger size are dropped)."""
        if not self.sizes:
            return False
        n = self.sizes[0]
        pt = _pages(self.runner, n)
        if pt is None:
            if busy:
                return True
            self.sizes.clear()
            return self._phase_done()
        self.runs.append(CostModel.forward_seconds(self.runner, pt, n))
        self.runner.kv.release(pt)  # type: ignore[attr-defined]
        if len(self.runs) <= REPEATS:
            return True
        self.times[n], self.runs = _median(self.runs[1:]), []
        self.sizes.pop(0)
        if not self.probing:
            self._merge()
        return bool(self.sizes) or self._phase_done()

    @property
    def partial(self) -> Path:
        """Where the sizes timed so far are kept until the curve is complete."""
        return self.path.with_name(self.path.stem + "-partial.json")

    def resume(self) -> None:
        """Go on from the sizes an earlier start timed (NOTE: short-lived servers under load each measure a share of
        the curve; without this each started over and none finished)."""
        try:
            times = {int(n): float(t) for n, t in json.loads(self.partial.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return
        self.times = {n: t for n, t in times.items() if n in self.sizes}
        if self.times:
            self.sizes = [n for n in self.sizes if n not in self.times]
            self._merge()
            if not self.sizes:
                self._phase_done()

    def _merge(self) -> None:
        """The sizes timed so far replace the curve up to the largest of them; its points beyond are kept (a first
        start's two-point guess, a stale cached curve), raised by what that size timed above the curve there.
        NOTE: a first start plans on measured small windows seconds after its load begins, not after the whole
        curve (a full curve of the 1.5B/0.5B pair: ~22 s of forwards; on the guess alone `cost` priced a 4-token
        verify at 1.37x a decode step where it costs 1.13x). Raised, not flattened to the top's time: the
        increments beyond stay (a flat curve makes every longer verify free)."""
        top = max(self.times)
        lift = max(0.0, self.times[top] - self.model(top))
        beyond = {n: t + lift for n, t in self.model.points if n > top}
        self.model.replace(CostModel.from_times({**self.times, **beyond}).points)
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        self.partial.write_text(json.dumps(self.times))

    def _phase_done(self) -> bool:
        if self.probing:
            ratios = [self.times[n] / self.model(n) for n in PROBE_SIZES if n in self.times]
            if len(ratios) == len(PROBE_SIZES) and all(abs(r - 1) <= STALE for r in ratios):
                return False
            if len(ratios) == len(PROBE_SIZES) and max(ratios) <= (1 + STALE) * min(ratios):
                # the shape holds (t(5)/t(1) as cached): the host's speed moved the level
                level = math.prod(ratios) ** (1 / len(ratios))
                self.model.replace([(n, t * level) for n, t in self.model.points])
                self._save()
                return False
            self.probing, self.sizes, self.times = False, list(COST_SIZES), {}
            return True
        if self.times:
            self.model.replace(CostModel.from_times(self.times).points)
            self._save()
        return False

    def _save(self) -> None:
        """The curve cached at `path`; a partial measurement left from an earlier start is void now."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.model.points))
        self.partial.unlink(missing_ok=True)
