"""The draft sources that cost no forward, cheapest first: "lookup", the request's own context (prompt lookup),
then "suffix", the suffix index over requests that finished before (suffix.py). NGRAM and HYBRID draft from these
before their table or model; the `cost` policy gates and prices each source on its own measured acceptance.

Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix of the context
(max_match down to min_match tokens). `ngram_lookup` re-reads the context (the definition); `NgramIndex` answers
the same per request from an index it extends with the tokens committed since its last call (O(max_match) per step
instead of a scan of the context: 50 µs per request and step at 300 tokens, a few % of a batch-16 step).

The index learns each request's prompt at its first decode step (past the prefix-cache hit, which earlier requests
already wrote) and its output when it finishes; an error or a preemption adds no output. With --prefix-cache-dir it is saved
there (in idle time and at shutdown) and reloaded at start, keyed by the vocabulary fingerprint.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..core import Request
from .context import DrafterContext
from .draft_vocab import tokenizer_fingerprint
from .suffix import MAX_MATCH, SuffixIndex

SAVE_INTERVAL = 30.0  # seconds between saves in idle time (a 1M-token index is ~28 MB)


def ngram_lookup(ids: list[int], min_match: int, max_match: int, k: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix."""
    n = len(ids)
    if k <= 0:
        return []
    for m in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = ids[n - m :]
        # scan right to left for the most recent earlier occurrence (not the suffix itself)
        for start in range(n - m - 1, -1, -1):
            if ids[start : start + m] == suffix:
                follow = ids[start + m : start + m + k]
                if follow:
                    return follow
    return []


class NgramIndex:
    """One request's lookup index: per match length m, every m-gram that has a continuation → the end of its
    most recent occurrence. NOTE: lookup(ids, k) == ngram_lookup(ids, min_match, max_match, k) for any ids
    that extend the ids of the previous call (tested); a context that is not an extension is re-indexed."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.lengths = range(max_match, min_match - 1, -1)  # longest first
        self._reset()

    def _reset(self) -> None:
        self.ends: dict[int, dict[tuple[int, ...], int]] = {m: {} for m in self.lengths}
        self.seen: list[int] = []  # the context indexed so far

    def lookup(self, ids: list[int], k: int) -> list[int]:
        n, old = len(ids), len(self.seen)
        if n < old or ids[:old] != self.seen:
            self._reset()
            old = 0
        for e in range(max(old, 1), n):  # m-grams ending at e have a continuation ids[e]
            for m, ends in self.ends.items():
                if e >= m:
                    ends[tuple(ids[e - m : e])] = e
        self.seen = ids
        if k <= 0:
            return []
        for m in self.lengths:
            e = self.ends[m].get(tuple(ids[n - m :])) if m <= n - 1 else None
            if e is not None:
                return ids[e : e + k]
        return []


class RequestLookups:
    """Prompt lookup per request: one NgramIndex each, made at its first lookup, dropped at release."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match
        self.index: dict[str, NgramIndex] = {}

    def __call__(self, req: Request, k: int) -> list[int]:
        idx = self.index.get(req.request_id)
        if idx is None:
            idx = self.index[req.request_id] = NgramIndex(self.min_match, self.max_match)
        return idx.lookup(req.all_ids, k)

    def release(self, req: Request) -> None:
        self.index.pop(req.request_id, None)


class Lookups:
    def __init__(self, own: RequestLookups, index: SuffixIndex | None = None, path: Path | None = None) -> None:
        self.own, self.index, self.path = own, index, path
        self.names: tuple[str, ...] = ("lookup", "suffix") if index is not None else ("lookup",)
        self._saved = time.monotonic()
        self._match: dict[str, tuple[int, list[int], int]] = {}  # request id → (context length, suffix draft, match)
        self._indexed: set[str] = set()  # requests whose prompt is in the index

    def source(self, req: Request) -> str | None:
        """The source with a continuation for req's committed context, or None: the suffix index where it matches
        longer than prompt lookup can (a long match picks the right one of a repeated phrase's continuations),
        else prompt lookup, else the suffix index."""
        suffix, matched = self._suffix(req)
        if suffix and matched > self.own.max_match:
            return "suffix"
        if self.own(req, 1):
            return "lookup"
        return "suffix" if suffix else None

    def draft(self, req: Request, source: str, k: int) -> list[int]:
        return self.own(req, k) if source == "lookup" else self._suffix(req)[0][:k]

    def _suffix(self, req: Request) -> tuple[list[int], int]:
        """The index's draft at its full depth and the match it continues, walked once per step (`source` asks,
        `draft` takes a prefix). A request's prompt joins the index here, at its first decode step, so requests
        running side by side (and the request itself) draft from each other's prompts."""
        if self.index is None:
            return [], 0
        if req.request_id not in self._indexed:
            self._indexed.add(req.request_id)
            self.index.add(req.prompt_ids[req.cached_tokens or 0:])
        got = self._match.get(req.request_id)
        if got is None or got[0] != req.seq_len:
            got = self._match[req.request_id] = (req.seq_len, *self.index.draft_match(req.all_ids, MAX_MATCH))
        return got[1], got[2]

    def release(self, req: Request) -> None:
        """Forget req's lookups; a request that finished (not failed, not preempted) adds its output, after its
        prompt's last tokens (the context a later request matches it from), or whole when its prompt never joined
        (past its prefix-cache hit: the request that cached those pages added them)."""
        self.own.release(req)
        self._match.pop(req.request_id, None)
        if self.index is None or req.finish_reason is None:
            return
        admitted = req.request_id in self._indexed
        self._indexed.discard(req.request_id)
        if req.finish_reason != "error":
            head = req.prompt_ids[-MAX_MATCH:] if admitted else req.prompt_ids[req.cached_tokens or 0:]
            self.index.add(head + req.output_ids)

    def save(self, now: bool = False) -> None:
        """Write the index where it persists if it changed: at most every SAVE_INTERVAL seconds, unless `now`."""
        idx = self.index
        if idx is None or self.path is None or not idx.dirty:
            return
        if now or time.monotonic() - self._saved >= SAVE_INTERVAL:
            idx.save(self.path)
            self._saved = time.monotonic()


def make_lookups(ctx: DrafterContext, min_match: int, max_match: int) -> Lookups:
    """Prompt lookup, and the suffix index unless --speculative-suffix-cache-tokens is 0."""
    own = RequestLookups(min_match, max_match)
    tokens = ctx.config.value("speculative_suffix_cache_tokens")
    if not tokens:
        return Lookups(own)
    if ctx.config.prefix_cache_dir is None:
        return Lookups(own, SuffixIndex(tokens))
    # NOTE: saved token ids mean something only under the vocabulary they were written with
    fp = f"{tokenizer_fingerprint(ctx.tokenizer) if ctx.tokenizer is not None else 'ids'}-{ctx.target_cfg.vocab_size}"
    path = Path(ctx.config.prefix_cache_dir) / f"suffix-{fp}.npz"
    return Lookups(own, SuffixIndex.load(path, tokens, fp), path)
