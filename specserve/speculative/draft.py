"""DRAFT stage: which source drafts for each decode request this step, how many tokens, and the proposal cut
to what is verified. It owns the plan as the commit stage owns what is committed:

  plan     the drafter names each request's source (from committed tokens only), the window policy fills
           in the windows, within what pages, max_tokens and the context allow (`limit`)
  propose  the drafter drafts under the plan; a request whose propose raises fails alone
  cut      the policy keeps the prefix of each proposal worth verifying; grammar-forced drafts join after
           every cut (speculative/grammar.py), credited to their own source (`FORCED`), not the drafter's

A draft model is turned off per request where the policy says its forwards do not pay (`draft_pays`):
it neither prefills nor drafts for that request, whose source is then one without a forward (HYBRID: its
lookups, the suffix index, the n-gram table). Nor is it on for a request whose tokens left to generate (max_tokens, within the context) do not pay
for the draft model's forward over its context, as the policy prices it (`prefill_pays`; `cost`: on the measured
curves, so a long prompt asking for a short answer skips the draft's prefill). It is back on once drafting pays
again at the batch size, for a request that passes that test.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.kv_pool import KVPool
from ..core import DraftPlan, Proposal, Request, SpecStats
from ..cost.policy import WindowPolicy
from ..cost.windows import DEFAULT_SOURCE
from ..drafters.base import Drafter
from ..runtime.isolate import isolate
from .grammar import cut_to_grammar, forced_drafts, with_forced

FORCED = "grammar"  # the draft source of grammar-forced tokens


@dataclass
class Drafted:
    """A decode batch after the draft stage: the requests still running, their plan and proposals (cut to the
    windows to verify), how many requests drafted, and the seconds the drafter's propose took (what the `cost`
    policy learns drafting costs)."""

    reqs: list[Request]
    plan: DraftPlan
    proposal: Proposal
    drafted: int
    seconds: float


class DraftStage:
    def __init__(self, drafter: Drafter | None, policy: WindowPolicy, kv: KVPool, num_draft_tokens: int,
                 forced_draft_tokens: int, max_model_len: int, stats: SpecStats,
                 fail: Callable[[Request, str, Exception], None]) -> None:
        self.drafter, self.policy, self.kv = drafter, policy, kv
        self.num_draft_tokens, self.forced_draft_tokens = num_draft_tokens, forced_draft_tokens
        self.max_model_len, self.stats, self.fail = max_model_len, stats, fail
        self.model_off: set[str] = set()  # request ids the draft model neither prefills nor drafts for

    def lookahead(self, r: Request) -> int:
        """Draft slots the scheduler reserves beyond r's last token."""
        return max(self.forced_draft_tokens, self.num_draft_tokens) if r.grammar is not None else self.num_draft_tokens

    def limit(self, r: Request, k: int | None = None) -> int:
        """The most drafts r can verify (k, default K): the pages the scheduler reserved, max_tokens, the context."""
        room = len(r.page_table) * self.kv.page_size - r.seq_len
        left = min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.seq_len) - 1
        return max(0, min(self.num_draft_tokens if k is None else k, room, left))

    # ---- prefill ----
    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor | None],
                batch_ahead: int) -> None:
        """The drafter builds its state for target prefill chunks (request, start, tokens) heading for a
        `batch_ahead`-request decode; a draft model skips the requests it does not pay for."""
        if self.drafter is None:
            return
        if chunks and not self.policy.draft_pays(batch_ahead, self.num_draft_tokens):
            self.model_off.update(r.request_id for r, _, _ in chunks)
        # NOTE: only a draft model's prefill is priced: prefill_pays is True for drafters without one
        self.model_off.update(r.request_id for r, _, _ in chunks if not self._catch_up_pays(r))
        items = [(c, x) for c, x in zip(chunks, feats) if c[0].request_id not in self.model_off]
        with_feats = bool(self.drafter.aux_layers)
        isolate(lambda it: self.drafter.prefill([c for c, _ in it], [x for _, x in it] if with_feats else None)
                or [None] * len(it), items, lambda it, e: self.fail(it[0][0], "drafter prefill", e))

    # ---- decode ----
    def run(self, reqs: list[Request]) -> Drafted:
        plan = self.plan(reqs)
        forced = forced_drafts(reqs, plan.windows, lambda r: self.limit(r, self.forced_draft_tokens))
        plan.windows = [0 if r.request_id in forced else w for r, w in zip(reqs, plan.windows)]  # skip the drafter
        # NOTE: forced tokens are always accepted: credited to a source of their own, never to the drafter's
        plan.sources = [FORCED if r.request_id in forced else s for r, s in zip(reqs, plan.sources)]
        proposal = Proposal.empty(len(reqs))
        t0 = time.perf_counter()
        if self.drafter is not None and any(plan.windows):
            done = isolate(self._propose, list(zip(reqs, plan.split())), lambda it, e: self.fail(it[0], "draft", e))
            reqs, plan = [r for (r, _), _ in done], DraftPlan.join([p for (_, p), _ in done])
            proposal = Proposal.join([p for _, p in done]) if done else Proposal.empty(0)
        seconds = time.perf_counter() - t0
        drafted = sum(1 for d in proposal.tokens if d)
        proposal = proposal.truncate(self.policy.cut(reqs, plan, proposal))
        proposal = cut_to_grammar(reqs, with_forced(reqs, proposal, forced))  # after every window cut
        for r, d in zip(reqs, proposal.tokens):
            r.spec_decode_steps += 1
            self.stats.record_window(len(d))
        return Drafted(reqs, plan, proposal, drafted, seconds)

    def plan(self, reqs: list[Request]) -> DraftPlan:
        """Each request's source and window (all 0 without a drafter, or when the policy idles this step)."""
        d = self.drafter
        if d is None or self.policy.idle(len(reqs)):
            return DraftPlan([d.sources[-1] if d else DEFAULT_SOURCE] * len(reqs), [0] * len(reqs))
        self._model_back(reqs)
        off = [r.request_id in self.model_off for r in reqs]
        # NOTE: a request the draft model is off for drafts from a source without a forward, and not at all from a
        # drafter whose only source is the model
        sources = [d.draft_source(r, model=not o) for r, o in zip(reqs, off)]
        limits = [0 if o and len(d.sources) == 1 else self.limit(r) for r, o in zip(reqs, off)]
        plan = DraftPlan(sources, limits)
        plan.windows = self.policy.plan(reqs, plan)
        return plan

    def _catch_up_pays(self, r: Request) -> bool:
        """Whether the policy prices a draft model's forward over r's whole context (its prompt at admission) as
        paid for by the tokens r may still generate (max_tokens, within the context)."""
        context = len(r.prompt_ids) + len(r.output_ids)
        return self.policy.prefill_pays(context, min(r.params.max_tokens - len(r.output_ids),
                                                     self.max_model_len - context))

    def _model_back(self, reqs: list[Request]) -> None:
        back = [r.request_id for r in reqs if r.request_id in self.model_off and self._catch_up_pays(r)]
        if back and self.policy.draft_pays(len(reqs), self.num_draft_tokens):
            self.model_off.difference_update(back)

    def _propose(self, items: list[tuple[Request, DraftPlan]]) -> list[Proposal]:
        """One propose over `items`, retry-safe: a raising batch leaves every request's generator as it
        was, so a seeded neighbour retried alone draws the drafts it draws alone."""
        rng = [(r.generator, r.generator.get_state()) for r, _ in items if r.generator is not None]
        try:
            return self.drafter.propose([r for r, _ in items], DraftPlan.join([p for _, p in items])).split()
        except Exception:
            for gen, state in rng:
                gen.set_state(state)
            raise

    def release(self, r: Request) -> None:
        self.model_off.discard(r.request_id)
        if self.drafter is not None:
            self.drafter.release(r)
        self.policy.release(r.request_id)
