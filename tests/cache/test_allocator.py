"""PageAllocator / KVPool / parse_memory: ownership invariants of the paged KV cache."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.cache.allocator import OutOfPages, PageAllocator
from specserve.cache.kv_pool import KVPool, parse_memory
from specserve.memory import total_memory_bytes
from tests.tiny import tiny_config


# ---------------------------------------------------------------- PageAllocator
@pytest.mark.parametrize("seed", range(5))
def test_allocator_random_stress(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([1, 2, 7, 32, 100])
    a = PageAllocator(n)
    owners: dict[int, list[int]] = {}  # owner id → its pages (like page tables)
    next_owner = 0
    for _ in range(2000):
        op = rng.random()
        held = {p for ps in owners.values() for p in ps}
        assert a.num_free == n - len(held)
        assert a.usage == pytest.approx(len(held) / n)
        if op < 0.4:  # new owner
            k = rng.randint(0, 4)
            if k > a.num_free:
                before = a.num_free
                with pytest.raises(OutOfPages):
                    a.alloc(k)
                assert a.num_free == before  # a failed alloc takes nothing
                continue
            pages = a.alloc(k)
            assert len(pages) == k and len(set(pages)) == k
            assert not (set(pages) & held), "a page was handed out twice"
            assert all(0 <= p < n for p in pages)
            owners[next_owner] = pages
            next_owner += 1
        elif op < 0.7 and owners:  # extend an owner
            o = rng.choice(list(owners))
            k = rng.randint(1, 3)
            if k > a.num_free:
                with pytest.raises(OutOfPages):
                    a.alloc(k)
                continue
            pages = a.alloc(k)
            assert not (set(pages) & held)
            owners[o] += pages
        elif owners:  # free an owner (sometimes only part of it)
            o = rng.choice(list(owners))
            pages = owners.pop(o)
            if pages and rng.random() < 0.3:
                cut = rng.randint(0, len(pages))
                a.free(pages[:cut])
                owners[o] = pages[cut:]
            else:
                a.free(pages)
                if pages and rng.random() < 0.2:
                    with pytest.raises(RuntimeError):
                        a.free([rng.choice(pages)])  # double free
    for pages in owners.values():
        a.free(pages)
    assert a.num_free == n and a.usage == 0.0
    # every page is handed out again, exactly once
    assert sorted(a.alloc(n)) == list(range(n))
    with pytest.raises(OutOfPages):
        a.alloc(1)


def test_allocator_double_free_and_foreign_free() -> None:
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(p[:1])
    with pytest.raises(RuntimeError):
        a.free([3])  # never allocated
    with pytest.raises(RuntimeError):
        a.free([99])
    q = a.alloc(1)
    with pytest.raises(RuntimeError):
        a.free(q + q)  # the same page twice in one call
    assert a.num_free == 4  # the first copy went back, nothing was duplicated
    assert sorted(a.alloc(4)) == [0, 1, 2, 3]


def test_allocator_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)
    a = PageAllocator(3)
    assert a.alloc(0) == [] and a.num_free == 3


# ---------------------------------------------------------------- KVPool
def _pool(pages: int = 6, page_size: int = 4) -> KVPool:
    return KVPool(tiny_config(), pages, page_size, torch.float64)


def test_kvpool_ensure_growth_and_slots() -> None:
    kv = _pool(6, 4)
    cfg = tiny_config()
    assert kv.num_slots == 24
    assert len(kv.k) == cfg.num_layers and kv.k[0].shape == (24, cfg.num_kv_heads, cfg.head_dim)
    pt: list[int] = []
    kv.ensure(pt, 0)
    assert pt == []
    kv.ensure(pt, 1)
    assert len(pt) == 1
    kv.ensure(pt, 4)
    assert len(pt) == 1  # still one page
    kv.ensure(pt, 5)
    assert len(pt) == 2
    kv.ensure(pt, 3)  # never shrinks
    assert len(pt) == 2
    other: list[int] = []
    kv.ensure(other, 9)
    assert len(other) == 3 and not set(other) & set(pt)
    assert kv.pages_needed(pt, 12) == 1 and kv.pages_needed(pt, 8) == 0
    slots = kv.slots(pt, 0, 8)
    assert slots == [pt[l // 4] * 4 + l % 4 for l in range(8)]
    assert len(set(slots + kv.slots(other, 0, 9))) == 17  # requests never share a slot
    kv.release(pt)
    assert pt == [] and kv.allocator.num_free == 3
    kv.release(other)
    assert kv.allocator.num_free == 6


def test_kvpool_out_of_pages_leaves_table_unchanged() -> None:
    kv = _pool(5, 4)
    a: list[int] = []
    b: list[int] = []
    kv.ensure(a, 8)  # 2 pages
    kv.ensure(b, 8)  # 2 pages, 1 left
    before_a, free = list(a), kv.allocator.num_free
    with pytest.raises(OutOfPages):
        kv.ensure(a, 20)  # needs 3 more
    assert a == before_a and kv.allocator.num_free == free
    kv.ensure(a, 12)  # exactly the last page
    assert len(a) == 3 and kv.allocator.num_free == 0
    with pytest.raises(OutOfPages):
        kv.ensure(b, 9)
    assert len(b) == 2
    kv.release(a)
    kv.release(b)
    assert kv.allocator.num_free == 5


def test_pages_for_budget() -> None:
    cfg = tiny_config()
    per_token = cfg.kv_bytes_per_token * 8  # fp64
    assert KVPool.pages_for_budget(cfg, per_token * 16 * 3, 16, torch.float64) == 3
    assert KVPool.pages_for_budget(cfg, per_token * 16 * 3 - 1, 16, torch.float64) == 2
    assert KVPool.pages_for_budget(cfg, per_token * 16 * 3, 16, torch.float32) == 6


# ---------------------------------------------------------------- parse_memory
@pytest.mark.parametrize("spec,expected", [
    ("2GiB", 2 * 2**30), ("2gib", 2 * 2**30), ("2G", 2 * 2**30), ("2GB", 2 * 2**30),
    ("512MB", 512 * 2**20), ("512 MiB", 512 * 2**20), (" 64KiB ", 64 * 2**10), ("64k", 64 * 2**10),
    ("1e9", 10**9), ("4096", 4096), ("4096B", 4096), ("1.5GiB", int(1.5 * 2**30)), (2048, 2048), (3.0, 3),
])
def test_parse_memory_sizes(spec, expected) -> None:  # noqa: ANN001
    assert parse_memory(spec) == expected


@pytest.mark.parametrize("frac", [0.1, 0.5, 1.0, 1, "0.1", "0.25"])
def test_parse_memory_fraction_of_ram(frac) -> None:  # noqa: ANN001
    assert parse_memory(frac) == int(float(frac) * total_memory_bytes())


@pytest.mark.parametrize("bad", ["", "abc", "2XB", "GiB", "1..2GB", "two GiB", "-1GiB", "0", 0, -5, "0.0", "1e9e9",
                                 "--1", "1e999GiB", float("nan"), float("inf"), True, None])
def test_parse_memory_rejects(bad) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_memory(bad)
