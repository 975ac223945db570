"""Prometheus metrics (vLLM's names under the `specserve:` prefix) and the periodic stats log line.

Speculative counters (Prometheus appends `_total`):
  specserve:spec_decode_num_drafts, …_num_draft_tokens, …_num_accepted_tokens,
  …_num_accepted_tokens_per_pos{position}, …_num_draft_tokens_by_source{source}, …_num_accepted_tokens_by_source{source}
  (source: lookup, suffix, table, learned, draft, grammar: where the drafts came from)
  mean acceptance length = 1 + rate(accepted_tokens) / rate(num_drafts)   (bonus token included)
  acceptance rate        = rate(accepted_tokens) / rate(draft_tokens)
  per-position rate      = rate(accepted_per_pos{position=i}) / rate(num_drafts)   (unconditional)
Prefix cache counters (vLLM's token counters, plus requests and evicted pages):
  specserve:prefix_cache_queries (prompt tokens looked up), …_hits (tokens served from cached pages),
  …_hit_requests (admissions that reused a page), …_evictions (cached pages dropped for room)
  hit rate = rate(prefix_cache_hits) / rate(prefix_cache_queries)
Every method is called from the engine thread only; prometheus-client objects are thread-safe for
the scrape.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from ..cache.prefix_cache import CacheStats
from ..core import Request, SpecStats

log = logging.getLogger("specserve.server")
P = "specserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no `_created` series (as vLLM): they double the scrape for nothing
        self.registry = r = registry or CollectorRegistry()
        lab = ["model_name"]
        self.labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, lab + list(extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, lab, registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, lab, buckets=buckets, registry=r)

        self.spec_drafts = counter("spec_decode_num_drafts", "Verify passes that carried at least one draft token")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position (0-based)", ("position",))
        self.spec_source_drafts = counter("spec_decode_num_draft_tokens_by_source",
                                          "Draft tokens verified, by draft source", ("source",))
        self.spec_source_accepted = counter("spec_decode_num_accepted_tokens_by_source",
                                            "Draft tokens accepted, by draft source", ("source",))
        self.requests = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.prefix_hit_requests = counter("prefix_cache_hit_requests", "Admissions that reused cached pages")
        self.prefix_evictions = counter("prefix_cache_evictions", "Cached KV pages evicted to make room")
        self._prefix_seen = CacheStats()
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of target KV pages in use (0-1)")
        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Per-token latency: gap between a request's emissions / tokens emitted", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self._seen = SpecStats()  # engine counters already exported
        self._last_emit: dict[str, float] = {}

    def _l(self, m: Any, **extra: str) -> Any:
        return m.labels(**self.labels, **extra)

    # ---- per request ----
    def on_admit(self, r: Request) -> None:
        self._l(self.prompt_tokens).inc(len(r.prompt_ids))

    def on_tokens(self, r: Request, n: int, now: float) -> None:
        if n <= 0:
            return
        self._l(self.generation_tokens).inc(n)
        last = self._last_emit.get(r.request_id)
        if last is None:
            if r.first_token_time is not None:
                self._l(self.ttft).observe(r.first_token_time - r.arrival)
        else:
            # NOTE: one speculative emission carries several tokens; observe per token, not per chunk.
            gap = (now - last) / n
            for _ in range(n):
                self._l(self.itl).observe(gap)
        self._last_emit[r.request_id] = now

    def on_finish(self, r: Request) -> None:
        self._last_emit.pop(r.request_id, None)
        self._l(self.requests, finished_reason=r.finish_reason or "unknown").inc()
        self._l(self.e2e).observe((r.finish_time or time.perf_counter()) - r.arrival)
        if r.num_preemptions:
            self._l(self.preemptions).inc(r.num_preemptions)

    # ---- per step ----
    def on_step(self, engine: Any) -> None:
        self._l(self.running).set(len(engine.scheduler.running))
        self._l(self.waiting).set(len(engine.scheduler.waiting))
        self._l(self.kv_usage).set(engine.kv.allocator.usage)
        if engine.prefix is not None:
            c, old = engine.prefix.stats, self._prefix_seen
            for m, new, was in ((self.prefix_queries, c.query_tokens, old.query_tokens),
                                (self.prefix_hits, c.hit_tokens, old.hit_tokens),
                                (self.prefix_hit_requests, c.hits, old.hits),
                                (self.prefix_evictions, c.evictions, old.evictions)):
                if new != was:
                    self._l(m).inc(new - was)
            self._prefix_seen = CacheStats(**vars(c))
        s, seen = engine.stats, self._seen
        if s.num_drafts == seen.num_drafts:
            return
        self._l(self.spec_drafts).inc(s.num_drafts - seen.num_drafts)
        self._l(self.spec_draft_tokens).inc(s.num_draft_tokens - seen.num_draft_tokens)
        self._l(self.spec_accepted).inc(s.num_accepted_tokens - seen.num_accepted_tokens)
        for i, v in enumerate(s.accepted_tokens_per_pos):  # every drafted position shows, zeros too
            old = seen.accepted_tokens_per_pos[i] if i < len(seen.accepted_tokens_per_pos) else 0
            self._l(self.spec_per_pos, position=str(i)).inc(v - old)
        for src, (drafted, acc) in s.by_source.items():
            was = seen.by_source.get(src, [0, 0])
            self._l(self.spec_source_drafts, source=src).inc(drafted - was[0])
            self._l(self.spec_source_accepted, source=src).inc(acc - was[1])
        self._seen = s.copy()


class StatsLogger:
    """Every `interval` seconds with activity: throughput, queue, KV use, and the speculative figures
    of that interval (mean acceptance length, acceptance rate, per-position acceptance)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._t = time.monotonic()
        self._stats = SpecStats()
        self._tokens = 0
        self.tokens = 0  # generated tokens so far (the engine thread adds to it)

    def maybe_log(self, engine: Any) -> str | None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._t < self.interval:
            return None
        dt, gen = now - self._t, self.tokens - self._tokens
        s, old = engine.stats, self._stats
        self._t, self._tokens = now, self.tokens
        self._stats = s.copy()
        if gen == 0 and not engine.has_unfinished():
            return None
        line = (f"Engine: {len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting, "
                f"KV usage {100 * engine.kv.allocator.usage:.1f}%, generation {gen / dt:.1f} tok/s")
        drafts = s.num_drafts - old.num_drafts
        if engine.drafter is not None and drafts > 0:
            acc, drafted = s.num_accepted_tokens - old.num_accepted_tokens, s.num_draft_tokens - old.num_draft_tokens
            per_pos = [(v - (old.accepted_tokens_per_pos[i] if i < len(old.accepted_tokens_per_pos) else 0)) / drafts
                       for i, v in enumerate(s.accepted_tokens_per_pos)]
            line += (f"; Spec decode ({engine.config.speculative_algorithm}): mean acceptance length "
                     f"{1 + acc / drafts:.2f}, accepted {acc}/{drafted} draft tokens ({100 * acc / max(drafted, 1):.1f}%), "
                     f"per-position acceptance {', '.join(f'{p:.3f}' for p in per_pos)}")
        log.info(line)
        return line
