"""Page allocator: hands out fixed-size KV pages from a free list.

NOTE: a page is owned by at most one request at a time; `free` of a page that is not allocated
raises (double free would let two requests share a page and corrupt each other's KV).
"""
from __future__ import annotations

from typing import Protocol


class OutOfPages(Exception):
    """Not enough free pages; the scheduler waits or preempts."""


class Reclaimer(Protocol):
    """Holds allocated pages nobody uses and gives them back on demand (the prefix cache's LRU)."""

    @property
    def num_evictable(self) -> int: ...

    def evict(self, n: int) -> int: ...


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()
        # NOTE: its pages count as free (an alloc takes them back); evicted only when the free list is short
        self.reclaimer: Reclaimer | None = None

    @property
    def num_free(self) -> int:
        """Pages an alloc can hand out: the free list and the reclaimer's idle pages."""
        return len(self._free) + (self.reclaimer.num_evictable if self.reclaimer else 0)

    @property
    def num_unowned(self) -> int:
        """Pages on the free list (nothing, not even the prefix cache, holds them)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)
