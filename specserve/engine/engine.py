"""The engine: owns the target, its KV pool, the scheduler and the drafter, and runs the step.

    step():
        batch = scheduler.schedule()                       # admit, chunk prefills, pick decodes
        prefill(batch.prefills)                            # target forward; drafter builds its state
        proposal = drafter.propose(decodes, window)        # DRAFT
        logits = verify(runner, decodes, proposal)         # VERIFY: one target forward
        results = [accept_request(...)]                    # ACCEPT: a rule per request
        commit(...); emit(...)                             # COMMIT caches; scan stops token by token
Plain decoding is the same step with an empty proposal (window 0).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time

import torch

from ..cache.kv_pool import KVPool, parse_memory
from ..config import EngineConfig
from ..core import AcceptResult, Proposal, Request, SamplingParams, SpecStats, Status, count_per_pos
from ..drafters.base import Drafter, create_drafter
from ..models import LlamaModel, build_model
from ..models.config import ModelConfig
from ..spec.rules import accept_request
from ..spec.tree import compact_path
from ..spec.verify import verify, verify_mode
from ..spec.window import CostModel, DraftGate, StepOverhead, accept_curves, confidence_windows, cost_windows
from .output import Emitter
from .runner import ModelRunner, split_features
from .scheduler import Scheduler

log = logging.getLogger("specserve")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class Engine:
    def __init__(self, config: EngineConfig, model: LlamaModel | None = None, tokenizer=None) -> None:  # noqa: ANN001
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model is None:
            dtype = self.resolve_dtype(config.dtype, config.quantization)
            model, tokenizer = build_model(config.model, dtype, config.quantization)
        self.model, self.tokenizer, self.dtype = model, tokenizer, model.dtype
        mcfg: ModelConfig = model.cfg
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self._kv_budget = parse_memory(config.kv_cache_memory)
        self.drafter: Drafter | None = None
        if config.speculative_algorithm == "AUTO":  # the drafter shipped for this target, if there is one
            from ..drafters.artifact import shipped_drafter

            algo = "DSPARK" if shipped_drafter(mcfg, "dspark") is not None else None
            # NOTE: with the default fixed window the full block costs more than it returns on CPU
            # (0.46-0.66x plain at batch 1-32); the cost policy measured 1.00-1.05x at every batch size
            window = "cost" if algo and config.speculative_window == "fixed" else config.speculative_window
            self.config = config = dataclasses.replace(config, speculative_algorithm=algo, speculative_window=window)
        if config.speculative_algorithm:
            self.drafter = create_drafter(config.speculative_algorithm, self)
            if config.speculative_accept == "block" and not self.drafter.supplies_q:
                raise ValueError(
                    f"--speculative-accept block needs draft distributions q, but {config.speculative_algorithm} "
                    "drafts are deterministic (one-hot); use auto/onehot, or a model drafter without SPECSERVE_GREEDY_DRAFT=1")
        pages = KVPool.pages_for_budget(mcfg, self._kv_budget, config.page_size, self.dtype)
        if pages < 1:
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory!r} is too small for one KV page of this model")
        self.kv = KVPool(mcfg, pages, config.page_size, self.dtype)
        self.runner = ModelRunner(model, self.kv)
        # target layers whose hidden states the drafter consumes; () = capture nothing
        self.aux_layers: tuple[int, ...] = self.drafter.aux_layers if self.drafter else ()
        k = config.speculative_num_draft_tokens
        self.num_draft_tokens = (self.drafter.default_num_draft_tokens if k is None else k) if self.drafter else 0
        self.scheduler = Scheduler(self.kv, config.max_prefill_tokens, config.max_running_requests, self.num_draft_tokens)
        self.scheduler.on_release = self.drafter.release if self.drafter else None
        self.eos_ids = set(mcfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()) or ())
        # A request can never hold more positions than the pool has slots: stop it there ("length")
        # instead of letting it wait forever for pages that can never be freed.
        self.emitter = Emitter(tokenizer, self.eos_ids, min(self.max_model_len, self.kv.num_slots))
        self.stats = SpecStats()
        self.verify_mode = verify_mode()
        self.cost_model: CostModel | None = None
        self.draft_cost_model: CostModel | None = None
        self.step_overhead = StepOverhead()
        self.draft_gate = DraftGate()
        if self.drafter and config.speculative_window == "cost":
            self.cost_model = CostModel.cached(self.runner, self._cost_key(mcfg, self.dtype))
            draft_runner = getattr(self.drafter, "runner", None)  # model drafters draft position by position
            if draft_runner is not None:
                dm = draft_runner.model
                self.draft_cost_model = CostModel.cached(draft_runner, "draft-" + self._cost_key(dm.cfg, dm.dtype))
        self._seed_rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}

    # ---- setup helpers used by drafters ----
    @staticmethod
    def resolve_dtype(name: str, quantization: str | None = None) -> torch.dtype:
        if name == "auto":
            return torch.bfloat16 if quantization == "int4" else torch.float32
        return _DTYPES[name]

    def _cost_key(self, cfg: ModelConfig, dtype: torch.dtype) -> str:
        return "".join(c if c.isalnum() else "_" for c in f"{cfg.name}-{dtype}-{self.config.quantization}")

    def reserve_draft_kv(self, draft_cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Split the KV budget so both pools hold the same number of tokens; returns draft pages.
        NOTE: runs before the target pool is sized, so the target only gets what is left."""
        t = self.model.cfg.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        d = draft_cfg.kv_bytes_per_token * torch.finfo(dtype).bits // 8
        draft_bytes = self._kv_budget * d // (t + d)
        self._kv_budget -= draft_bytes
        return max(1, KVPool.pages_for_budget(draft_cfg, draft_bytes, self.config.page_size, dtype))

    def check_same_vocab(self, draft_tok, draft_cfg: ModelConfig) -> None:  # noqa: ANN001
        t_tok, t_cfg = self.tokenizer, self.model.cfg
        if draft_cfg.vocab_size != t_cfg.vocab_size:
            raise ValueError(f"draft model vocabulary differs: target logits have {t_cfg.vocab_size} entries, "
                             f"draft {draft_cfg.vocab_size}; STANDALONE needs the same tokenizer")
        if t_tok is not None and draft_tok is not None:
            n = min(t_tok.vocab_size, draft_tok.vocab_size)
            for i in range(n):
                if t_tok.id_to_piece(i) != draft_tok.id_to_piece(i):
                    raise ValueError(f"draft tokenizer differs from the target's at id {i}: "
                                     f"{t_tok.id_to_piece(i)!r} vs {draft_tok.id_to_piece(i)!r}")
            if t_tok.vocab_size != draft_tok.vocab_size:
                raise ValueError(f"draft tokenizer has {draft_tok.vocab_size} tokens, target {t_tok.vocab_size}")

    # ---- requests ----
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        params.validate(self.model.cfg.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if any((not isinstance(t, int)) or t < 0 or t >= self.model.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.model.cfg.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate in the context of "
                             f"{self.max_model_len} tokens (--max-model-len)")
        if self.kv.pages_needed([], len(prompt_ids) + 1) > self.kv.allocator.num_pages:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens do not fit the KV pool "
                             f"({self.kv.num_slots} slots); raise --kv-cache-memory")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already running")
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            gen = torch.Generator().manual_seed(seed)
        req = Request(rid, list(prompt_ids), params, generator=gen)
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
        touched: list[Request] = []
        if batch.prefills:
            touched += self._prefill(batch.prefills)
        if batch.decodes:
            touched += self._decode(batch.decodes)
        return touched

    def _prefill(self, chunks: list[tuple[Request, int]]) -> list[Request]:
        starts = [r.committed_len for r, _ in chunks]
        sample_first = [r.committed_len + n == r.prefill_target and not r.output_ids for r, n in chunks]
        aux = self.aux_layers
        logits, captured = self.runner.forward(
            [r.page_table for r, _ in chunks], starts, [r.all_ids[s : s + n] for (r, n), s in zip(chunks, starts)],
            [[n - 1] if f else [] for (_, n), f in zip(chunks, sample_first)], tuple(sorted(aux)))
        for r, n in chunks:
            r.committed_len += n
        if self.drafter:
            feats = split_features(captured, aux, [n for _, n in chunks]) if aux else None
            self.drafter.prefill([(r, s, n) for (r, n), s in zip(chunks, starts)], feats)
        out = []
        for (r, _), f, row in zip(chunks, sample_first, logits):
            if f:  # first token: the same accept path with an empty draft
                self._apply(r, accept_request(r, row, [], None, self.config.speculative_accept), row, 0)
                out.append(r)
        return out

    def _window(self, r: Request) -> int:
        room = len(r.page_table) * self.kv.page_size - r.seq_len  # pages the scheduler reserved
        left = min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.seq_len) - 1
        return max(0, min(self.num_draft_tokens, room, left))

    def _draft(self, reqs: list[Request]) -> tuple[Proposal, list[int], float, int]:
        """DRAFT under the window policy: (proposal, windows, the cost curves' predicted step time,
        requests that drafted). Block drafters draft their whole block in one forward and trees cost
        their depth, so for them `confidence` and `cost` cut windows after drafting, from the per-token
        confidence; `cost` first plans from acceptance so far (charging what a drafting request
        costs), and only requests whose plan is > 0 draft at all."""
        window = [self._window(r) for r in reqs]
        policy, predicted = self.config.speculative_window, 0.0
        after = self.drafter is not None and (
            policy == "confidence" or (policy == "cost" and self.drafter.drafts_whole_window))
        if self.cost_model is not None:
            if not self.draft_gate.allow(len(reqs)):
                window = [0] * len(reqs)
            plan, predicted = cost_windows(reqs, window, self.cost_model, self.draft_cost_model,
                                           self.step_overhead.per_request)
            window = [w if k else 0 for w, k in zip(window, plan)] if after else plan
        proposal = self.drafter.propose(reqs, window) if self.drafter and any(window) else Proposal.empty(len(reqs))
        drafted = sum(1 for d in proposal.tokens if d)
        if after:
            curves = accept_curves(reqs, proposal.confidence, [min(len(d), w) for d, w in zip(proposal.tokens, window)],
                                   proposal.parents)
            if policy == "confidence":
                window = confidence_windows(curves, self.config.speculative_confidence_threshold)
            else:
                window, predicted = cost_windows(reqs, [len(c) for c in curves], self.cost_model, None,
                                                 self.step_overhead.per_request, curves)
        return proposal, window, predicted, drafted

    def _decode(self, reqs: list[Request]) -> list[Request]:
        t0 = time.perf_counter()
        proposal, window, predicted, drafted = self._draft(reqs)
        drafts = [d[:w] for d, w in zip(proposal.tokens, window)]
        # a prefix of a tree proposal is a tree (nodes are in topological order)
        parents = [p[:w] if p is not None else None for p, w in zip(proposal.parents or [None] * len(reqs), window)]
        for r, d in zip(reqs, drafts):
            r.spec_decode_steps += 1
            self.stats.record_window(len(d))
        qs = proposal.q or [None] * len(reqs)
        logits, feats = verify(self.runner, reqs, Proposal(tokens=drafts, parents=parents if proposal.parents else None),
                               self.verify_mode, self.aux_layers)
        accepted = []
        for b, (r, raw, d, q, par) in enumerate(zip(reqs, logits, drafts, qs, parents)):
            res = accept_request(r, raw, d, None if q is None else q[: len(d)], self.config.speculative_accept, par)
            if res.path is not None:  # tree: keep the accepted path's rows, in path order
                compact_path(self.kv, r.page_table, r.committed_len, res.path)
                rows = torch.tensor([0] + [v + 1 for v in res.path])
                raw = raw[rows]
                if feats is not None:
                    feats[b] = feats[b][rows]
            if res.error is None:
                r.committed_len += res.num_accepted + 1  # COMMIT: KV of last + accepted drafts is final
            accepted.append(self._apply(r, res, raw, len(d)))
        if self.drafter:
            self.drafter.commit(reqs, accepted, feats)
        if self.cost_model is not None:
            elapsed = time.perf_counter() - t0
            self.step_overhead.observe(elapsed, predicted, drafted)
            self.draft_gate.observe(len(reqs), drafted > 0, elapsed, sum(a + 1 for a in accepted))
        return reqs

    def _apply(self, r: Request, res: AcceptResult, raw: torch.Tensor, num_draft: int) -> int:
        """Emit res.tokens through the token-by-token stop scan; count only what was emitted."""
        if res.error is not None:
            r.error = res.error
            self._finish(r, "error")
            return 0
        now = time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
        emitted, reason = self.emitter.emit(r, res.tokens, raw)
        n_acc = min(res.num_accepted, emitted)
        if num_draft:
            r.spec_verify_ct += 1
            r.spec_draft_tokens += num_draft
            r.spec_accepted_tokens += n_acc
            r.spec_trials += n_acc + (n_acc < num_draft)
            count_per_pos(r.spec_accepted_per_pos, num_draft, n_acc)
            self.stats.record(num_draft, n_acc)
        if reason is not None:
            self._finish(r, reason)
        return n_acc

    def _finish(self, r: Request, reason: str) -> None:
        r.status, r.finish_reason, r.finish_time = Status.FINISHED, reason, time.perf_counter()
        self.scheduler.finish(r)
        self.emitter.forget(r.request_id)
        if self.drafter:
            self.drafter.release(r)
        self.requests.pop(r.request_id, None)
