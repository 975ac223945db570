"""Prefix caching in the engine: where requests meet the target pool's `PrefixCache` (cache/prefix_cache.py).

  admit(req)    a request scheduled with no KV (new, or preempted and back) starts past its longest
                cached prefix of whole pages: the target's hit, cut to what the drafter can start from
                too (`Drafter.cached_prefix`), and never the whole prompt (the last prompt token is
                always computed: its logits give the first output token); a request still collecting
                prompt logprobs starts from no cached prefix (the cache holds KV, not the logits they need)
  admitted(req, hit)  the admission stuck (its first chunk got pages): counted once per request, at its
                first admission (a retry after `undo` or a preempted request's return is not a new query)
  insert(req)   its committed full pages enter the cache: after each prefill chunk (so requests that
                share a prompt with a running one hit it) and when it lets go of its pages (so a
                conversation's next turn hits its answer, and a preempted request its own work)
  use_disk(store, fp)  the disk tier (--prefix-cache-dir): the target pool's cache, and the drafter's pool's if
                it caches pages, also keep their pages as files (cache/disk_tier.py) and read them back at admission
Hybrid (recurrent-state) targets do not cache: their state at a page boundary is not kept.
"""
from __future__ import annotations

from ..cache.disk_tier import DiskTier
from ..cache.fingerprint import Fingerprint, draft_fingerprint
from ..cache.kv_pool import KVPool
from ..cache.page_store import PageStore
from ..cache.prefix_cache import CacheStats, PrefixCache, extend_page_keys
from ..core import Request
from ..drafters.base import Drafter


class PrefixCaching:
    def __init__(self, kv: KVPool, drafter: Drafter | None) -> None:
        self.cache: PrefixCache = kv.prefix_cache or kv.enable_prefix_cache()
        self.kv, self.page_size, self.drafter = kv, kv.page_size, drafter
        self.store: PageStore | None = None
        if drafter is not None:
            drafter.use_prefix_cache()

    def use_disk(self, store: PageStore, fp: Fingerprint) -> None:
        """Keep cached pages in `store` too: the target pool's under `fp`, a draft pool's under its own."""
        self.store = store
        self.cache.disk = DiskTier(store, fp, self.kv)
        pool = self.drafter.prefix_pool() if self.drafter is not None else None
        if pool is not None and pool[0].prefix_cache is not None:
            kv, net = pool
            kv.prefix_cache.disk = DiskTier(store, draft_fingerprint(fp, self.drafter.label, net, kv), kv)

    def close(self) -> None:
        """Write the pages still queued for the disk tier (a restart finds them)."""
        if self.store is not None:
            self.store.close()

    @property
    def stats(self) -> CacheStats:
        return self.cache.stats

    def admit(self, req: Request) -> int:
        """Take the cached pages of req's longest cached prefix into its page table (committed); returns
        how many tokens that skips. NOTE: req holds no KV yet (page table empty, committed_len 0)."""
        if req.needs_prompt_logits:  # not looked up (as vLLM): its inserts still serve others
            return 0
        ps = self.page_size
        most = (req.prefill_target - 1) // ps
        keys = extend_page_keys(req.all_ids, req.page_keys, ps, most)[:most]
        n = self.cache.match(keys)
        if n and self.drafter is not None:
            n = min(n, self.drafter.cached_prefix(req, keys[:n]))
        if n:
            req.page_table.extend(self.cache.acquire(keys[:n]))
            req.committed_len = req.num_cached_pages = n
            req.committed_len *= ps
            if self.drafter is not None:
                self.drafter.attach_prefix(req, keys[:n])
        return n * ps

    def admitted(self, req: Request, hit: int) -> None:
        """Count req's lookup (`hit` tokens served from the cache) if this is its first admission.
        NOTE: per request, as vLLM counts: `cached_tokens` is None until the first admission sticks."""
        if req.cached_tokens is not None:
            return
        req.cached_tokens = hit
        if req.needs_prompt_logits:  # `admit` made no lookup: not a query
            return
        s = self.cache.stats
        s.queries += 1
        s.query_tokens += req.prefill_target
        s.hits += hit > 0
        s.hit_tokens += hit

    def undo(self, req: Request, kv: KVPool) -> None:
        """Give back what `admit` took (the request goes on waiting: it found no pages for its chunk)."""
        kv.release(req.page_table)
        req.committed_len = req.num_cached_pages = 0

    def insert(self, req: Request) -> None:
        """Cache req's full pages of committed tokens not cached yet. NOTE: positions < committed_len hold
        final KV; all_ids may end before committed_len (a stop cut an accepted run), so count up to it."""
        n = min(req.committed_len, req.seq_len) // self.page_size
        have = req.num_cached_pages
        if n > have:
            keys = extend_page_keys(req.all_ids, req.page_keys, self.page_size, n)
            self.cache.insert(keys[have:n], req.page_table[have:n])
            req.num_cached_pages = n
