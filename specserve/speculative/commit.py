"""COMMIT stage: everything that follows acceptance, as an ordered list of steps.

Each request arrives as a `Committed` (its accept result and the verify rows it was judged on) and
goes through `CommitStage.steps` in order:
  KeepPath    truncate the proposal to what is kept: chains and ragged windows keep rows 0..n as
              they are; a tree's accepted path is moved (KV rows and verify rows) right after the root
  CommitState (hybrid targets) the request's state slot takes the recurrent state after the last kept
              row (row n of a chain, the accepted path's last node of a tree): verify never wrote it
  AdvanceKV   committed_len += accepted + 1: the KV of the last token and the accepted drafts is final
  Emit        the tokens one by one through the stop scan (EOS, stop ids/strings, max_tokens,
              context); per-request and engine-wide acceptance stats count only what was emitted
  SlideWindow (every layer sliding, Mistral) the pages wholly behind the window leave the request, after
              Emit: the prefix cache keys a page by its tokens, which Emit has appended by then
  DraftState  drafter.commit with the committed rows' target features (one call for the batch)
A request's grammar matcher advances inside Emit, token by token after the stop scan
(runtime/output.py), so that a grammar's end cuts the run exactly where a stop string would.
Extension point: a later step is a `CommitStep` inserted at its place in `steps`. A step that raises for a request fails that request alone; later steps
skip it (per-request steps run one request at a time; batched steps are retried one by one).
The first token after a prefill passes through the same steps with `verified=False` (nothing was
verified: no KV to advance, no draft state to commit).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.kv_pool import KVPool
from ..cache.state_pool import StatePool
from ..core import AcceptResult, Request, SpecStats, count_per_pos
from ..drafters.base import Drafter
from ..runtime.isolate import isolate
from ..runtime.output import Emitter
from ..models.forward_batch import RowStates
from ..cost.acceptance import AcceptTrials


@dataclass
class Committed:
    """One request's way through the commit steps."""

    req: Request
    result: AcceptResult
    logits: torch.Tensor  # raw target rows [k + 1, V]; after KeepPath the rows of the emitted tokens
    feats: torch.Tensor | None  # target features of the same rows (drafters with aux layers)
    num_draft: int  # draft tokens verified
    source: str = ""  # the draft source that proposed them (the draft stage's plan)
    verified: bool = True
    states: RowStates | None = None  # hybrid targets: recurrent state after each verify row
    emitted: int = 0  # tokens emitted (the stop scan may cut the accepted run)
    failed: bool = False

    @property
    def emitted_drafts(self) -> int:
        return min(self.result.num_accepted, self.emitted)


class CommitStep:
    #: False: `apply` gets one request at a time; True: the whole batch (retried one by one on error)
    batched = False

    def apply(self, items: list[Committed]) -> None:
        raise NotImplementedError


class KeepPath(CommitStep):
    def __init__(self, kv: KVPool) -> None:
        self.kv = kv

    def apply(self, items: list[Committed]) -> None:
        for c in items:
            path = c.result.path
            if path is None:  # chains, ragged windows: the kept rows are already 0..n in order
                continue
            compact_path(self.kv, c.req.page_table, c.req.committed_len, path)
            rows = torch.tensor([0] + [v + 1 for v in path])
            c.logits = c.logits[rows]
            c.feats = None if c.feats is None else c.feats[rows]


class CommitState(CommitStep):
    """The recurrent state of the accepted prefix into the request's slot. NOTE: rows are the verify
    window's (row 0 = the last committed token); rejected rows' states are simply dropped."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool

    def apply(self, items: list[Committed]) -> None:
        for c in items:
            if c.verified and c.states is not None:
                path = c.result.path
                row = (path[-1] + 1 if path else 0) if path is not None else c.result.num_accepted
                self.pool.write(c.req.state_slot, c.states, row)


class AdvanceKV(CommitStep):
    def apply(self, items: list[Committed]) -> None:
        for c in items:
            if c.verified:
                c.req.committed_len += c.result.num_accepted + 1


class Emit(CommitStep):
    def __init__(self, emitter: Emitter, stats: SpecStats, trials: AcceptTrials,
                 finish: Callable[[Request, str], None]) -> None:
        self.emitter, self.stats, self.trials, self.finish = emitter, stats, trials, finish

    def apply(self, items: list[Committed]) -> None:
        for c in items:
            r = c.req
            if r.first_token_time is None:
                r.first_token_time = time.perf_counter()
            c.emitted, reason = self.emitter.emit(r, c.result.tokens, c.logits)
            if c.num_draft:
                n_acc = c.emitted_drafts
                r.spec_verify_ct += 1
                r.spec_draft_tokens += c.num_draft
                r.spec_accepted_tokens += n_acc
                tested = n_acc + (n_acc < c.num_draft)  # a rejection ends a chain
                self.trials.record(r.request_id, c.source, n_acc, tested)
                count_per_pos(r.spec_accepted_per_pos, c.num_draft, n_acc)
                self.stats.record(c.num_draft, n_acc, c.source)
            if reason is not None:
                self.finish(r, reason)


class SlideWindow(CommitStep):
    """A target whose every layer slides never reads a position ≤ committed_len − window again: the pages
    holding only such positions leave the request. `insert` (the prefix cache's) runs first, so those pages
    stay cached whole and a later prompt that shares them still hits exactly."""

    def __init__(self, kv: KVPool, window: int, insert: Callable[[Request], None] | None) -> None:
        self.kv, self.window, self.insert = kv, window, insert

    def apply(self, items: list[Committed]) -> None:
        for c in items:
            if c.verified:
                self.slide(c.req)

    def slide(self, req: Request) -> None:
        if self.insert is not None:
            self.insert(req)
        self.kv.free_below(req.page_table, req.committed_len - self.window + 1)


class DraftState(CommitStep):
    batched = True

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def apply(self, items: list[Committed]) -> None:
        items = [c for c in items if c.verified]
        if items:
            feats = [c.feats for c in items] if items[0].feats is not None else None
            self.drafter.commit([c.req for c in items], [c.emitted_drafts for c in items], feats)


class CommitStage:
    def __init__(self, steps: list[CommitStep], fail: Callable[[Request, str], None]) -> None:
        self.steps, self.fail = steps, fail

    def run(self, items: list[Committed]) -> list[Committed]:
        """Every step over the batch in order; returns the items that did not fail."""
        def failed(c: Committed, e: Exception) -> None:
            c.failed = True
            self.fail(c.req, f"internal error committing this request: {type(e).__name__}: {e}")

        for step in self.steps:
            live = [c for c in items if not c.failed]
            if step.batched:
                isolate(lambda cs: step.apply(cs) or [None] * len(cs), live, failed)  # noqa: B023
                continue
            for c in live:
                try:
                    step.apply([c])
                except Exception as e:  # noqa: BLE001 - fail this request alone
                    failed(c, e)
        return [c for c in items if not c.failed]


def compact_path(kv: KVPool, page_table: list[int], root_pos: int, path: list[int]) -> None:
    """Move the K/V of the accepted tree nodes to consecutive positions after the root.
    NOTE: node path[j] was written at position root_pos + 1 + path[j] ≥ root_pos + 1 + j (topological
    order), so sources are gathered before any destination is written."""
    moves = [(root_pos + 1 + v, root_pos + 1 + j) for j, v in enumerate(path) if v != j]
    if not moves:
        return
    ps = kv.page_size
    slot = lambda p: page_table[p // ps] * ps + p % ps  # noqa: E731
    src = torch.tensor([slot(s) for s, _ in moves])
    dst = torch.tensor([slot(d) for _, d in moves])
    kv.move(src, dst)
