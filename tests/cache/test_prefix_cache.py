"""The prefix cache's bookkeeping (cache/prefix_cache.py) against a reference model: a dict key → page, a
holder count per page and a list of released pages in release order."""
from __future__ import annotations

import random

import pytest

from specserve.cache.allocator import OutOfPages, PageAllocator
from specserve.cache.prefix_cache import PrefixCache, extend_page_keys


def test_keys_name_the_whole_prefix() -> None:
    a = extend_page_keys([1, 2, 3, 4, 5, 6], [], 2, 3)
    b = extend_page_keys([9, 9, 3, 4, 5, 6], [], 2, 3)
    assert len(set(a)) == 3 and a[1] != b[1] and a[2] != b[2]  # same page tokens, other prefix: other key
    assert extend_page_keys([1, 2, 3, 4, 5, 6, 7, 8], a[:1], 2, 4)[:3] == a  # grown incrementally: same chain
    assert extend_page_keys([1, 2, 3], [], 2, 1) == a[:1]


def test_randomized_against_reference() -> None:
    rng = random.Random(0)
    ps, num_pages = 2, 24
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, ps)
    ref: dict[bytes, int] = {}  # cached key → page
    holders: dict[int, int] = {}  # page → requests holding it
    idle: list[int] = []  # cached pages nobody holds, least recently released first
    reqs: list[list[int]] = []  # pages each live request holds (cached or private)
    evicted = 0
    stems = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    for _ in range(3000):
        if reqs and (rng.random() < 0.45 or alloc.num_unowned + len(idle) < 6):
            pages = reqs.pop(rng.randrange(len(reqs)))
            cache.release(pages)
            for p in pages:
                holders[p] -= 1
                if holders[p] == 0:
                    del holders[p]
                    if p in ref.values():
                        idle.append(p)
            continue
        toks = rng.choice(stems)[: rng.randrange(13)] + [rng.randrange(4) for _ in range(rng.randrange(5))]
        keys = extend_page_keys(toks, [], ps, len(toks) // ps)
        want = 0
        while want < len(keys) and keys[want] in ref:
            want += 1
        assert cache.match(keys) == want
        pages = cache.acquire(keys[:want])
        assert pages == [ref[k] for k in keys[:want]]
        for p in pages:
            if p in idle:
                idle.remove(p)
            holders[p] = holders.get(p, 0) + 1
        need = len(keys) - want
        free_before = alloc.num_unowned
        try:
            new = alloc.alloc(need)
        except OutOfPages:
            assert need > alloc.num_free
            cache.release(pages)
            for p in pages:
                holders[p] -= 1
                if holders[p] == 0:
                    del holders[p]
                    idle.append(p)
            continue
        gone, idle = idle[: max(0, need - free_before)], idle[max(0, need - free_before):]  # LRU: oldest first
        evicted += len(gone)
        for p in gone:
            assert p not in holders  # NOTE: a held page is never evicted
            del ref[next(k for k, v in ref.items() if v == p)]
        cache.insert(keys[want:], new)
        for k, p in zip(keys[want:], new):
            holders[p] = 1
            if k not in ref:
                ref[k] = p
        reqs.append(pages + new)
        # the partition: free list + held + idle cached = every page, each once
        assert cache.by_key.keys() == ref.keys() and {e.page for e in cache.by_key.values()} == set(ref.values())
        assert sorted(cache.lru) == sorted(idle) and list(cache.lru) == idle
        assert alloc.num_unowned + len(holders) + len(idle) == num_pages
        assert all(cache.by_page[p].ref == n for p, n in holders.items() if p in cache.by_page)
    assert cache.stats.evictions == evicted > 50
    for pages in reqs:
        cache.release(pages)
    assert alloc.num_free == num_pages and cache.clear() == len(ref)
    assert alloc.num_unowned == num_pages and not cache.by_key and not cache.by_page


def test_release_errors_and_duplicates() -> None:
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, 2)
    keys = extend_page_keys([1, 2, 3, 4], [], 2, 2)
    a = alloc.alloc(2)
    cache.insert(keys, a)
    b = alloc.alloc(2)  # the same prefix computed twice: the second copy stays private
    cache.insert(keys, b)
    assert [cache.cached(p) for p in a + b] == [True, True, False, False]
    cache.release(b)
    assert alloc.num_unowned == 2 and cache.num_evictable == 0
    cache.release(a)
    assert cache.num_evictable == 2 and alloc.num_free == 4
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(a[:1])
    assert alloc.alloc(4) and cache.stats.evictions == 2 and not cache.by_key
