"""Files of KV pages under a size budget: the storage of the prefix cache's disk tier (cache/disk_tier.py).

Layout: <root>/<namespace hex>/<key hex>.page, a namespace being a pool's fingerprint (cache/fingerprint.py) and a
key a page key of the hash chain (cache/prefix_cache.py). A file is a fixed header (magic, format version,
namespace, key, payload length, CRC-32 of the payload), then the payload.
  put(ns, key, parts)   queue a page for the writer thread (the engine thread only hands over buffers); a page
                        whose file exists or is queued is skipped, and past MAX_PENDING queued bytes a page is
                        dropped rather than stall the engine or hold more memory
  get(ns, key, into)    scatter the payload's first bytes into the buffers `into` (one preadv) and return the
                        rest, all checked, or None; touches the file (least recently used order survives a
                        restart: it is the mtime)
  has / discard / reject / flush / close
Each file is written to a temporary name and renamed into place, so no reader sees a partial file. Past the
budget the least recently used files are deleted, whatever their namespace (a model no longer served ages out).
NOTE: a file is trusted only when its header and checksum agree; one that does not is logged, deleted and read
as a miss. The directory is trusted as the model files are: the checksum guards against damage (a crash, a full
disk, a truncated copy), not against someone who can write there.
One process per directory: another process's files are seen at start, not while both run (files stay whole,
the budget is each one's own count).
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

log = logging.getLogger("specserve")

MAGIC = b"SSKV"
HEADER = struct.Struct("<4sI16s16sQI")  # magic, format version, namespace, key, payload bytes, payload CRC-32
MAX_PENDING = 256 << 20  # bytes queued for writing at most (a 4k-token prefix of SmolLM2 or Qwen2.5-1.5B fits)
_STALE_TMP_S = 3600.0  # a temporary file this old is a crashed writer's


@dataclass
class StoreStats:
    written: int = 0  # pages written
    written_bytes: int = 0
    write_s: float = 0.0  # writer thread's time on them (checksum, write, rename)
    dropped: int = 0  # pages not written: the write queue was full, or the write failed
    read: int = 0  # pages read and checked
    read_s: float = 0.0
    rejected: int = 0  # files that failed their checks (deleted)
    evicted: int = 0  # files deleted past the budget


Part = torch.Tensor | bytes


def _buffers(parts: list[Part]) -> list[memoryview | bytes]:
    """The parts' bytes; a run of tensors of one dtype and shape (a page's K/V per layer) stacked into one buffer:
    one copy, one checksum call and one write for it (per tensor: a copy, a call, a write each)."""
    out: list[memoryview | bytes] = []
    run: list[torch.Tensor] = []
    for p in [*parts, None]:
        if isinstance(p, torch.Tensor) and (not run or (p.dtype, p.shape) == (run[0].dtype, run[0].shape)):
            run.append(p)
            continue
        if run:
            t = torch.stack(run) if len(run) > 1 else run[0].contiguous()
            out.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        run = [p] if isinstance(p, torch.Tensor) else []
        if isinstance(p, bytes):
            out.append(p)
    return out


class PageStore:
    def __init__(self, root: str | Path, budget: int, version: int) -> None:
        self.root, self.budget, self.version = Path(root).expanduser(), budget, version
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[bytes, bytes], int] = OrderedDict()  # → size; least recently used first
        self.total = 0  # bytes of the files in _files
        self._queued: set[tuple[bytes, bytes]] = set()
        self._discarded: set[tuple[bytes, bytes]] = set()  # queued, then discarded: not to be kept once written
        self._pending = 0  # bytes queued
        self._warned_full = self._closed = False
        self._scan()
        self._jobs: queue.Queue[tuple[bytes, bytes, list[Part], int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._writer, name="specserve-prefix-disk", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # NOTE: queued pages reach the disk at a normal exit too

    def path(self, ns: bytes, key: bytes) -> Path:
        return self.root / ns.hex() / f"{key.hex()}.page"

    # ---- the index ----
    def _scan(self) -> None:
        """Index the page files already there (every namespace), oldest first; delete past the budget."""
        found = []
        now = time.time()
        for d in self.root.iterdir():
            ns = _hex(d.name, 16)
            if ns is None or not d.is_dir():
                continue
            for e in os.scandir(d):
                try:
                    if e.name.endswith(".page") and (key := _hex(e.name[:-5], 16)) is not None:
                        st = e.stat()
                        found.append((st.st_mtime_ns, ns, key, st.st_size))
                    elif e.name.endswith(".tmp") and now - e.stat().st_mtime > _STALE_TMP_S:
                        _unlink(Path(e.path))
                except FileNotFoundError:  # NOTE: another engine on this directory renamed or evicted it meanwhile
                    continue
        for _, ns, key, size in sorted(found):
            self._files[(ns, key)] = size
            self.total += size
        for p in self._over_budget():
            _unlink(p)

    def _over_budget(self) -> list[Path]:
        """Drop the least recently used files from the index until the rest fit; returns their paths. NOTE: under
        the lock (or before the writer starts)."""
        out = []
        while self.total > self.budget and self._files:
            (ns, key), size = self._files.popitem(last=False)
            self.total -= size
            self.stats.evicted += 1
            out.append(self.path(ns, key))
        return out

    def has(self, ns: bytes, key: bytes) -> bool:
        with self._lock:
            return (ns, key) in self._files

    def _forget(self, ns: bytes, key: bytes) -> bool:
        with self._lock:
            size = self._files.pop((ns, key), None)
            if size is not None:
                self.total -= size
            if (ns, key) in self._queued:
                self._discarded.add((ns, key))
            return size is not None

    def discard(self, ns: bytes, key: bytes) -> None:
        """Delete the page's file, now or once its queued write lands (its KV is not to be trusted)."""
        if self._forget(ns, key):
            _unlink(self.path(ns, key))

    def reject(self, ns: bytes, key: bytes, why: str) -> None:
        """A file that failed a check: logged, deleted, never read again."""
        self.stats.rejected += 1
        log.warning("prefix cache dir: %s %s; deleted", self.path(ns, key), why)
        self.discard(ns, key)

    # ---- reading ----
    def get(self, ns: bytes, key: bytes, into: Sequence[memoryview]) -> bytes | None:
        """Read the page's payload: its first bytes scattered into the buffers `into`, in order (no copy in
        between), the rest returned; header and checksum checked (None: a miss, or a file that failed and is gone)."""
        if not self.has(ns, key):
            return None
        t0 = time.perf_counter()
        path = self.path(ns, key)
        least = sum(len(b) for b in into)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                why, crc = self._check(os.pread(fd, HEADER.size, 0), size, ns, key, least)
                if why is None:
                    got = os.preadv(fd, into, HEADER.size)
                    tail = os.pread(fd, size - HEADER.size - least, HEADER.size + least)
                    if got + len(tail) != size - HEADER.size:
                        why = f"changed while read ({got + len(tail)} payload bytes of {size - HEADER.size})"
                    else:
                        c = 0
                        for b in into:
                            c = zlib.crc32(b, c)
                        if zlib.crc32(tail, c) != crc:
                            why = "fails its checksum"
            finally:
                os.close(fd)
        except FileNotFoundError:  # deleted meanwhile (another process's budget): a miss
            self._forget(ns, key)
            return None
        except OSError as e:
            why = f"cannot be read ({e})"
        if why is not None:
            self.reject(ns, key, why)
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            if (ns, key) in self._files:
                self._files.move_to_end((ns, key))
        self.stats.read += 1
        self.stats.read_s += time.perf_counter() - t0
        return tail

    def _check(self, head: bytes, size: int, ns: bytes, key: bytes, least: int) -> tuple[str | None, int]:
        """(what is wrong with the header of a file of `size` bytes or None, the payload's CRC it states)."""
        if len(head) < HEADER.size:
            return f"is truncated ({size} bytes, the header alone is {HEADER.size})", 0
        magic, version, f_ns, f_key, length, crc = HEADER.unpack(head)
        why = ("is not a page file" if magic != MAGIC else
               f"has format version {version}, this specserve reads {self.version}" if version != self.version else
               "was written for another model or KV layout" if f_ns != ns else
               "holds another page than its name says" if f_key != key else
               f"is truncated or padded ({size - HEADER.size} payload bytes, its header says {length})"
               if size != HEADER.size + length else
               f"holds {length} payload bytes, a page of this layout {least} at least" if length < least else None)
        return why, crc

    # ---- writing ----
    def put(self, ns: bytes, key: bytes, parts: list[Part]) -> bool:
        """Queue the page (payload: `parts` back to back, tensors as their raw bytes); False if skipped."""
        n = sum(len(p) if isinstance(p, bytes) else p.numel() * p.element_size() for p in parts)
        with self._lock:
            if self._closed or (ns, key) in self._files or (ns, key) in self._queued:
                return False
            if self._pending + n > MAX_PENDING:
                self.stats.dropped += 1
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("prefix cache dir: %d MiB of pages wait to be written; pages past that are not "
                                "kept on disk (the disk is slower than prefill)", MAX_PENDING >> 20)
                return False
            self._pending += n
            self._queued.add((ns, key))
        self._jobs.put((ns, key, parts, n))
        return True

    def _writer(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                try:
                    self._write(*job)
                except Exception as e:  # noqa: BLE001 - the writer must outlive any page (flush waits on it)
                    self.stats.dropped += 1
                    log.warning("prefix cache dir: cannot write a page (%s)", e)
            finally:
                if job is not None:
                    with self._lock:
                        self._pending -= job[3]
                        self._queued.discard(job[:2])
                        self._discarded.discard(job[:2])
                self._jobs.task_done()

    def _write(self, ns: bytes, key: bytes, parts: list[Part], n: int) -> None:
        t0 = time.perf_counter()
        bufs = _buffers(parts)
        crc = 0
        for b in bufs:
            crc = zlib.crc32(b, crc)
        path = self.path(ns, key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{key.hex()}.{os.getpid()}.{id(self):x}.tmp")  # one name per writer
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, self.version, ns, key, n, crc))
            for b in bufs:
                f.write(b)
        with self._lock:
            if (ns, key) in self._discarded:
                victims = [tmp]
            else:
                os.replace(tmp, path)  # NOTE: under the lock, so a discard either sees the file or stops it
                self._files[(ns, key)] = HEADER.size + n
                self.total += HEADER.size + n
                victims = self._over_budget()
                self.stats.written += 1
                self.stats.written_bytes += HEADER.size + n
        for p in victims:
            _unlink(p)
        self.stats.write_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued page is written."""
        self._jobs.join()

    def close(self) -> None:
        """Write what is queued, stop the writer thread; later puts are refused."""
        with self._lock:
            self._closed = True
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        atexit.unregister(self.close)


def _hex(name: str, nbytes: int) -> bytes | None:
    if len(name) != 2 * nbytes:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass
