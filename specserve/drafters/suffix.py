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
FORMAT = 2  # 2: buckets from the hash's high bits


_MIX = 0x9E3779B97F4A7C15


def _anchor_hash(toks: list[int]) -> int:
    """The hash of ANCHOR tokens (as `_anchor_hashes` computes it at every position)."""
    h = 0
    for t in toks:
        h = (h * _P + int(t) + 1) & _M64
    return (h * _MIX) & _M64


def _anchor_hashes(ids: np.ndarray) -> np.ndarray:
    """_anchor_hash of ids[i - ANCHOR + 1 .. i] for every i ≥ ANCHOR − 1 (uint64 arithmetic wraps as & _M64)."""
    n = len(ids) - ANCHOR + 1
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(ANCHOR):
            h = h * np.uint64(_P) + ids[j : j + n].astype(np.uint64) + np.uint64(1)
        return h * np.uint64(_MIX)


class SuffixIndex:
    def __init__(self, capacity: int, fingerprint: str = "") -> None:
        self.capacity, self.fingerprint = capacity, fingerprint
        self.tokens = np.full(capacity, _SEP, np.int32)
        self.prev = np.full(capacity, -1, np.int64)
        self.bits = max(4, (2 * capacity - 1).bit_length())  # ≥ 2 × capacity buckets: short chains
        self.head = np.full(1 << self.bits, -1, np.int64)
        self.end = 0  # absolute position one past the last token written
        self.documents = 0
        self.dirty = False  # changed since the last save

    def clear(self) -> None:
        """Forget every document (benchmarks: a run of prompts answered before starts cold)."""
        self.tokens.fill(_SEP)
        self.prev.fill(-1)
        self.head.fill(-1)
        self.end = self.documents = 0
        self.dirty = True

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.prev.nbytes + self.head.nbytes

    def _bucket(self, h: int | np.ndarray) -> int | np.ndarray:
        return h >> (64 - self.bits) if isinstance(h, int) else (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def add(self, ids: list[int]) -> None:
        """Index one document (a prompt, or a finished request's output after its prompt's last tokens). A document
        longer than the ring keeps its end."""
        ids = ids[-(self.capacity - 1):]
        if len(ids) <= ANCHOR:
            return
        arr, cap = np.asarray(ids, np.int64), self.capacity
        self.tokens[(self.end + np.arange(len(arr))) % cap] = arr
        # chain every position with a whole anchor under its bucket, in position order: sorted by (bucket,
        # position), each links to the one before it in its bucket, the first to the bucket's old head
        pos = self.end + np.arange(ANCHOR - 1, len(arr))
        b = self._bucket(_anchor_hashes(arr))
        order = np.lexsort((pos, b))
        bs, ps = b[order], pos[order]
        new = np.r_[True, bs[1:] != bs[:-1]]
        links = np.r_[-1, ps[:-1]]
        links[new] = self.head[bs[new]]
        self.prev[ps % cap] = links
        self.head[bs[np.r_[new[1:], True]]] = ps[np.r_[new[1:], True]]
        self.end += len(arr)
        self.tokens[self.end % cap] = _SEP
        self.prev[self.end % cap] = -1
        self.end += 1
        self.documents += 1
        self.dirty = True

    def match(self, ctx: list[int]) -> tuple[int, list[int]]:
        """(the longest match length, the positions ending a match of that length, most recent first)."""
        if len(ctx) < ANCHOR or self.end == 0:
            return 0, []
        lo, cap = max(0, self.end - self.capacity), self.capacity
        cands, p = [], int(self.head[self._bucket(_anchor_hash(ctx[-ANCHOR:]))])
        while p >= lo and len(cands) < MAX_CANDIDATES:  # NOTE: a chain runs to older positions: stop at the evicted
            cands.append(p)
            p = int(self.prev[p % cap])
        if not cands:
            return 0, []
        # every candidate's match length at once: the tokens ending at each, against the context's last ones
        m = min(MAX_MATCH, len(ctx))
        pos = np.asarray(cands, np.int64)[:, None] - np.arange(m)
        same = (self.tokens[pos % cap] == np.asarray(ctx[-m:][::-1], np.int64)) & (pos >= lo)
        lengths = np.where(same.all(1), m, same.argmin(1))
        nxt = np.asarray(cands, np.int64) + 1
        ok = (lengths >= ANCHOR) & (nxt < self.end) & (self.tokens[nxt % cap] != _SEP)
        if not ok.any():
            return 0, []
        best = int(lengths[ok].max())
        return best, [c for c, n, o in zip(cands, lengths.tolist(), ok.tolist()) if o and n == best]

    def draft(self, ctx: list[int], k: int) -> list[int]:
        """Up to k tokens continuing `ctx` as the past requests that match it longest continued it."""
        return self.draft_match(ctx, k)[0]

    def draft_match(self, ctx: list[int], k: int) -> tuple[list[int], int]:
        """`draft`, and the length of the match it continues."""
        best, voters = self.match(ctx)
        depth = min(k, int(DEPTH_PER_MATCH * best))
        out: list[int] = []
        toks = self.tokens
        while voters and len(out) < depth:
            nxt: dict[int, list[int]] = {}
            for p in voters:  # NOTE: live: a voter's successor is newer than the voter
                q = p + 1
                if q < self.end and (t := int(toks[q % self.capacity])) != _SEP:
                    nxt.setdefault(t, []).append(q)
            if not nxt:
                break
            tok, follow = max(nxt.items(), key=lambda kv: len(kv[1]))
            if len(follow) < MIN_SHARE * len(voters):
                break
            out.append(tok)
            voters = follow
        return out, best

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
                meta, fp = z["meta"].tolist(), str(z["fingerprint"])  # [format, capacity, end, documents, anchor]
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
