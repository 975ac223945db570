"""The engine: owns the target, its KV pool, the scheduler, the drafter and the window policy,
and runs the step.

    step():
        batch = scheduler.schedule()               # admit, chunk prefills, pick decodes
        prefill(batch.prefills)                    # target forward; drafter builds its state
        decode(batch.decodes):
            draft   policy.plan → drafter.propose → policy.cut     (spec/policy.py, drafters/)
            verify  one target forward over every window           (spec/verify.py)
            accept  a lossless rule per request                    (spec/accept.py, spec/rules.py)
            commit  keep path, advance KV, emit, draft state       (spec/commit.py)
Plain decoding is the same step with an empty proposal (window 0). An exception fails only the
requests it concerns: batched calls are retried one request at a time (runtime/isolate.py).
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import replace

import torch

from ..cache.kv_pool import KVPool, parse_memory
from ..cache.state_pool import StatePool
from ..config import EngineConfig
from ..core import AcceptResult, Proposal, Request, SamplingParams, SpecStats, Status
from ..drafters.base import Drafter, create_drafter
from ..drafters.context import DrafterContext, KVBudget
from ..parallel import start_tensor_parallel
from ..grammar.backend import GrammarCompiler
from ..models import LlamaModel, build_model, default_quantization, resolve_dtype, resolve_kv_dtype
from ..spec.accept import accept_request
from ..spec.grammar import cut_to_grammar, forced_drafts, with_forced
from ..spec.commit import AdvanceKV, CommitStage, CommitState, Committed, DraftState, Emit, KeepPath
from ..spec.policy import StepStats, make_policy
from ..spec.resolve import resolve_config, resolve_settings
from ..spec.verify import verify
from ..runtime.isolate import isolate
from ..runtime.output import Emitter
from ..runtime.runner import ModelRunner, split_features
from ..runtime.sampling import request_generator
from .prefix import PrefixCaching
from .scheduler import Scheduler

log = logging.getLogger("specserve")


class Engine:
    def __init__(self, config: EngineConfig, model: LlamaModel | None = None, tokenizer=None) -> None:  # noqa: ANN001
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # NOTE: made concrete first: the drafter, the cost curve's cache key and meta read config.quantization
        if model is None:
            config = replace(config, quantization=default_quantization(config.model, config.dtype, config.quantization))
            model, tokenizer = build_model(config.model, resolve_dtype(config.dtype, config.quantization),
                                           config.quantization, parse_memory(config.kv_cache_memory))
        elif config.quantization == "none":
            config = replace(config, quantization=None)
        self.model, self.tokenizer, self.dtype = model, tokenizer, model.dtype
        mcfg = model.cfg
        self.config = config = resolve_config(config, mcfg)  # AUTO and the default window made concrete
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        budget = KVBudget(parse_memory(config.kv_cache_memory), mcfg, kv_dtype, config.page_size)
        # hybrid targets: one recurrent-state slot per request that may run, reserved before any KV
        self.states = budget.state_pool(mcfg, self.dtype, config.max_running_requests) if mcfg.is_hybrid else None
        self.policy = make_policy(config.speculative_window if config.speculative_algorithm else "fixed", config)
        self.drafter: Drafter | None = None
        #: K, depth, block size, window: resolved once, with the drafter artifact's trained shape
        self.settings = resolve_settings(config, mcfg) if config.speculative_algorithm else None
        if self.settings:  # NOTE: the drafter reserves its pool before the target's is sized
            ctx = DrafterContext(config, model, tokenizer, budget, self.settings, self.policy.floor)
            self.drafter = create_drafter(config.speculative_algorithm, ctx)
        self.tp = start_tensor_parallel(config, mcfg) if config.tp_size > 1 else None
        # NOTE: under TP each rank's pool holds its KV heads only; rank 0's shard is the largest
        kv_cfg = self.tp.model.cfg if self.tp else mcfg
        pages = KVPool.pages_for_budget(kv_cfg, budget.remaining, config.page_size, kv_dtype)
        if pages < 1:
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory!r} is too small for one KV page of this model")
        if self.tp:
            self.kv = self.tp.kv_pool(pages, kv_dtype)
            self.runner = self.tp.runner(self.kv)
        else:
            self.kv = KVPool(mcfg, pages, config.page_size, kv_dtype)
            self.runner = ModelRunner(model, self.kv, self.states)
        # target layers whose hidden states the drafter consumes; () = capture nothing
        self.aux_layers: tuple[int, ...] = self.drafter.aux_layers if self.drafter else ()
        self.num_draft_tokens = self.settings.num_draft_tokens if self.drafter else 0
        # structured output: forced-token drafts may run past the drafter's window (grammar requests only)
        self.forced_draft_tokens = config.grammar_forced_drafts and max(config.grammar_forced_drafts, self.num_draft_tokens)
        # NOTE: hybrid targets do not cache prefixes: their recurrent state at a page boundary is not kept
        self.prefix = None if config.disable_prefix_cache or mcfg.is_hybrid else PrefixCaching(self.kv, self.drafter)
        self.scheduler = Scheduler(self.kv, config.max_prefill_tokens, config.max_running_requests, self._lookahead,
                                   self.states, self.prefix)
        self.scheduler.on_release = self.drafter.release if self.drafter else None
        self.eos_ids = set(mcfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        # A request can never hold more positions than the pool has slots: stop it there ("length")
        # instead of letting it wait forever for pages that can never be freed.
        self.emitter = Emitter(tokenizer, self.eos_ids, min(self.max_model_len, self.kv.num_slots))
        self.stats = SpecStats()
        self.verify_mode = config.speculative_verify_packing
        steps = [KeepPath(self.kv), *([CommitState(self.states)] if self.states else []), AdvanceKV(),
                 Emit(self.emitter, self.stats, self.policy.trials, self._finish)]
        self.commit_stage = CommitStage(steps + ([DraftState(self.drafter)] if self.drafter else []), self._fail)
        if self.drafter:
            self.policy.bind(self.runner, self.drafter)
        self._grammars = GrammarCompiler(config.grammar_backend, self.tokenizer, mcfg.vocab_size, self.eos_ids)
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # failed during the current step
        self._after_prefill = False  # a prefill ran since the last decode step (StepStats.after_prefill)

    def close(self) -> None:
        """Release what outlives the engine object: tensor-parallel worker processes."""
        if self.tp is not None:
            self.tp.close()

    # ---- requests ----
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        params.validate(self.model.cfg.vocab_size)
        self.scheduler.check_prompt(prompt_ids, self.model.cfg.vocab_size, self.max_model_len)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already running")
        grammar = self._grammars.for_params(params)
        req = Request(rid, list(prompt_ids), params, generator=request_generator(params, self._seed_rng),
                      grammar=grammar)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._finish(req, "abort")
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ----
    def step(self) -> list[Request]:
        """One engine iteration; returns the requests that produced tokens or finished in it."""
        batch = self.scheduler.schedule()
        self._failed = []
        touched: list[Request] = []
        if batch.prefills:
            touched += self._prefill(batch.prefills)
            self._after_prefill = True
        if batch.decodes:
            touched += self._decode([r for r in batch.decodes if not r.finished])
        return touched + [r for r in self._failed if r not in touched]

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[Request]:
        aux = tuple(sorted(self.aux_layers))

        def forward(cs: list[tuple[Request, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
            starts = [r.committed_len for r, _ in cs]
            first = [r.committed_len + n == r.prefill_target and not r.output_ids for r, n in cs]
            states = self.states.batch([r.state_slot for r, _ in cs]) if self.states else None
            logits, captured = self.runner.forward(
                [r.page_table for r, _ in cs], starts, [r.all_ids[s : s + n] for (r, n), s in zip(cs, starts)],
                [[n - 1] if f else [] for (_, n), f in zip(cs, first)], aux, states=states)
            if states is not None:  # a prefill chunk is committed whole: its last row's state is final
                for (r, _), rows in zip(cs, states.split([n for _, n in cs])):
                    self.states.write(r.state_slot, rows, 0)
            feats = split_features(captured, self.aux_layers, [n for _, n in cs]) if aux else [None] * len(cs)
            return [(row if f else None, x) for row, f, x in zip(logits, first, feats)]

        done = isolate(forward, chunks, lambda c, e: self._fail_exc(c[0], "prefill", e))
        starts = [r.committed_len for (r, _), _ in done]
        for (r, n), _ in done:
            r.committed_len += n
            if self.prefix is not None:
                self.prefix.insert(r)
        if self.drafter:
            items = [((r, s, n), x) for ((r, n), (_, x)), s in zip(done, starts)]
            self.policy.draft_model_off([c[0] for c, _ in items], self.scheduler.batch_ahead, self.num_draft_tokens)
            isolate(lambda it: self.drafter.prefill([c for c, _ in it], [x for _, x in it] if aux else None)
                    or [None] * len(it), items, lambda it, e: self._fail_exc(it[0][0], "drafter prefill", e))
        firsts = [(r, row) for (r, _), (row, _) in done if row is not None and not r.finished]
        accepted = self._accept([r for r, _ in firsts], Proposal.empty(len(firsts)), [row for _, row in firsts],
                                verified=False)  # the first token: the same accept and commit, no draft
        return [c.req for c in self.commit_stage.run(accepted)]

    def _decode(self, reqs: list[Request]) -> list[Request]:
        t0 = time.perf_counter()
        reqs, proposal, drafted, t_draft = self._draft(reqs)     # DRAFT under the window policy
        reqs, proposal, logits, extras = self._verify(reqs, proposal)  # VERIFY: one target forward
        accepted = self._accept(reqs, proposal, logits, extras)   # ACCEPT: a lossless rule per request
        committed = self.commit_stage.run(accepted)              # COMMIT: keep, advance, emit, draft state
        emitted = sum(c.emitted for c in committed)
        self.policy.observe(StepStats(time.perf_counter() - t0, len(reqs), drafted, emitted, self._after_prefill,
                                      sum(len(t) for t in proposal.tokens), t_draft))
        self._after_prefill = False
        return reqs

    def _lookahead(self, r: Request) -> int:
        """Draft slots the scheduler reserves beyond r's last token."""
        return max(self.forced_draft_tokens, self.num_draft_tokens) if r.grammar is not None else self.num_draft_tokens

    def _limit(self, r: Request, k: int | None = None) -> int:
        """The most drafts r can verify (k, default the drafter's K): the pages the scheduler reserved,
        max_tokens, the context."""
        room = len(r.page_table) * self.kv.page_size - r.seq_len
        left = min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.seq_len) - 1
        return max(0, min(self.num_draft_tokens if k is None else k, room, left))

    def _draft(self, reqs: list[Request]) -> tuple[list[Request], Proposal, int, float]:
        """(requests still running, their proposals cut to the verify windows, requests that drafted, seconds
        the drafter's propose took: the cost of drafting, which the `cost` policy learns)."""
        if self.drafter is None or self.policy.idle(len(reqs)):
            windows = [0] * len(reqs)  # nobody drafts: no draft sources, no plan
        else:
            self.policy.draft_model_back(reqs, self.num_draft_tokens)
            for r in reqs:
                r.draft_source = self.drafter.draft_source(r)
            windows = self.policy.plan(reqs, [self._limit(r) for r in reqs])
        forced = forced_drafts(reqs, windows, lambda r: self._limit(r, self.forced_draft_tokens))
        windows = [0 if r.request_id in forced else w for r, w in zip(reqs, windows)]  # those skip the drafter
        proposal = Proposal.empty(len(reqs))
        t0 = time.perf_counter()
        if self.drafter is not None and any(windows):
            done = isolate(self._propose, list(zip(reqs, windows)), lambda it, e: self._fail_exc(it[0], "draft", e))
            reqs, windows = [r for (r, _), _ in done], [w for (_, w), _ in done]
            proposal = Proposal.join([p for _, p in done]) if done else Proposal.empty(0)
        t_draft = time.perf_counter() - t0
        drafted = sum(1 for d in proposal.tokens if d)
        proposal = proposal.truncate(self.policy.cut(reqs, proposal, windows))
        proposal = cut_to_grammar(reqs, with_forced(reqs, proposal, forced))  # after every window cut
        for r, d in zip(reqs, proposal.tokens):
            r.spec_decode_steps += 1
            self.stats.record_window(len(d))
        return reqs, proposal, drafted, t_draft

    def _propose(self, items: list[tuple[Request, int]]) -> list[Proposal]:
        """One propose over `items`, retry-safe: a raising batch leaves every request's generator as it
        was, so a seeded neighbour retried alone draws the drafts it draws alone."""
        rng = [(r.generator, r.generator.get_state()) for r, _ in items if r.generator is not None]
        try:
            return self.drafter.propose([r for r, _ in items], [w for _, w in items]).split()
        except Exception:
            for gen, state in rng:
                gen.set_state(state)
            raise

    def _verify(self, reqs: list[Request], proposal: Proposal) -> tuple[list[Request], Proposal, list[torch.Tensor], list]:
        """(requests verified, their proposals, raw logits, per request (features, recurrent row states))."""
        def run(it: list[tuple[Request, Proposal]]) -> list[tuple[torch.Tensor, tuple]]:
            logits, feats, states = verify(self.runner, [r for r, _ in it], Proposal.join([p for _, p in it]),
                                           self.verify_mode, self.aux_layers)
            return list(zip(logits, zip(feats or [None] * len(it), states or [None] * len(it))))

        done = isolate(run, list(zip(reqs, proposal.split())), lambda it, e: self._fail_exc(it[0], "verify", e))
        parts = [p for (_, p), _ in done]
        return ([r for (r, _), _ in done], Proposal.join(parts) if parts else Proposal.empty(0),
                [x for _, (x, _) in done], [extra for _, (_, extra) in done])

    def _accept(self, reqs: list[Request], proposal: Proposal, logits: list[torch.Tensor],
                extras: list | None = None, verified: bool = True) -> list[Committed]:
        """A rule per request (spec/accept.py); NaN/Inf or an exception fails that request alone.
        extras: per request (target features, recurrent row states) of its verify rows."""
        out = []
        qs, parents = proposal.q or [None] * len(reqs), proposal.parents or [None] * len(reqs)
        for r, raw, d, q, par, (f, st) in zip(reqs, logits, proposal.tokens, qs, parents,
                                              extras or [(None, None)] * len(reqs)):
            try:
                res: AcceptResult = accept_request(r, raw, d, q, self.config.speculative_accept, par)
            except Exception as e:  # noqa: BLE001
                self._fail_exc(r, "accept", e)
                continue
            if res.error is not None:
                self._fail(r, res.error)
                continue
            out.append(Committed(r, res, raw, f, len(d), verified, st))
        return out

    def _fail_exc(self, r: Request, stage: str, e: Exception) -> None:
        log.warning("request %s failed in %s", r.request_id, stage, exc_info=e)
        self._fail(r, f"internal error in {stage} for this request: {type(e).__name__}: {e}")

    def _fail(self, r: Request, message: str) -> None:
        if r.finished:
            return
        r.error = message
        self._finish(r, "error")
        self._failed.append(r)

    def _finish(self, r: Request, reason: str) -> None:
        r.status, r.finish_reason, r.finish_time = Status.FINISHED, reason, time.perf_counter()
        self.scheduler.finish(r)
        self.emitter.forget(r.request_id)
        if self.drafter:
            self.drafter.release(r)
        self.policy.release(r)
        self.requests.pop(r.request_id, None)
