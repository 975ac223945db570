"""A drafter pool's share of the prefix cache: its own `PrefixCache` over its own pages, keyed by the same
hash chain as the target's (engine/prefix.py), so a page key names the same prefix in both pools.

NOTE: a draft page is inserted only when every row in it was built from committed tokens (and, for learned
drafters, the target's features of committed positions): rows < min(done, seq_len). Rows past the last
token are drafts (rejected or not) and never enter the cache.
"""
from __future__ import annotations

from typing import Any, Callable

from ..cache.kv_pool import KVPool
from ..cache.prefix_cache import PrefixCache, extend_page_keys
from ..core import Request


class DraftPrefix:
    def __init__(self, kv: KVPool) -> None:
        self.cache: PrefixCache = kv.prefix_cache or kv.enable_prefix_cache()
        self.page_size = kv.page_size

    def match(self, keys: list[bytes]) -> int:
        return self.cache.match(keys)

    def take(self, keys: list[bytes]) -> tuple[list[int], list[Any]]:
        """Pages of `keys` (all cached) with a reference taken, and what was kept with each."""
        return self.cache.acquire(keys), self.cache.extras(keys)

    def insert(self, req: Request, page_table: list[int], done: int, have: int,
               extra: Callable[[int], Any] | None = None) -> int:
        """Cache the pages of `page_table` whose rows [0, done) are all built, past the first `have`;
        returns how many leading pages are cached now. extra(p): what to keep with page p (None: page p
        cannot be cached yet, nor any after it)."""
        if req.finish_reason == "error":
            return have  # its state may be what failed it
        n = min(done, req.seq_len, len(page_table) * self.page_size) // self.page_size
        if n <= have:
            return have
        extras = None
        if extra is not None:
            extras = [extra(p) for p in range(have, n)]
            if None in extras:
                n = have + extras.index(None)
                extras = extras[: n - have]
        keys = extend_page_keys(req.all_ids, req.page_keys, self.page_size, n)
        self.cache.insert(keys[have:n], page_table[have:n], extras)
        return n
