"""STANDALONE: a smaller model with the same tokenizer drafts K tokens autoregressively, with its
own KV pool (sized from its own geometry) and its own page tables.

Draft-side state per request: `done` = positions whose draft KV is valid. Propose catches up on
tokens the draft has not seen (the last token, accepted drafts beyond what it wrote, the bonus),
then feeds its own drafts one by one, each with its confidence (the draft probability of the token), and
stops a request once the cumulative confidence falls below the window policy's floor (a draft position
costs a draft forward; the policy would not verify it). Commit truncates `done` to what the target accepted.
A hybrid draft model (recurrent layers) cannot truncate its state: it keeps a state slot per request
plus a snapshot of the state at every position it drafted past `base` in this round, and commit
copies the snapshot at the new `done` back into the slot (the slot always holds the state at `done`).
Prefix cache: full draft pages of committed tokens are cached under the target's page keys (drafters/prefix.py);
a request admitted past a cached prefix takes the draft pages cached for it and catches up on the rest in
its first propose (a hybrid draft model caches nothing and catches up from position 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.kv_pool import KVPool, OutOfPages
from ..core import DraftPlan, Proposal, Request
from ..runtime.runner import ModelRunner
from ..runtime.sampling import expected_q, grammar_allowed, sample, target_logits
from ..models.forward_batch import RowStates, StateBatch
from .base import Capabilities, Drafter, register_drafter
from ..config import EngineConfig
from .context import DrafterContext, draft_dtype
from .prefix import DraftPrefix

if TYPE_CHECKING:
    from ..models.llama import LlamaModel


@dataclass
class _DraftState:
    page_table: list[int] = field(default_factory=list)
    done: int = 0  # draft KV valid for positions [0, done)
    written: int = 0  # positions written in the last propose (some may be rejected)
    base: int = 0  # seq_len at the last propose
    slot: int | None = None  # hybrid draft models: state after positions [0, done)
    snaps: dict[int, RowStates] = field(default_factory=dict)  # position → state after it, this round
    cached: int = 0  # leading pages of page_table in the prefix cache


class StandaloneDrafter(Drafter):
    label = "STANDALONE"

    def __init__(self, runner: ModelRunner, greedy_draft: bool = False, stop_below: float = 0.0) -> None:
        self.runner = runner
        self.kv: KVPool = runner.kv
        self.greedy_draft = greedy_draft
        self.stop_below = stop_below
        self.state: dict[str, _DraftState] = {}
        self.supplies_q = not self.greedy_draft
        self.prefix: DraftPrefix | None = None
        self.vocab = runner.model.cfg.vocab_size  # token ids the draft model has an embedding row for

    def use_prefix_cache(self) -> None:
        if self.runner.states is None:  # NOTE: a recurrent draft state at a page boundary is not kept
            self.prefix = DraftPrefix(self.kv)

    def prefix_pool(self) -> tuple[KVPool, torch.nn.Module] | None:
        return None if self.prefix is None else (self.kv, self.runner.model)

    def attach_prefix(self, req: Request, keys: list[bytes]) -> None:
        st = self._st(req)
        if self.prefix is None or st.page_table:
            return
        n = self.prefix.match(keys)
        st.page_table, _ = self.prefix.take(keys[:n])
        st.done, st.cached = n * self.kv.page_size, n

    def _cache(self, req: Request, st: _DraftState) -> None:
        if self.prefix is not None:
            st.cached = self.prefix.insert(req, st.page_table, st.done, st.cached)

    def _st(self, req: Request, slot: bool = True) -> _DraftState:
        """req's draft state; with `slot`, a hybrid draft model takes a state slot for it if one is free (not for
        a request it does not draft for: the draft stage skips those, or gives them no window)."""
        st = self.state.setdefault(req.request_id, _DraftState())
        if slot and self.runner.states is not None and st.slot is None and self.runner.states.num_free:
            st.slot, st.done = self.runner.states.alloc(), 0  # a fresh slot: catch up from the start
        return st

    def _ready(self, st: _DraftState) -> bool:
        """A hybrid draft model drafts only for requests holding a state slot (else: plain decoding)."""
        return self.runner.states is None or st.slot is not None

    def _inputs(self, ids: list[int]) -> list[int]:
        """Target tokens the draft model has no row for (a padded target vocabulary) are fed to it as token 0:
        only its guesses change."""
        v = self.vocab
        return ids if max(ids, default=0) < v else [t if t < v else 0 for t in ids]

    def _states(self, sts: list[_DraftState], keep_rows: bool) -> StateBatch | None:
        pool = self.runner.states
        return None if pool is None else pool.batch([s.slot for s in sts], keep_rows)

    def _advance(self, sts: list[_DraftState], states: StateBatch | None, lengths: list[int]) -> None:
        """After a forward of `lengths` new tokens per state: slots take the last row's state; rows at
        positions ≥ base are kept as snapshots for commit. Then done += lengths."""
        if states is not None:
            for st, rows, n in zip(sts, states.split(lengths), lengths):
                self.runner.states.write(st.slot, rows, n - 1)
                for i in range(n):
                    if st.done + i + 1 >= st.base:
                        st.snaps[st.done + i + 1] = RowStates([c[i : i + 1] for c in rows.conv],
                                                              [r[i : i + 1] for r in rows.rec])
        for st, n in zip(sts, lengths):
            st.done += n

    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor] | None = None) -> None:
        todo = []
        for req, start, n in chunks:
            st = self._st(req)
            if st.done != start or not self._ready(st):
                continue  # out of step (e.g. after a draft OOM): propose catches up lazily
            try:
                self.kv.ensure(st.page_table, start + n)
            except OutOfPages:
                continue
            todo.append((req, st, start, n))
        if todo:
            sts = [st for _, st, _, _ in todo]
            states = self._states(sts, keep_rows=False)
            self.runner.forward([s.page_table for s in sts], [start for _, _, start, _ in todo],
                                [self._inputs(r.all_ids[s : s + n]) for r, _, s, n in todo], [[] for _ in todo],
                                states=states)
            if states is not None:
                for st, rows in zip(sts, states.split([n for *_, n in todo])):
                    self.runner.states.write(st.slot, rows, 0)
            for req, st, start, n in todo:
                st.done = start + n
                self._cache(req, st)

    def _draft_token(self, req: Request, logits: torch.Tensor,
                     drafts: list[int]) -> tuple[int, torch.Tensor | None, float] | None:
        """Draft token from one row of draft logits, processed as the target will process its row
        (the grammar mask first, as the target's); with q (None: verified one-hot) and its confidence (argmax: its
        probability; sampled: E_{x~q}[q(x)], a function of the row alone — see learned.py `_choose`).
        None: the grammar allows no token the draft's (reduced) head has, so this row drafts nothing."""
        allowed = grammar_allowed(req, drafts)
        if allowed is not None and bool(allowed.any()):
            logits = logits.masked_fill(~allowed, float("-inf"))
            if not bool(torch.isfinite(logits).any()):
                return None
        x = target_logits(logits[None], req.params, req.prompt_ids, req.output_ids + drafts, [], req.min_tokens_stop)[0]
        q = torch.softmax(x.float(), dim=-1)
        if req.params.greedy or self.greedy_draft:
            tok = int(x.argmax())
            return tok, None, float(q[tok])  # deterministic: verified one-hot
        return sample(q, req.generator), q, float(expected_q(q))

    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        B, window = len(reqs), plan.windows
        tokens: list[list[int]] = [[] for _ in range(B)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        conf: list[list[float]] = [[] for _ in range(B)]
        live = [1.0] * B  # cumulative confidence
        active = []
        for b, (req, w) in enumerate(zip(reqs, window)):
            st = self._st(req, slot=w > 0)
            if w <= 0 or not self._ready(st):
                continue
            try:
                self.kv.ensure(st.page_table, req.seq_len + w - 1)
            except OutOfPages:
                continue  # no draft memory: this request decodes plainly this step
            st.base = req.seq_len
            st.snaps.clear()
            active.append(b)
        pending = {b: reqs[b].all_ids[self.state[reqs[b].request_id].done :] for b in active}
        while active:
            sts = [self.state[reqs[b].request_id] for b in active]
            states = self._states(sts, keep_rows=True)
            logits, _ = self.runner.forward([s.page_table for s in sts], [s.done for s in sts],
                                            [self._inputs(pending[b]) for b in active],
                                            [[len(pending[b]) - 1] for b in active],
                                            states=states)
            self._advance(sts, states, [len(pending[b]) for b in active])
            still = []
            for b, st, row in zip(active, sts, logits):
                drafted = self._draft_token(reqs[b], row[0], tokens[b])
                if drafted is None:
                    continue  # nothing the grammar allows is draftable: this chain ends here
                tok, q, c = drafted
                tokens[b].append(tok)
                conf[b].append(c)
                live[b] *= c
                if q is not None:
                    qs[b].append(q)
                if len(tokens[b]) < window[b] and live[b] >= self.stop_below:
                    pending[b] = [tok]
                    still.append(b)
            active = still
        for req in reqs:
            st = self.state[req.request_id]
            st.written = st.done
        q_out = [torch.stack(q) if q and len(q) == len(t) else None for q, t in zip(qs, tokens)]
        return Proposal(tokens=tokens, q=q_out if any(q is not None for q in q_out) else None,
                        confidence=[torch.tensor(c, dtype=torch.float64) for c in conf])

    def commit(self, reqs: list[Request], num_accepted: list[int], feats: list[torch.Tensor] | None = None) -> None:
        for req, n in zip(reqs, num_accepted):
            st = self.state.get(req.request_id)
            if st is not None and st.base:
                # valid: everything before the last token, the last token, and accepted drafts d_1..d_n
                done = min(st.written, st.base + n)
                if st.slot is not None and done != st.done:
                    self.runner.states.write(st.slot, st.snaps[done], 0)
                st.done, st.base = done, 0
                st.snaps.clear()
                self._cache(req, st)

    def release(self, req: Request) -> None:
        st = self.state.pop(req.request_id, None)
        if st is not None:
            if st.base:  # released inside a step, before its commit: rows from base on hold drafts, maybe rejected
                st.done = min(st.done, st.base)
            self._cache(req, st)
            self.kv.release(st.page_table, req.finish_reason == "error")
            if self.runner.states is not None:
                self.runner.states.free(st.slot)


def build_draft_runner(ctx: DrafterContext, model: "LlamaModel") -> ModelRunner:
    """A runner with the draft's own KV pool (and state pool for a hybrid draft model), sized from the
    draft geometry out of the KV budget."""
    cfg = model.cfg
    states = ctx.kv_budget.state_pool(cfg, model.dtype, ctx.config.max_running_requests) if cfg.is_hybrid else None
    return ModelRunner(model, ctx.kv_budget.draft_pool(cfg, model.dtype), states)


def draft_load_mode(config: EngineConfig, target_dtype: torch.dtype) -> tuple[torch.dtype, str | None]:
    """The draft model's dtype and quantization mode: quantized like the target when its dtype is the one the
    quantization mode runs in."""
    from ..models import resolve_dtype

    dtype = draft_dtype(config, target_dtype)
    q = config.quantization
    return dtype, q if q and dtype == resolve_dtype("auto", q) else None


def load_draft_model(ctx: DrafterContext) -> "LlamaModel":
    """The draft model of --speculative-draft-model-path, checked before any weight is read: the same
    tokenizer as the target's (up to a few trailing padding ids: `shared_vocab`), and not bigger than it. Quantized like the target when its dtype is the one the
    quantization mode runs in; its LM head reduced to --speculative-draft-vocab (default: the vocabulary shipped
    for the tokenizer, if any)."""
    from ..loading.checkpoint import open_checkpoint
    from ..loading.pipeline import build_model
    from .draft_vocab import resolve_draft_vocab

    c = ctx.config
    path = c.speculative_draft_model_path
    ckpt = ctx.draft_checkpoint or open_checkpoint(path)
    cfg, tok = ckpt.cfg, ckpt.tokenizer
    shared = ctx.shared_vocab(tok, cfg)
    if cfg.num_params > ctx.target.cfg.num_params:
        raise ValueError(f"--speculative-draft-model-path {path}: the draft ({cfg.num_params / 1e9:.3f}B parameters) "
                         f"is bigger than the target ({ctx.target.cfg.num_params / 1e9:.3f}B); it cannot pay")
    dtype, quant = draft_load_mode(c, ctx.target.dtype)
    ids = resolve_draft_vocab(c.speculative_draft_vocab or "auto", tok, cfg.vocab_size)
    rows = None if ids is None else torch.from_numpy(ids)
    if shared < cfg.vocab_size or cfg.vocab_size != ctx.target_cfg.vocab_size:
        # NOTE: a padded vocabulary: the head keeps the shared ids only (drafts never leave them), and its logits
        # are as wide as the target's (the sampling processors and the grammar mask index the target's vocabulary)
        rows = torch.arange(shared) if rows is None else rows[rows < shared]
    model, _ = build_model(ckpt, dtype, quant, head_rows=rows)
    model.logits_vocab = ctx.target_cfg.vocab_size
    return model


@register_drafter("STANDALONE", Capabilities(samples=True, draft_model=True, needs_draft_model_path=True,
                                             extra_flags=("speculative_draft_vocab",)),
                  aliases=("DRAFT_MODEL",), help="a smaller model of the target's vocabulary")
def make_standalone(ctx: DrafterContext) -> StandaloneDrafter:
    return StandaloneDrafter(build_draft_runner(ctx, load_draft_model(ctx)), ctx.greedy_draft, ctx.floor)
