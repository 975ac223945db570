"""Paged KV pool: per layer, K and V as flat slot arrays [num_pages * page_size, kv_heads, head_dim] (views of
head-major storage).

A request's page table lists its pages; position l of the request lives in slot
page_table[l // page_size] * page_size + l % page_size.
"""
from __future__ import annotations

import re

import torch

from ..models.config import ModelConfig
from ..memory import lazy_zeros, total_memory_bytes
from .allocator import OutOfPages, PageAllocator
from .prefix_cache import PrefixCache

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_memory(spec: str | float | int, name: str = "--kv-cache-memory", fraction: bool = True) -> int:
    """'2GiB', '512MB', '1e9' → bytes; a number in (0, 1] → that fraction of total RAM (`fraction`: else refused,
    as for a disk size). `name`: the flag errors name."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value, unit = float(spec), ""
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(spec))
        try:
            if not m or m.group(2).lower() not in _UNITS:
                raise ValueError
            value, unit = float(m.group(1)), m.group(2).lower()
        except ValueError:  # also a malformed number the loose pattern let through ('1..2GB', '--1')
            raise ValueError(f"{name}: cannot parse {spec!r}; use e.g. '2GiB', '512MB'"
                             + (" or a fraction like 0.2" if fraction else "")) from None
    if not 0 < value < float("inf"):  # NaN and inf fail here too
        raise ValueError(f"{name} must be positive and finite, got {spec!r}")
    if unit == "" and value <= 1.0:
        if not fraction:
            raise ValueError(f"{name}: {spec!r} is not a size; use e.g. '4GiB', '500MB'")
        return int(value * total_memory_bytes())
    return int(value * _UNITS[unit])


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype) -> None:
        self.page_size, self.dtype = page_size, dtype
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache: PrefixCache | None = None  # `enable_prefix_cache` turns it on
        slots = num_pages * page_size
        # NOTE: one K and one V per attention layer, in layer order (recurrent layers keep a StatePool slot).
        # Stored head-major, [kv_heads, slots, head_dim], and used through a [slots, kv_heads, head_dim] view:
        # attention reads one kv head's slots at a time, and slot-major rows interleaved the heads, so a
        # long context streamed 1/kv_heads of every cache line it fetched (SmolLM2, 3 kv heads: 8.8 GB/s of
        # useful bytes against 30 GB/s streamed; a decode step at 2k context cost 4x one at 64). Lazily
        # zeroed: RSS grows with the slots written, not with --kv-cache-memory.
        def pool() -> torch.Tensor:
            return lazy_zeros((cfg.num_kv_heads, slots, cfg.head_dim), dtype).transpose(0, 1)

        self.k = [pool() for _ in cfg.attention_layers]
        self.v = [pool() for _ in cfg.attention_layers]

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        per_page = cfg.kv_bytes_per_token * page_size * torch.finfo(dtype).bits // 8
        return budget_bytes // per_page

    def enable_prefix_cache(self) -> PrefixCache:
        self.prefix_cache = PrefixCache(self.allocator, self.page_size)
        return self.prefix_cache

    @property
    def num_slots(self) -> int:
        return self.allocator.num_pages * self.page_size

    def ensure(self, page_table: list[int], num_tokens: int) -> None:
        """Grow `page_table` in place to hold `num_tokens` positions. Raises OutOfPages (nothing allocated)."""
        need = -(-num_tokens // self.page_size) - len(page_table)
        if need > 0:
            page_table.extend(self.allocator.alloc(need))

    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def slots(self, page_table: list[int], start: int, end: int) -> list[int]:
        """Pool slots of positions start..end-1: one range per page (runs per request per step)."""
        ps, out, i = self.page_size, [], start
        while i < end:
            page, off = divmod(i, ps)
            n = min(ps - off, end - i)
            first = page_table[page] * ps + off
            out.extend(range(first, first + n))
            i += n
        return out

    def _drop(self, pages: list[int]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(pages)  # cached pages lose a reference, private ones are freed
        else:
            self.allocator.free(pages)

    def release(self, page_table: list[int], failed: bool = False) -> None:
        """Return a request's pages; a `failed` request's cached pages nobody else holds are uncached first."""
        if failed and self.prefix_cache is not None:
            self.prefix_cache.forget(page_table)
        self._drop([p for p in page_table if p >= 0])
        page_table.clear()

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` to slots `dst` in every layer (sources read before any write)."""
        for cache in self.k + self.v:
            cache.index_copy_(0, dst, cache[src])

    def free_below(self, page_table: list[int], position: int) -> None:
        """Free the pages holding only positions < `position` (a sliding window never reads them
        again); their entries become −1, so later positions keep their page index."""
        dead = [i for i in range(min(position // self.page_size, len(page_table))) if page_table[i] >= 0]
        self._drop([page_table[i] for i in dead])
        for i in dead:
            page_table[i] = -1


__all__ = ["KVPool", "OutOfPages", "parse_memory"]
