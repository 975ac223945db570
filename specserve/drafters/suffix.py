"""A suffix index over past requests: the prompts and outputs of requests that finished, in a bounded ring of
tokens, searched for the longest suffix of a running request's context (SuffixDecoding's idea: agent loops and
repeated tasks write what earlier requests wrote).

Layout: `tokens` is a ring of `capacity` slots holding absolute positions [end − capacity, end); a document
(one request) ends with a separator. Every position p whose last ANCHOR tokens lie in one document is chained
under the hash of those tokens: `head[bucket]` is the most recent such p, `prev[p % capacity]` the one before.
A chain runs from recent to old, so it stops at the first position the ring has overwritten: evicted entries
are never read and need no cleanup. A hash collision only costs a comparison: a match is measured on the
tokens themselves.

Drafting (`draft`): of the MAX_CANDIDATES most recent occurrences of the context's last ANCHOR tokens, those
whose match with the context is longest (up to MAX_MATCH tokens) vote token by token on the continuation; a
position is drafted while its majority keeps at least MIN_SHARE of the voters and the depth stays within
DEPTH_PER_MATCH × the match length (SuffixDecoding's adaptive depth: a long match earns a long draft).
NOTE: lossless like every drafter: its tokens are verified by the target (one-hot).

Persistence (`save`/`load`): one .npz (its zip CRCs catch corruption) with the vocabulary fingerprint it was
built under; a file that does not load, or was built for another vocabulary or layout, is ignored with a
warning.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger("specserve.drafters")

ANCHOR = 4  # tokens a match starts from (shorter ones match noise in a large corpus)
MAX_MATCH = 32  # longest match measured
MAX_CANDIDATES = 16  # occurrences of the anchor examined, most recent first
MIN_SHARE = 0.5  # a drafted token keeps at least this share of the voters that reached it
DEPTH_PER_MATCH = 1.0  # draft depth ≤ this × match length
_SEP = -1
_P = 1_000_003
_M64 = (1 << 64) - 1
FORMAT = 1


def _anchor_hash(toks: list[int] | np.ndarray) -> int:
    h = 0
    for t in toks:
        h = (h * _P + int(t) + 1) & _M64
    return (h * 0x9E3779B97F4A7C15) & _M64


class SuffixIndex:
    def __init__(self, capacity: int, fingerprint: str = "") -> None:
        self.capacity, self.fingerprint = capacity, fingerprint
        self.tokens = np.full(capacity, _SEP, np.int32)
        self.prev = np.full(capacity, -1, np.int64)
        self.buckets = 1 << max(4, (2 * capacity - 1).bit_length())  # ≥ 2 × capacity: short chains
        self.head = np.full(self.buckets, -1, np.int64)
        self.end = 0  # absolute position one past the last token written
        self.documents = 0
        self.dirty = False  # changed since the last save

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.prev.nbytes + self.head.nbytes

    def _live(self, p: int) -> bool:
        return max(0, self.end - self.capacity) <= p < self.end

    def _tok(self, p: int) -> int:
        return int(self.tokens[p % self.capacity])

    def add(self, ids: list[int]) -> None:
        """Index one document (a finished request's prompt and output). A document longer than the ring keeps its
        end."""
        ids = ids[-(self.capacity - 1):]
        if len(ids) <= ANCHOR:
            return
        for i, t in enumerate(ids):
            p = self.end + i
            self.tokens[p % self.capacity] = t
            if i >= ANCHOR - 1:
                b = _anchor_hash(ids[i - ANCHOR + 1 : i + 1]) & (self.buckets - 1)
                self.prev[p % self.capacity] = self.head[b]
                self.head[b] = p
        self.end += len(ids)
        self.tokens[self.end % self.capacity] = _SEP
        self.prev[self.end % self.capacity] = -1
        self.end += 1
        self.documents += 1
        self.dirty = True

    def _match_len(self, ctx: list[int], p: int) -> int:
        """How many of the context's last tokens equal the tokens ending at position p (≤ MAX_MATCH)."""
        n = 0
        lo = max(0, self.end - self.capacity)
        while n < MAX_MATCH and n < len(ctx) and p - n >= lo:
            t = self._tok(p - n)
            if t != ctx[-1 - n]:
                break
            n += 1
        return n

    def match(self, ctx: list[int]) -> tuple[int, list[int]]:
        """(the longest match length, the positions ending a match of that length, most recent first)."""
        if len(ctx) < ANCHOR or self.end == 0:
            return 0, []
        p = int(self.head[_anchor_hash(ctx[-ANCHOR:]) & (self.buckets - 1)])
        best, ends = 0, []
        for _ in range(MAX_CANDIDATES):
            if p < 0 or not self._live(p):
                break
            n = self._match_len(ctx, p)
            if n >= ANCHOR and p + 1 < self.end and self._tok(p + 1) != _SEP:
                if n > best:
                    best, ends = n, [p]
                elif n == best:
                    ends.append(p)
            p = int(self.prev[p % self.capacity])
        return best, ends

    def draft(self, ctx: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `ctx` as the past requests that match it longest continued it."""
        best, voters = self.match(ctx)
        depth = min(k, int(DEPTH_PER_MATCH * best))
        out: list[int] = []
        while voters and len(out) < depth:
            nxt: dict[int, list[int]] = {}
            for p in voters:
                q = p + 1
                if q < self.end and self._live(q) and (t := self._tok(q)) != _SEP:
                    nxt.setdefault(t, []).append(q)
            if not nxt:
                break
            tok, follow = max(nxt.items(), key=lambda kv: len(kv[1]))
            if len(follow) < MIN_SHARE * len(voters):
                break
            out.append(tok)
            voters = follow
        return out

    # ---- persistence ----
    def save(self, path: Path) -> None:
        """Atomically: a restart never reads a half-written file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, tokens=self.tokens, prev=self.prev, head=self.head,
                     meta=np.array([FORMAT, self.capacity, self.end, self.documents, ANCHOR], np.int64),
                     fingerprint=np.array(self.fingerprint))
        os.replace(tmp, path)
        self.dirty = False

    @classmethod
    def load(cls, path: Path, capacity: int, fingerprint: str) -> "SuffixIndex":
        """The index saved at `path` if it was built for this vocabulary and ring size, else an empty one."""
        idx = cls(capacity, fingerprint)
        if not path.exists():
            return idx
        try:
            with np.load(path, allow_pickle=False) as z:
                meta, fp = z["meta"].tolist(), str(z["fingerprint"])
                if meta[0] != FORMAT or meta[1] != capacity or meta[4] != ANCHOR or fp != fingerprint:
                    log.warning("suffix index %s was built for another vocabulary or layout: starting empty", path)
                    return idx
                tokens, prev, head = z["tokens"], z["prev"], z["head"]
            if tokens.shape != idx.tokens.shape or prev.shape != idx.prev.shape or head.shape != idx.head.shape:
                raise ValueError("array shapes do not match the header")
            end = int(meta[2])
            if end < 0 or int(head.max(initial=-1)) >= end or int(prev.max(initial=-1)) >= end:
                raise ValueError("positions past the end")
        except Exception as e:  # noqa: BLE001 - a damaged file is never trusted, whatever it raises
            log.warning("suffix index %s is unreadable (%s): starting empty", path, e)
            return idx
        idx.tokens, idx.prev, idx.head = tokens.astype(np.int32), prev.astype(np.int64), head.astype(np.int64)
        idx.end, idx.documents = end, int(meta[3])
        return idx
