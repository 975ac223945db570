"""Prefix cache over a paged KV pool: full pages keyed by a hash chain over their tokens.

key(page i) = H(key(page i−1), the page's tokens), so a key names the whole prefix up to the page's
end and equal keys hold equal KV. A page enters the cache while a request holds it (`insert`: the
request's hold becomes the entry's first reference), is shared by reference count (`acquire`), and
when its last holder lets go (`release`) it stays cached, free, in an LRU that the allocator evicts,
oldest first, only when it has no free page left (`evict`: the cache is the allocator's reclaimer).

NOTE (invariants, tests/cache/test_prefix_cache.py):
  - a page with a reference is never evicted; only pages in the LRU (reference 0) are;
  - every page is in exactly one of: the allocator's free list, a request's private pages, the cache;
  - only full pages of committed tokens are inserted (a page past committed_len may hold rejected
    drafts), and a cached page is never written again (writes start at committed_len, a page boundary
    or later, since hits are whole pages).
H is BLAKE2b-128 over the parent key and the tokens (vLLM hashes blocks with SHA-256 for the same
reason: a crafted collision would serve one user's KV to another's prompt).
With a disk tier (`disk`, cache/disk_tier.py: --prefix-cache-dir) inserted pages are also written to files, and
`match` reads the pages RAM lacks from them into free pages first, so they are cached like any other.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .allocator import PageAllocator

if TYPE_CHECKING:
    from .disk_tier import DiskTier


def extend_page_keys(tokens: Sequence[int], keys: list[bytes], page_size: int, num_pages: int) -> list[bytes]:
    """Grow `keys` (the chain of `tokens`' first pages, computed before) to `num_pages` keys; returns it."""
    while len(keys) < num_pages:
        i = len(keys)
        h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
        h.update(array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes())
        keys.append(h.digest())
    return keys


@dataclass
class _Entry:
    key: bytes
    page: int
    ref: int = 1
    extra: Any = None  # what an owner keeps with the page (a chain drafter: its last position's feature)


@dataclass
class CacheStats:
    """Counters named as SGLang/vLLM report them."""

    queries: int = 0  # lookups (requests admitted)
    hits: int = 0  # lookups that reused at least one page
    query_tokens: int = 0  # tokens those lookups asked for
    hit_tokens: int = 0  # tokens served from cached pages
    evictions: int = 0  # cached pages dropped to make room
    disk_pages: int = 0  # pages read back from the disk tier


@dataclass
class PrefixCache:
    allocator: PageAllocator
    page_size: int
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.by_key: dict[bytes, _Entry] = {}
        self.by_page: dict[int, _Entry] = {}
        self.lru: OrderedDict[int, _Entry] = OrderedDict()  # reference 0, least recently released first
        self.allocator.reclaimer = self
        self.disk: DiskTier | None = None

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of `keys` are cached (nothing is taken). With a disk tier, the pages past RAM's
        that have files are read in first (cached, idle) as far as free pages allow."""
        n = 0
        while n < len(keys) and keys[n] in self.by_key:
            n += 1
        if self.disk is not None and n < len(keys):
            n += self._load(keys[:n], keys[n:])
        return n

    def _load(self, held: Sequence[bytes], keys: Sequence[bytes]) -> int:
        """Read the leading `keys` the disk tier has into free pages and cache them; returns how many."""
        want = self.disk.run(keys)
        if not want:
            return 0
        pinned = self.acquire(held)  # NOTE: so that making room below evicts none of the pages matched already
        fresh: list[int] = []
        try:
            fresh = self.allocator.alloc(min(want, self.allocator.num_free))
            extras = self.disk.load(keys[: len(fresh)], fresh)
            n = len(extras)
            for k, p, x in zip(keys, fresh, extras):
                self.by_key[k] = self.by_page[p] = _Entry(k, p, 1, x)
            self.stats.disk_pages += n
        finally:
            self.release(fresh + pinned)  # read pages join the LRU; pages no file filled go back
        return n

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """Take a reference on the pages of `keys` (all cached: `match` said so) and return them."""
        pages = []
        for k in keys:
            e = self.by_key[k]
            if e.ref == 0:
                del self.lru[e.page]
            e.ref += 1
            pages.append(e.page)
        return pages

    def extras(self, keys: Sequence[bytes]) -> list[Any]:
        return [self.by_key[k].extra for k in keys]

    def cached(self, page: int) -> bool:
        return page in self.by_page

    def insert(self, keys: Sequence[bytes], pages: Sequence[int], extras: Sequence[Any] | None = None) -> None:
        """Cache the caller's `pages` (full, committed) under `keys`; the caller's hold becomes their first
        reference. A key cached already (another request computed the same prefix) leaves the caller's page
        private: it is freed at release."""
        new = []
        for i, (k, p) in enumerate(zip(keys, pages)):
            if k in self.by_key or p in self.by_page or p < 0:
                continue
            e = _Entry(k, p, 1, extras[i] if extras is not None else None)
            self.by_key[k] = self.by_page[p] = e
            new.append(e)
        if self.disk is not None and new:
            self.disk.save([e.key for e in new], [e.page for e in new], [e.extra for e in new])

    def release(self, pages: Sequence[int]) -> None:
        """The caller lets go of `pages`: cached ones lose a reference (at 0 they join the LRU, still
        cached), private ones return to the allocator."""
        private = []
        for p in pages:
            e = self.by_page.get(p)
            if e is None:
                private.append(p)
                continue
            if e.ref <= 0:
                raise RuntimeError(f"cached page {p} released more often than acquired")
            e.ref -= 1
            if e.ref == 0:
                self.lru[p] = e
        self.allocator.free(private)

    def forget(self, pages: Sequence[int]) -> None:
        """Uncache those of `pages` only the caller holds (a failed request's: its KV may be what failed
        it); they become its private pages, freed at its release."""
        for p in pages:
            e = self.by_page.get(p)
            if e is not None and e.ref == 1:
                del self.by_key[e.key], self.by_page[p]
                if self.disk is not None:
                    self.disk.discard([e.key])

    def evict(self, n: int) -> int:
        """Free up to `n` cached pages nobody holds, least recently released first; returns how many."""
        done = 0
        while done < n and self.lru:
            p, e = self.lru.popitem(last=False)
            del self.by_key[e.key], self.by_page[p]
            self.allocator.free([p])
            done += 1
        self.stats.evictions += done
        return done

    def clear(self) -> int:
        """Evict every page nobody holds (tests check that no page leaked: then all are free)."""
        return self.evict(len(self.lru))
