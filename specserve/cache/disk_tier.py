"""The disk tier of a prefix cache (--prefix-cache-dir): a pool's cached pages also kept as files
(cache/page_store.py) under the pool's fingerprint (cache/fingerprint.py), so an engine built later over the same
model and KV layout (a restarted server) finds the prefixes an earlier one computed.

  save(keys, pages, extras)   pages entering the RAM cache (write-through): their K/V gathered out of the pool in
                              one index_select per layer on the engine thread; checksummed and written by the
                              store's thread
  run(keys)                   how many leading keys have a file (the store's index: no I/O)
  load(keys, pages)           read those files into `pages`, stopping at the first that is missing or fails a
                              check; returns the extras of the pages it filled
  discard(keys)               a failed request's pages: their files go too
A page's payload: per attention layer its K then its V, head-major ([kv_heads, page_size, head_dim] in the pool's
dtype: the pool's storage order, so a page is kv_heads runs of page_size x head_dim to copy, not page_size x
kv_heads rows), then the owner's extra if it has one: a tensor (a chain drafter keeps its page's last feature) as
a 2-byte length, JSON {dtype, shape}, its bytes. A page whose extra is anything else stays in RAM only.
Loads go through a staging buffer of LOAD_CHUNK pages in the pool's order ([K/V, kv_head, page, row, head_dim]:
each file scattered into it by one preadv, then one index_copy per K/V per chunk whose blocks are contiguous runs
of page_size x head_dim, as in the pool; from a page-major one the copy took 1.5x longer), kept between loads.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .fingerprint import Fingerprint
from .kv_pool import KVPool
from .page_store import PageStore

log = logging.getLogger("specserve")
_LEN = struct.Struct("<H")
LOAD_CHUNK = 32  # pages per staging buffer (32 of SmolLM2's fp32 pages: 23 MiB)


@contextmanager
def _one_thread() -> Iterator[None]:
    """NOTE: the tier's copies run on one thread: they write memory touched for the first time (a fresh pool's
    pages, a new snapshot), and threads faulting pages into one address space serialize on its lock (a 4k-token
    prefix copied into a fresh SmolLM2 pool: 2.4 s on 2 threads, 0.25 s on 1; touched memory: 72 ms, 25 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass
class TierStats:
    saved: int = 0  # pages handed to the store
    save_s: float = 0.0  # engine thread's time in save (the gather)
    loaded: int = 0  # pages read back into the pool
    load_s: float = 0.0  # engine thread's time in load (read, check, copy in)


class DiskTier:
    def __init__(self, store: PageStore, fp: Fingerprint, pool: KVPool) -> None:
        self.store, self.ns, self.pool = store, fp.digest, pool
        self.page_size, self.dtype = pool.page_size, pool.dtype
        ps, (slots, kv_heads, head_dim) = self.page_size, pool.k[0].shape
        # K0, V0, K1, V1, ... as [kv_heads, page, row, head_dim] views
        self.caches = [c.unflatten(0, (slots // ps, ps)).permute(2, 0, 1, 3) for kv in zip(pool.k, pool.v) for c in kv]
        self.page_shape = (len(self.caches), kv_heads, ps, head_dim)
        self.kv_elems = len(self.caches) * kv_heads * ps * head_dim
        self.kv_bytes = self.kv_elems * pool.k[0].element_size()
        self._staging: torch.Tensor | None = None
        self._slots: list[list[memoryview]] = []
        self.stats = TierStats()
        self._warned_extra = False
        meta = store.root / fp.digest.hex() / "meta.json"
        if not meta.exists():  # for whoever looks at the directory: what these files belong to
            meta.parent.mkdir(exist_ok=True)
            meta.write_text(json.dumps(fp.parts, indent=1, sort_keys=True, default=str))

    def _extra_parts(self, extra: Any) -> list[Any] | None:
        if extra is None:
            return []
        if not isinstance(extra, torch.Tensor):
            if not self._warned_extra:
                self._warned_extra = True
                log.info("prefix cache dir: pages kept with a %s stay in RAM only", type(extra).__name__)
            return None
        desc = json.dumps({"dtype": str(extra.dtype).removeprefix("torch."), "shape": list(extra.shape)}).encode()
        return [_LEN.pack(len(desc)) + desc, extra.detach()]

    def save(self, keys: Sequence[bytes], pages: Sequence[int], extras: Sequence[Any] | None = None) -> None:
        t0 = time.perf_counter()
        todo = []
        for i, k in enumerate(keys):
            tail = self._extra_parts(extras[i] if extras is not None else None)
            if tail is not None and not self.store.has(self.ns, k):
                todo.append((k, pages[i], tail))
        if not todo:
            return
        index = torch.tensor([p for _, p, _ in todo])
        # NOTE: copied now: a cached page is never written again, but once evicted it is reused
        with _one_thread():
            rows = [c.index_select(1, index).unbind(1) for c in self.caches]  # per K/V, per page: [kv_heads, row, head_dim]
        for j, (k, _, tail) in enumerate(todo):
            if self.store.put(self.ns, k, [r[j] for r in rows] + tail):
                self.stats.saved += 1
        self.stats.save_s += time.perf_counter() - t0

    def run(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and self.store.has(self.ns, keys[n]):
            n += 1
        return n

    def _extra(self, data: memoryview) -> torch.Tensor | None:
        """The extra after a page's K/V; ValueError if the bytes do not parse."""
        if not len(data):
            return None
        try:
            (n,) = _LEN.unpack_from(data)
            desc = json.loads(bytes(data[_LEN.size : _LEN.size + n]))
            dtype = getattr(torch, desc["dtype"])
            shape = [int(x) for x in desc["shape"]]
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"has an unreadable extra ({e})") from None
        raw = data[_LEN.size + n :]
        count = 1
        for x in shape:
            count *= x
        if not isinstance(dtype, torch.dtype) or len(raw) != count * dtype.itemsize:
            raise ValueError(f"has an extra of {len(raw)} bytes, its description says {count} x {dtype}")
        return torch.frombuffer(bytearray(raw), dtype=dtype, count=count).reshape(shape) if count else \
            torch.empty(shape, dtype=dtype)

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[Any]:
        t0 = time.perf_counter()
        extras: list[Any] = []
        n = min(len(keys), len(pages))
        if n and self._staging is None:
            kv, kv_heads, ps, head_dim = self.page_shape
            self._staging = torch.empty((kv, kv_heads, LOAD_CHUNK, ps, head_dim), dtype=self.dtype)
            # per staging slot, its page's kv x kv_heads blocks in file order (numpy slices: a torch view per block
            # cost ~35 us, 0.2 s per 4k-token prefix)
            raw = self._staging.view(kv * kv_heads, LOAD_CHUNK, -1).view(torch.uint8).numpy()
            self._slots = [[memoryview(raw[b, j]) for b in range(kv * kv_heads)] for j in range(LOAD_CHUNK)]
        while len(extras) < n:
            start = len(extras)
            for j, k in enumerate(keys[start : min(n, start + LOAD_CHUNK)]):
                got = self._read(k, self._slots[j])
                if got is None:
                    break
                extras.append(got[0])
            m = len(extras) - start
            if m:
                index = torch.tensor(pages[start : start + m])
                with _one_thread():
                    for c, staged in zip(self.caches, self._staging):  # [kv_heads, m, row, head_dim] each
                        c.index_copy_(1, index, staged[:, :m])
            if m < LOAD_CHUNK:
                break
        self.stats.loaded += len(extras)
        self.stats.load_s += time.perf_counter() - t0
        return extras

    def _read(self, key: bytes, into: list[memoryview]) -> tuple[Any] | None:
        """Page `key`'s K/V into the buffers `into` and its extra (in a 1-tuple: None is an extra), or None."""
        tail = self.store.get(self.ns, key, into)
        if tail is None:
            return None
        try:
            return (self._extra(memoryview(tail)),)
        except ValueError as e:
            self.store.reject(self.ns, key, str(e))
            return None

    def discard(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.store.discard(self.ns, k)
