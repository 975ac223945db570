"""Continuous batching with chunked prefill and preemption by recompute.

Each step: every running request past prefill decodes (its page table grown to hold its
verify window); then prefill chunks fill `max_prefill_tokens`, partial prefills first, then new
requests while fewer than `max_running_requests` run (hybrid targets: and a recurrent-state slot is
free). Out of pages → the newest request is preempted (its pages and state slot return; it recomputes
later); a new request waits. With the prefix cache, a request admitted with no KV starts past its longest
cached prefix (engine/prefix.py): those tokens cost no prefill budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..cache.kv_pool import KVPool, OutOfPages
from ..cache.state_pool import StatePool
from ..core import Request, Status
from .prefix import PrefixCaching


@dataclass
class Batch:
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this chunk)
    decodes: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, kv: KVPool, max_prefill_tokens: int, max_running_requests: int,
                 lookahead: Callable[[Request], int], states: StatePool | None = None,
                 prefix: PrefixCaching | None = None) -> None:
        self.kv, self.states, self.prefix = kv, states, prefix
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running_requests
        self.lookahead = lookahead  # per request: draft tokens a verify window may add beyond the last token
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.on_release: Callable[[Request], None] | None = None  # drafter state of a preempted request

    def check_prompt(self, prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
        """A prompt that could never run: ValueError naming what is wrong (the server's HTTP 400)."""
        if not prompt_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
        if len(prompt_ids) >= max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate in the context of "
                             f"{max_model_len} tokens (--max-model-len)")
        if self.kv.pages_needed([], len(prompt_ids) + 1) > self.kv.allocator.num_pages:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens do not fit the KV pool "
                             f"({self.kv.num_slots} slots); raise --kv-cache-memory")

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def batch_ahead(self) -> int:
        """The decode batch the running requests are heading for: those running, and those waiting to be admitted."""
        return min(len(self.running) + len(self.waiting), self.max_running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for q in (self.running, self.waiting):
            for r in q:
                if r.request_id == request_id:
                    q.remove(r)
                    self.release(r)
                    return r
        return None

    def release(self, req: Request) -> None:
        """Return a request's pages and state slot; called at finish, abort and preemption. Its committed
        full pages stay cached (a failed request's are not kept: its KV may be what failed it)."""
        failed = req.finish_reason == "error"
        if self.prefix is not None and not failed:
            self.prefix.insert(req)
        self.kv.release(req.page_table, failed)
        req.committed_len = req.num_cached_pages = 0
        if self.states is not None:
            self.states.free(req.state_slot)
            req.state_slot = None

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.release(req)

    def _preempt_newest(self, keep: Request) -> bool:
        victims = [r for r in self.running if r is not keep]
        if not victims:
            return False
        victim = victims[-1]
        self.running.remove(victim)
        self.release(victim)
        if self.on_release:
            self.on_release(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        return True

    def schedule(self) -> Batch:
        batch = Batch()
        for req in list(self.running):
            if req.in_prefill or req not in self.running:
                continue
            while True:
                try:
                    self.kv.ensure(req.page_table, req.seq_len + self.lookahead(req))
                    batch.decodes.append(req)
                    break
                except OutOfPages:
                    if not self._preempt_newest(keep=req):
                        break  # alone and still short: only the lookahead is short; see below
            if req not in batch.decodes and req in self.running:
                try:  # decode without a verify window rather than stall
                    self.kv.ensure(req.page_table, req.seq_len)
                    batch.decodes.append(req)
                except OutOfPages:
                    pass
        batch.decodes = [r for r in batch.decodes if r in self.running]
        budget = self.max_prefill_tokens
        for req in [r for r in self.running if r.in_prefill]:
            budget -= self._try_prefill(req, budget, batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            used = self._try_prefill(req, budget, batch)
            if used == 0:
                break  # no pages: wait for running requests to finish
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= used
        if batch.empty and self.running and self._preempt_newest(keep=self.running[0]):
            return self.schedule()  # partial prefills filled the pool: the oldest goes on alone
        return batch

    def _try_prefill(self, req: Request, budget: int, batch: Batch) -> int:
        if budget <= 0:
            return 0
        fresh_slot = self.states is not None and req.state_slot is None
        if fresh_slot and not self.states.num_free:
            return 0  # admitted only with a recurrent-state slot
        admitting = self.prefix is not None and not req.page_table  # no KV yet: new, or preempted and back
        hit = self.prefix.admit(req) if admitting else 0
        n = min(req.prefill_target - req.committed_len, budget)
        if n <= 0:
            return 0
        try:
            self.kv.ensure(req.page_table, req.committed_len + n)
        except OutOfPages:
            if hit:
                self.prefix.undo(req, self.kv)
                if self.on_release:
                    self.on_release(req)  # the drafter's share of the hit
            return 0
        if fresh_slot:
            req.state_slot = self.states.alloc()
        if admitting:
            self.prefix.admitted(req, hit)
        batch.prefills.append((req, n))
        return n
