"""The prefix cache's disk tier below the engine: page files (cache/page_store.py) checked on every read (a
flipped byte, a truncated file, a file of another namespace or format are deleted with a warning, never loaded),
kept under a budget least recently used first; a pool's pages (cache/disk_tier.py) round-trip bit for bit with
their extras through a `PrefixCache` of another pool; fingerprints (cache/fingerprint.py) tell models apart."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from specserve.cache.disk_tier import LOAD_CHUNK, DiskTier
from specserve.cache.fingerprint import Fingerprint, target_fingerprint, weights_digest
from specserve.cache.kv_pool import KVPool, parse_memory
from specserve.cache import page_store
from specserve.cache.page_store import HEADER, PageStore
from specserve.formats.quant import quantize_model
from tests.tiny import tiny_config, tiny_model

NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def read(store: PageStore, k: bytes, n: int = 1000, ns: bytes = NS) -> bytes | None:
    bufs = [bytearray(n // 2), bytearray(n - n // 2)]  # scattered into two
    tail = store.get(ns, k, [memoryview(b) for b in bufs])
    return None if tail is None else bytes(bufs[0]) + bytes(bufs[1]) + tail


def test_store_round_trip_and_every_damage_is_a_logged_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = PageStore(tmp_path, 1 << 20, version=1)
    for i in range(6):
        assert s.put(NS, key(i), [payload(i)[:400], torch.frombuffer(bytearray(payload(i)[400:]), dtype=torch.uint8)])
    assert not s.put(NS, key(0), [payload(0)])  # queued or written already
    s.flush()
    assert all(read(s, key(i)) == payload(i) for i in range(6))
    assert read(s, key(0), n=600) == payload(0)  # the rest past `into` comes back
    assert read(s, key(9)) is None  # never written: a miss, no warning
    # damage: a flipped payload byte, a truncated file, a header byte, another format version, a file of another
    # namespace copied in, another key's file under this key's name
    p = [s.path(NS, key(i)) for i in range(6)]
    raw = bytearray(p[0].read_bytes())
    raw[HEADER.size + 500] ^= 0x40
    p[0].write_bytes(raw)
    p[1].write_bytes(p[1].read_bytes()[:-37])
    p[2].write_bytes(b"XXXX" + p[2].read_bytes()[4:])
    raw = bytearray(p[3].read_bytes())
    raw[4] = 9
    p[3].write_bytes(raw)
    p[5].write_bytes(p[4].read_bytes())  # key 4's file as key 5's
    other = b"o" * 16
    s.put(other, key(4), [payload(4)])
    s.flush()
    p[4].write_bytes(s.path(other, key(4)).read_bytes())
    caplog.set_level(logging.WARNING, logger="specserve")
    why = {0: "checksum", 1: "truncated", 2: "not a page file", 3: "format version", 4: "another model",
           5: "another page"}
    for i in range(6):
        caplog.clear()
        assert read(s, key(i)) is None
        assert why[i] in caplog.text and "deleted" in caplog.text
        assert not p[i].exists() and not s.has(NS, key(i))
    assert s.stats.rejected == 6
    assert read(s, key(4), ns=other) == payload(4)  # the other namespace's own file is fine
    s.close()


def test_budget_keeps_the_least_recently_used_out_across_restarts(tmp_path: Path) -> None:
    size = HEADER.size + 1000
    s = PageStore(tmp_path, 4 * size, version=1)
    for i in range(4):
        s.put(NS, key(i), [payload(i)])
        s.flush()
        os.utime(s.path(NS, key(i)), ns=(i * 10**9, i * 10**9))  # NOTE: mtimes apart (a coarse clock ties them)
    assert read(s, key(0)) == payload(0)  # touched: now the most recently used
    s.put(NS, key(4), [payload(4)])
    s.flush()
    files = lambda: {int.from_bytes(bytes.fromhex(f.stem), "little") for f in (tmp_path / NS.hex()).glob("*.page")}  # noqa: E731
    assert files() == {0, 2, 3, 4} and s.total == 4 * size  # key 1 went: least recently used
    s.close()
    s2 = PageStore(tmp_path, 2 * size, version=1)  # a lower budget at the next start: the oldest go at once
    assert files() == {0, 4} and s2.total == 2 * size
    (tmp_path / NS.hex() / ".stale.tmp").write_bytes(b"x")
    os.utime(tmp_path / NS.hex() / ".stale.tmp", (0, 0))
    s2.close()
    PageStore(tmp_path, 2 * size, version=1).close()
    assert not (tmp_path / NS.hex() / ".stale.tmp").exists()  # a crashed writer's temporary file is removed


def test_a_file_another_engine_moves_during_the_scan_is_skipped(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines on one directory: a page renamed into place or evicted by the other between listing and stat is
    no error at start (it was one, `--prefix-cache-dir: No such file or directory`)."""
    size = HEADER.size + 1000
    s = PageStore(tmp_path, 4 * size, version=1)
    for i in range(2):
        s.put(NS, key(i), [payload(i)])
    s.flush()
    s.close()
    scandir = os.scandir

    def vanishing(path):  # noqa: ANN001, ANN202 - the first entry goes away between listing and stat
        entries = list(scandir(path))
        os.unlink(entries[0].path)
        return [type("Gone", (), {"name": entries[0].name, "path": entries[0].path,
                                  "stat": lambda self: os.stat(self.path)})()] + entries[1:]

    monkeypatch.setattr(page_store.os, "scandir", vanishing)
    s2 = PageStore(tmp_path, 4 * size, version=1)
    assert len(s2._files) == 1 and s2.total == size
    s2.close()


def test_discard_stops_a_queued_write(tmp_path: Path) -> None:
    s = PageStore(tmp_path, 1 << 20, version=1)
    s.put(NS, key(1), [payload(1)])
    s.discard(NS, key(1))  # queued or written: either way it does not stay
    s.flush()
    assert not s.has(NS, key(1)) and not s.path(NS, key(1)).exists()
    s.close()


def test_a_full_write_queue_drops_pages_instead_of_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(page_store, "MAX_PENDING", 1500)
    s = PageStore(tmp_path, 1 << 20, version=1)
    go, write = threading.Event(), s._write
    monkeypatch.setattr(s, "_write", lambda *job: (go.wait(), write(*job)))  # a disk slower than the engine
    caplog.set_level(logging.WARNING, logger="specserve")
    assert s.put(NS, key(1), [payload(1)]) and not s.put(NS, key(2), [payload(2)])
    assert "wait to be written" in caplog.text and s.stats.dropped == 1
    go.set()
    s.close()
    assert s.has(NS, key(1)) and not s.has(NS, key(2))
    assert not s.put(NS, key(3), [payload(3)])  # closed: nothing would write it


def pool(cfg=None, pages: int = 12, dtype: torch.dtype = torch.float64) -> KVPool:  # noqa: ANN001
    p = KVPool(cfg or tiny_config(layers=3), pages, 4, dtype)
    p.enable_prefix_cache()
    return p


def fill(p: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in p.k + p.v:
        c.copy_(torch.randn(c.shape, generator=g, dtype=torch.float64).to(c.dtype))


FP = Fingerprint(b"f" * 16, {"test": True})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_pages_and_extras_round_trip_into_another_pool(tmp_path: Path, dtype: torch.dtype) -> None:
    store = PageStore(tmp_path, 1 << 30, version=1)
    a = pool(dtype=dtype)
    a.prefix_cache.disk = DiskTier(store, FP, a)
    fill(a, 0)
    keys = [key(i) for i in range(8)]
    pages = a.allocator.alloc(8)
    extras = [torch.randn(5, dtype=torch.float32) for _ in range(7)] + [{"not": "a tensor"}]
    a.prefix_cache.insert(keys, pages, extras)
    store.flush()
    assert a.prefix_cache.disk.stats.saved == 7  # the last page's extra cannot be saved: RAM only
    assert (tmp_path / FP.digest.hex() / "meta.json").exists()
    b = pool(dtype=dtype)
    b.prefix_cache.disk = DiskTier(store, FP, b)
    fill(b, 1)
    assert b.prefix_cache.match(keys) == 7
    got = b.prefix_cache.acquire(keys[:7])
    for ca, cb in zip(a.k + a.v, b.k + b.v):
        for pa, pb in zip(pages, got):
            assert torch.equal(ca[pa * 4 : pa * 4 + 4], cb[pb * 4 : pb * 4 + 4])
    assert all(torch.equal(x, y) for x, y in zip(b.prefix_cache.extras(keys[:7]), extras))
    assert b.prefix_cache.stats.disk_pages == 7
    b.prefix_cache.release(got)
    assert b.prefix_cache.match(keys) == 7  # in RAM now: nothing read again
    assert b.prefix_cache.disk.stats.loaded == 7
    store.close()


def test_reading_in_never_evicts_the_pages_matched_in_ram(tmp_path: Path) -> None:
    """A full pool whose idle pages are the RAM part of the match: the disk part can only take other pages."""
    store = PageStore(tmp_path, 1 << 30, version=1)
    a = pool(pages=12)
    a.prefix_cache.disk = DiskTier(store, FP, a)
    fill(a, 0)
    keys = [key(i) for i in range(10)]
    a.prefix_cache.insert(keys, a.allocator.alloc(10))
    store.flush()
    b = pool(pages=6)
    b.prefix_cache.disk = DiskTier(store, FP, b)
    pages = b.allocator.alloc(3)
    b.prefix_cache.insert(keys[:3], pages)  # RAM holds the first three (idle after release)
    b.prefix_cache.release(pages)
    other = b.allocator.alloc(3)  # the rest of the pool is private
    assert b.prefix_cache.match(keys) == 3  # no page to read into: the RAM hit stays whole
    b.allocator.free(other)
    assert b.prefix_cache.match(keys) == 6  # three read in, into the free pages only
    assert set(keys[:6]) == set(b.prefix_cache.by_key)
    store.close()


def test_a_long_run_loads_across_staging_chunks_and_stops_at_a_bad_file(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    n = LOAD_CHUNK + 9
    store = PageStore(tmp_path, 1 << 30, version=1)
    a = pool(pages=n)
    a.prefix_cache.disk = DiskTier(store, FP, a)
    fill(a, 0)
    keys = [key(i) for i in range(n)]
    a.prefix_cache.insert(keys, a.allocator.alloc(n))
    store.flush()
    bad = store.path(FP.digest, keys[LOAD_CHUNK + 4])
    bad.write_bytes(bad.read_bytes()[:-8])
    b = pool(pages=n)
    b.prefix_cache.disk = DiskTier(store, FP, b)
    caplog.set_level(logging.WARNING, logger="specserve")
    assert b.prefix_cache.match(keys) == LOAD_CHUNK + 4
    assert "truncated" in caplog.text and not bad.exists()
    got = b.prefix_cache.acquire(keys[: LOAD_CHUNK + 4])
    want = [a.prefix_cache.by_key[k].page for k in keys[: LOAD_CHUNK + 4]]
    for ca, cb in zip(a.k + a.v, b.k + b.v):
        assert torch.equal(ca.unflatten(0, (n, 4))[want], cb.unflatten(0, (n, 4))[got])
    assert b.allocator.num_free == n - len(got)  # pages no file filled went back
    store.close()


def test_forget_deletes_the_files_of_a_failed_request(tmp_path: Path) -> None:
    store = PageStore(tmp_path, 1 << 30, version=1)
    a = pool()
    a.prefix_cache.disk = DiskTier(store, FP, a)
    pages = a.allocator.alloc(2)
    a.prefix_cache.insert([key(1), key(2)], pages)
    a.prefix_cache.forget(pages)
    store.flush()
    assert not store.has(FP.digest, key(1)) and not list((tmp_path / FP.digest.hex()).glob("*.page"))
    store.close()


def test_fingerprints_tell_models_layouts_and_quantizations_apart() -> None:
    m = tiny_model("llama")
    p = pool(m.cfg, dtype=torch.float64)
    base = target_fingerprint(m, None, p, None).digest
    assert target_fingerprint(tiny_model("llama"), None, p, None).digest == base  # the same model again
    assert target_fingerprint(tiny_model("llama", seed=1), None, p, None).digest != base
    assert target_fingerprint(m, None, KVPool(m.cfg, 12, 8, torch.float64), None).digest != base  # page size
    assert target_fingerprint(m, None, pool(m.cfg, dtype=torch.float32), None).digest != base  # KV dtype
    assert target_fingerprint(tiny_model("llama", rope_theta=500.0), None, p, None).digest != base
    q, q2 = tiny_model("llama", dtype=torch.float32), tiny_model("llama", dtype=torch.float32)
    quantize_model(q, "w4a8")
    quantize_model(q2, "w8a8")
    assert weights_digest(q) != weights_digest(q2) != weights_digest(tiny_model("llama", dtype=torch.float32))


def test_disk_budget_parses_sizes_only() -> None:
    assert parse_memory("4GB", "--prefix-cache-disk-budget", fraction=False) == 4 << 30
    with pytest.raises(ValueError, match="--prefix-cache-disk-budget.*not a size"):
        parse_memory("0.5", "--prefix-cache-disk-budget", fraction=False)
    with pytest.raises(ValueError, match="--prefix-cache-disk-budget: cannot parse"):
        parse_memory("lots", "--prefix-cache-disk-budget", fraction=False)
