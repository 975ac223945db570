"""The `cost` policy's empirical guard: per batch bucket and draft source, is drafting measured faster than
plain decoding? (cost.py plans the windows; this only catches what its curves misestimate.)"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Arm:
    """Decode steps of one DraftGate arm: decayed sums of seconds and emitted tokens per step, for seconds
    per token (their ratio) and its standard error. NOTE: not a mean of per-step ratios: a drafting step
    emits 1..k+1 tokens, and the mean of seconds/tokens over such steps overstates the cost per token."""

    n: int = 0
    w: float = 0.0  # Σ weights
    w2: float = 0.0  # Σ weights²
    s: float = 0.0  # Σ w·seconds
    t: float = 0.0  # Σ w·tokens
    ss: float = 0.0  # Σ w·seconds²
    st: float = 0.0  # Σ w·seconds·tokens
    tt: float = 0.0  # Σ w·tokens²

    def add(self, seconds: float, tokens: int, decay: float) -> None:
        d = decay if self.n else 0.0
        self.w, self.w2 = d * self.w + 1, d * d * self.w2 + 1
        self.s, self.t = d * self.s + seconds, d * self.t + tokens
        self.ss, self.st, self.tt = d * self.ss + seconds**2, d * self.st + seconds * tokens, d * self.tt + tokens**2
        self.n += 1

    @property
    def per_token(self) -> float:
        return self.s / max(self.t, 1e-12)

    @property
    def stderr(self) -> float:
        """Of per_token (the ratio estimator, linearised), over the effective number of steps w²/w2."""
        if self.n < 2:
            return float("inf")
        r = self.per_token
        resid = max(0.0, self.ss - 2 * r * self.st + r * r * self.tt) / self.w  # mean (s − r·t)²
        mean_t = self.t / self.w
        return (resid / (self.w * self.w / self.w2)) ** 0.5 / mean_t

    def loses_to(self, plain: "Arm", z: float) -> bool:
        """Slower per token than `plain` by more than z standard errors of the difference."""
        return self.per_token - plain.per_token > z * (self.stderr**2 + plain.stderr**2) ** 0.5


@dataclass
class DraftGate:
    """Empirical guard of the `cost` policy: per batch-size bucket (powers of two) and per draft source
    (a drafter's `sources`: HYBRID has a free prompt lookup and a learned drafter that costs a forward),
    seconds per emitted token (Arm) over decode steps whose costliest drafting source was that one, and over
    steps that did not draft. Once both are measured, a source may draft unless it measures slower than plain
    decoding by more than `z` standard errors (NOTE: steps are noisy, a drafting step emits 1..k+1 tokens, and a
    source's worth moves from request to request: a gate that closed on the bare comparison shut drafts that
    paid; docs/benchmarks.md, "The cost policy's constants");
    its closed arm is re-tried after `explore` steps of that bucket, then at
    doubling intervals while it keeps losing (up to `max_explore`), so a change of workload or context
    length is noticed at a bounded cost. An open source has plain decoding re-measured every `explore` steps, or
    at doubling intervals while it is faster than plain by more than `margin`. The cost model still chooses the
    windows whenever drafting is allowed; the gate only catches what the model misestimates (a drafter whose
    gain and cost nearly cancel), bounding the loss to the exploration steps. Gating per source keeps the free
    lookups on while a learned drafter that does not pay is off."""

    warmup: int = 3
    explore: int = 20
    max_explore: int = 320
    decay: float = 0.9
    z: float = 2.0
    margin: float = 0.1
    stats: dict = field(default_factory=dict)  # bucket → {"plain": Arm, source: Arm, "wait", "every"}

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def _bucket(self, batch: int) -> dict:
        return self.stats.setdefault(self.bucket(batch), {"plain": Arm(), "wait": {}, "every": {}})

    def allow(self, batch: int, source: str = "draft") -> str:
        """"open" (the cost model plans the windows), "closed" (no drafts from this source), or "explore"
        (the cost model plans the windows, but at least one position is drafted whatever it says: the source's
        cost and acceptance get measured, e.g. while warming up, or when a one-off slow step once made it look
        too dear). NOTE: not the full window: a batch-16 warm-up of HYBRID's 7-token lookups verified ~128
        tokens a step, each such step costing ~4 plain ones."""
        st = self._bucket(batch)
        arm = st.setdefault(source, Arm())
        measured = arm.n >= self.warmup
        wait = st["wait"]  # source → [steps since its last exploration, the current interval]
        if not measured:
            below = self._loses_below(batch, source)
            if below is None:  # measure each arm first
                return "explore"
            wait.setdefault(source, [0, below])
        if st["plain"].n < self.warmup:
            return "closed"
        if measured and not arm.loses_to(st["plain"], self.z):
            wait[source] = [0, self.explore]
            return self._remeasure_plain(st, source, arm)
        # NOTE: a closed source is explored after `explore` steps, then twice as long each time it still loses
        # (up to max_explore): exploring a learned drafter that does not pay costs several decode steps (its
        # forward and catch-up; measured ~4x a step for the shipped DSpark on SmolLM2 w4a8)
        since, interval = wait.setdefault(source, [0, self.explore])
        if since + 1 >= interval:
            wait[source] = [0, min(2 * interval, self.max_explore)]
            return "explore"
        wait[source][0] = since + 1
        return "closed"

    def _remeasure_plain(self, st: dict, source: str, arm: Arm) -> str:
        """An open source: "closed" on the step that measures plain decoding again, else "open". Plain decoding is
        re-measured after `explore` steps; after each re-measurement that finds the source faster by more than
        `margin`, the interval doubles (up to `max_explore`), and it is back to `explore` once the margin is gone.
        NOTE: each re-measurement is a step that emits one token where the source emits ~τ; where the two arms
        are close it stays every `explore` steps."""
        left, interval = st["every"].get(source, (self.explore, self.explore))
        if left > 1:
            st["every"][source] = (left - 1, interval)
            return "open"
        clear = arm.per_token < (1 - self.margin) * st["plain"].per_token
        interval = min(2 * interval, self.max_explore) if clear else self.explore
        st["every"][source] = (interval, interval)
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
            if st and st["plain"].n >= self.warmup and source in st and st[source].n >= self.warmup:
                loses = st[source].loses_to(st["plain"], self.z)
                return st["wait"].get(source, [0, self.explore])[1] if loses else None
            b //= 2
        return None

    def observe(self, batch: int, source: str | None, seconds: float, tokens: int) -> None:
        """One decode step: `source` = the costliest source that drafted, None = nobody drafted."""
        self._bucket(batch).setdefault(source or "plain", Arm()).add(seconds, max(tokens, 1), self.decay)
