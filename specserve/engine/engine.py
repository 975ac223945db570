"""The engine: holds the parts `build_engine` assembled (engine/build.py) and runs the step.

    step():
        batch = scheduler.schedule()               # admit, chunk prefills, pick decodes
        prefill(batch.prefills)                    # target forward; drafter builds its state
        decode(batch.decodes):
            draft   plan → drafter.propose → cut   (speculative/draft.py: sources, windows, proposal)
            verify  one target forward over every window           (speculative/verify.py)
            accept  a lossless rule per request                    (speculative/accept.py, rules.py)
            commit  keep path, advance KV, emit, draft state       (speculative/commit.py)
Plain decoding is the same step with an empty proposal (window 0). An exception fails only the
requests it concerns: batched calls are retried one request at a time (runtime/isolate.py).
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from ..cache.kv_pool import KVPool, OutOfPages
from ..cache.state_pool import StatePool
from ..config import EngineConfig
from ..core import (AcceptResult, FatalEngineError, Proposal, Request, SamplingParams, SpecStats, Status,
                    TokenLogprob)
from ..cost.policy import StepStats, WindowPolicy
from ..drafters.base import Drafter
from ..drafters.context import SpecSettings
from ..grammar.backend import GrammarCompiler
from ..models import LlamaModel
from ..parallel.driver import TPDriver
from ..runtime.isolate import isolate
from ..runtime.output import Emitter
from ..runtime.runner import ModelRunner, split_features
from ..runtime.sampling import request_generator, token_logprobs
from ..speculative.accept import accept_request
from ..speculative.commit import (AdvanceKV, CommitStage, CommitState, Committed, DraftState, Emit, KeepPath,
                                  SlideWindow)
from ..speculative.draft import DraftStage
from ..speculative.verify import verify
from .prefix import PrefixCaching
from .scheduler import Scheduler

log = logging.getLogger("specserve")

#: under load, the step-cost measurement a first start (or a stale cache) left takes at most this share of the
#: engine's time, one forward between two steps. NOTE: a server loaded from its start never idles, and planned on a
#: two-point guess until it did (the 1.5B/0.5B pair at batch 1: AUTO + draft 1.17x plain instead of 1.36x)
CALIBRATION_SHARE = 0.1


@dataclass
class EngineParts:
    """What `build_engine` assembles, in the order the memory budget is spent: the config made concrete (AUTO,
    the window, the quantization), the target, its recurrent-state pool (hybrid targets), the drafter (its pool
    taken first), the target's KV pool and runner (tensor-parallel: rank 0's), the window policy."""

    config: EngineConfig
    model: LlamaModel
    tokenizer: object | None
    max_model_len: int
    kv: KVPool
    states: StatePool | None
    runner: ModelRunner
    drafter: Drafter | None
    settings: SpecSettings | None  # K, depth, block size, window: resolved with the drafter artifact's shape
    policy: WindowPolicy
    tp: TPDriver | None = None


class Engine:
    def __init__(self, parts: EngineParts) -> None:
        self.config, self.model, self.tokenizer = parts.config, parts.model, parts.tokenizer
        self.kv, self.states, self.runner, self.tp = parts.kv, parts.states, parts.runner, parts.tp
        self.drafter, self.policy, self.max_model_len = parts.drafter, parts.policy, parts.max_model_len
        self.settings, self.verify_mode = parts.settings, parts.config.speculative_verify_packing
        self.num_draft_tokens = parts.settings.num_draft_tokens if self.drafter else 0
        # target layers whose hidden states the drafter consumes; () = capture nothing
        self.aux_layers: tuple[int, ...] = self.drafter.aux_layers if self.drafter else ()
        mcfg, config = self.model.cfg, self.config
        self.stats = SpecStats()
        # structured output: forced-token drafts may run past the drafter's window (grammar requests only)
        forced = config.grammar_forced_drafts and max(config.grammar_forced_drafts, self.num_draft_tokens)
        self.draft_stage = DraftStage(self.drafter, self.policy, self.kv, self.num_draft_tokens, forced,
                                      self.max_model_len, self.stats, self._fail_exc)
        # NOTE: hybrid targets do not cache prefixes: their recurrent state at a page boundary is not kept
        self.prefix = None if config.disable_prefix_cache or mcfg.is_hybrid else PrefixCaching(self.kv, self.drafter)
        self.scheduler = Scheduler(self.kv, config.max_prefill_tokens, config.max_running_requests,
                                   self.draft_stage.lookahead, self.states, self.prefix)
        self.scheduler.on_release = self.drafter.release if self.drafter else None
        self.eos_ids = set(mcfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        # A request can never hold more positions than the pool has slots: stop it there ("length")
        # instead of letting it wait forever for pages that can never be freed.
        self.emitter = Emitter(self.tokenizer, self.eos_ids, min(self.max_model_len, self.kv.num_slots))
        window = mcfg.kv_window
        self.slide = None if window is None else SlideWindow(
            self.kv, window, None if self.prefix is None else self.prefix.insert)
        steps = [KeepPath(self.kv), *([CommitState(self.states)] if self.states else []), AdvanceKV(),
                 Emit(self.emitter, self.stats, self.policy.trials, self._finish), *([self.slide] if self.slide else [])]
        self.commit_stage = CommitStage(steps + ([DraftState(self.drafter)] if self.drafter else []), self._fail)
        self._grammars = GrammarCompiler(config.grammar_backend, self.tokenizer, mcfg.vocab_size, self.eos_ids)
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # failed during the current step
        self._after_prefill = False  # a prefill ran since the last decode step (StepStats.after_prefill)
        self._calibrating = True  # the policy has measurement left (idle_work, _busy_work)
        self._busy_s = self._calibration_s = 0.0  # seconds of steps, of measurement between them

    def close(self) -> None:
        """Release what outlives the engine object: tensor-parallel worker processes; save the drafter's index; the
        prefix cache's disk writer (its queued pages written first)."""
        if self.drafter is not None:
            self.drafter.save(now=True)
        if self.tp is not None:
            self.tp.close()
        if self.prefix is not None:
            self.prefix.close()

    # ---- requests ----
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        params.validate(self.model.cfg.vocab_size)
        self.scheduler.check_prompt(prompt_ids, self.model.cfg.vocab_size, self.max_model_len)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already running")
        grammar = self._grammars.for_params(params)
        # NOTE: what min_tokens holds back: the tokens that would stop the request (vLLM's set)
        stop = (set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)) if params.min_tokens \
            else set()
        req = Request(rid, list(prompt_ids), params, generator=request_generator(params, self._seed_rng),
                      grammar=grammar, min_tokens_stop=tuple(sorted(stop)),
                      prompt_logprobs=[] if params.prompt_logprobs is None else [None])
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

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Embeddings: per prompt the mean over its positions of the target's final-normed last hidden state,
        L2-normalised (a decoder LM has no pooling head; this is the mean pooling vLLM applies to one). Each prompt
        runs alone on pages taken from the pool and given back, between steps. Raises ValueError naming `input`."""
        if self.tp is not None or self.states is not None or self.model.cfg.kv_window:
            raise ValueError("input: embeddings are not supported for this model (tensor parallelism, a hybrid "
                             "model or a sliding window)")
        out = []
        for ids in prompts:
            try:
                self.scheduler.check_prompt(ids, self.model.cfg.vocab_size, self.max_model_len)
            except ValueError as e:  # the same checks as a prompt's, naming this endpoint's field
                raise ValueError("input" + str(e).removeprefix("prompt")) from None
            pt: list[int] = []
            try:
                self.kv.ensure(pt, len(ids))
            except OutOfPages:
                self.kv.release(pt)
                raise ValueError(f"input: {len(ids)} tokens do not fit in the free KV cache now") from None
            try:
                h = self.runner.hidden_states(pt, ids).to(torch.float64).mean(dim=0)
            finally:
                self.kv.release(pt)
            out.append((h / h.norm().clamp_min(1e-12)).tolist())
        return out

    def idle_work(self) -> bool:
        """One piece of the work left for idle time (the cost policy's curve measurement: one forward of at most
        64 tokens, so a request that arrives meanwhile waits for that much); True while more is left. NOTE:
        called only while no request runs: the forward uses the threads and a few pages of the pool. The drafter
        saves its suffix index here when due."""
        more = self._calibrating = self.policy.calibrate()
        if not more and self.drafter is not None:
            self.drafter.save()
        return more

    def _busy_work(self, step_seconds: float) -> None:
        """Under load: one piece of the policy's measurement (what may run under load: a first start's curve) once
        the pieces so far took at most CALIBRATION_SHARE of the time spent in steps."""
        if not self._calibrating or not self.policy.measures_under_load():
            return
        self._busy_s += step_seconds
        if self._calibration_s > CALIBRATION_SHARE * self._busy_s:
            return
        t0 = time.perf_counter()
        try:
            self._calibrating = self.policy.calibrate(busy=True)
        except FatalEngineError:
            raise
        except Exception:  # noqa: BLE001 - the measurement is an optimisation: the requests in flight go on without it
            log.exception("step-cost measurement failed; serving without it")
            self._calibrating = False
        self._calibration_s += time.perf_counter() - t0
        self._after_prefill = True  # NOTE: the next step follows a forward of another size: not one to learn from

    # ---- the step ----
    def step(self) -> list[Request]:
        """One engine iteration; returns the requests that produced tokens or finished in it."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self._failed = []
        touched: list[Request] = []
        if batch.prefills:
            touched += self._prefill(batch.prefills)
            self._after_prefill = True
        if batch.decodes:
            touched += self._decode([r for r in batch.decodes if not r.finished])
        self._busy_work(time.perf_counter() - t0)
        return touched + [r for r in self._failed if r not in touched]

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[Request]:
        aux = tuple(sorted(self.aux_layers))

        def forward(cs: list[tuple[Request, int]]) -> list[tuple[torch.Tensor | None, list[TokenLogprob],
                                                                  torch.Tensor | None]]:
            """Per chunk: the first output token's logits row (None before the prompt's end), the prompt logprobs
            its rows give, its captured features."""
            starts = [r.committed_len for r, _ in cs]
            first = [r.committed_len + n == r.prefill_target and not r.output_ids for r, n in cs]
            prompt = [_prompt_rows(r, s, n) for (r, n), s in zip(cs, starts)]
            states = self.states.batch([r.state_slot for r, _ in cs]) if self.states else None
            logits, captured = self.runner.forward(
                [r.page_table for r, _ in cs], starts, [r.all_ids[s : s + n] for (r, n), s in zip(cs, starts)],
                [list(p) + ([n - 1] if f else []) for p, (_, n), f in zip(prompt, cs, first)], aux, states=states)
            if states is not None:  # a prefill chunk is committed whole: its last row's state is final
                for (r, _), rows in zip(cs, states.split([n for _, n in cs])):
                    self.states.write(r.state_slot, rows, 0)
            feats = split_features(captured, self.aux_layers, [n for _, n in cs]) if aux else [None] * len(cs)
            # NOTE: row j of a chunk starting at s predicts position s + j + 1
            plps = [token_logprobs(x, r.prompt_ids[s + p.start + 1 : s + p.stop + 1], r.params.prompt_logprobs)
                    if p else [] for x, p, (r, _), s in zip(logits, prompt, cs, starts)]
            return [(x[len(p):] if f else None, lp, ft) for x, p, f, lp, ft in zip(logits, prompt, first, plps, feats)]

        done = isolate(forward, chunks, lambda c, e: self._fail_exc(c[0], "prefill", e))
        starts = [r.committed_len for (r, _), _ in done]
        for (r, n), (_, plps, _) in done:
            r.prompt_logprobs += plps  # complete before the first token is emitted below
            r.committed_len += n
            if self.slide is not None:
                self.slide.slide(r)
            elif self.prefix is not None:
                self.prefix.insert(r)
        self.draft_stage.prefill([(r, s, n) for ((r, n), _), s in zip(done, starts)], [x for _, (_, _, x) in done],
                                 self.scheduler.batch_ahead)
        firsts = [(r, row) for (r, _), (row, _, _) in done if row is not None and not r.finished]
        accepted = self._accept([r for r, _ in firsts], Proposal.empty(len(firsts)), [row for _, row in firsts],
                                verified=False)  # the first token: the same accept and commit, no draft
        return [c.req for c in self.commit_stage.run(accepted)]

    def _decode(self, reqs: list[Request]) -> list[Request]:
        t0 = time.perf_counter()
        d = self.draft_stage.run(reqs)                                # DRAFT under the window policy
        reqs, proposal, logits, extras = self._verify(d.reqs, d.proposal)      # VERIFY: one target forward
        source = dict(zip((r.request_id for r in d.reqs), d.plan.sources))
        accepted = self._accept(reqs, proposal, logits, extras,             # ACCEPT: a lossless rule per request
                                [source[r.request_id] for r in reqs])
        committed = self.commit_stage.run(accepted)                  # COMMIT: keep, advance, emit, draft state
        emitted = sum(c.emitted for c in committed)
        self.policy.observe(StepStats(time.perf_counter() - t0, len(reqs), d.drafted, emitted, self._after_prefill,
                                      sum(len(t) for t in proposal.tokens), d.seconds))
        self._after_prefill = False
        return reqs

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
                extras: list | None = None, sources: list[str] | None = None, verified: bool = True) -> list[Committed]:
        """A rule per request (speculative/accept.py); NaN/Inf or an exception fails that request alone.
        extras: per request (target features, recurrent row states) of its verify rows; sources: the draft
        source of each request's proposal."""
        out = []
        qs, parents = proposal.q or [None] * len(reqs), proposal.parents or [None] * len(reqs)
        for r, raw, d, q, par, (f, st), src in zip(reqs, logits, proposal.tokens, qs, parents,
                                                   extras or [(None, None)] * len(reqs), sources or [""] * len(reqs)):
            try:
                res: AcceptResult = accept_request(r, raw, d, q, self.config.speculative_accept, par)
            except Exception as e:  # noqa: BLE001
                self._fail_exc(r, "accept", e)
                continue
            if res.error is not None:
                self._fail(r, res.error)
                continue
            out.append(Committed(r, res, raw, f, len(d), src, verified, st))
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
        self.draft_stage.release(r)
        self.requests.pop(r.request_id, None)


def _prompt_rows(r: Request, start: int, n: int) -> range:
    """The rows of r's prefill chunk [start, start + n) whose logits give prompt logprobs not collected yet (a
    request preempted mid-prefill recomputes rows it has): row j predicts prompt position start + j + 1."""
    if not r.needs_prompt_logits:
        return range(0)
    return range(max(len(r.prompt_logprobs) - 1 - start, 0), min(n, len(r.prompt_ids) - 1 - start))
