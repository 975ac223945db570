"""Shared runtime of the learned drafters: target features in, draft KV pool, token choice.

Feature bookkeeping per request (NOTE: the invariant every learned drafter keeps):
  `done`     draft-side rows/positions already built from target features;
  `pending`  target features [n, n_aux, H] the target produced since (prefill chunks, then the
             accepted prefix of each verify window), in position order, not yet consumed.
The target hands over features only for committed positions, so nothing built from a rejected
draft survives a step: rows the drafter writes for its own drafts sit beyond `done` and are
overwritten by the next step's rows.
With --speculative-draft-attention-window W a draft round reads only the last W committed positions
(the catch-up rows: a sliding window of W), and pages behind the window are freed.
Prefix cache: draft pages whose rows are built from committed positions are cached under the target's page
keys (drafters/prefix.py); a chain drafter keeps with each page the feature of its last position (the next
page's first row pairs with it), so a request admitted past k cached pages starts in sync: done = k pages,
pending = that feature. Without every one of those pages cached the target's hit is cut to what is. With a
draft attention window nothing is cached (pages behind the window are freed) and the target hits nothing.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache.kv_pool import KVPool
from ..core import DraftPlan, Proposal, Request
from ..runtime.sampling import expected_q, grammar_allowed, sample, target_logits
from .base import Drafter
from .context import DrafterContext
from .nets import DraftNet
from .prefix import DraftPrefix


@dataclass
class FeatState:
    page_table: list[int] = field(default_factory=list)
    done: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    # NOTE: rows in `pending`, kept rather than summed: the list grows by one tensor per step while a window
    # policy keeps the drafter from drafting, and every commit asks for it
    num_pending: int = 0
    cached: int = 0  # leading pages of page_table in the prefix cache
    carry: dict[int, torch.Tensor] = field(default_factory=dict)  # chain: page → feature of its last position

    def __post_init__(self) -> None:
        self.num_pending = sum(len(p) for p in self.pending)

    def add(self, feats: torch.Tensor) -> None:
        self.pending.append(feats)
        self.num_pending += len(feats)

    def take(self) -> torch.Tensor:
        out = torch.cat(self.pending) if len(self.pending) != 1 else self.pending[0]
        self.pending, self.num_pending = [], 0
        return out

    def restore(self, done: int, pending: list[torch.Tensor]) -> None:
        self.done, self.pending = done, pending
        self.num_pending = sum(len(p) for p in pending)


class LearnedDrafter(Drafter):
    """Base of the chain (EAGLE-3, MTP) and block (DFlash, DSpark) runtimes."""

    #: how `done` relates to committed_len when in sync: chain rows lag by one (row t pairs token
    #: x_t with the feature of t − 1, seeded with a zero feature), block context does not.
    feature_offset = 0

    def __init__(self, ctx: DrafterContext, net: DraftNet, label: str) -> None:
        self.net, self.label = net.eval(), label
        self.aux_layers: tuple[int, ...] = net.cfg.aux_layer_ids
        self.dtype = next(net.parameters()).dtype
        self.kv: KVPool = ctx.kv_budget.draft_pool(net.mcfg, self.dtype)
        self.max_pos = net.cfg.max_position_embeddings
        self.window = ctx.config.speculative_draft_attention_window  # None = attend to the whole context
        # stop drafting a request once its cumulative confidence is below what the window policy keeps
        self.stop_below = ctx.floor
        self.greedy_draft = ctx.greedy_draft
        self.supplies_q = not self.greedy_draft
        self.vocab = ctx.target_cfg.vocab_size
        self.state: dict[str, FeatState] = {}
        self.path: Path | None = None  # the artifact it was loaded from
        self.prefix: DraftPrefix | None = None

    def use_prefix_cache(self) -> None:
        if self.window is None:
            self.prefix = DraftPrefix(self.kv)

    def cached_prefix(self, req: Request, keys: list[bytes]) -> int:
        return 0 if self.prefix is None else self.prefix.match(keys)

    def prefix_pool(self) -> tuple[KVPool, torch.nn.Module] | None:
        return None if self.prefix is None else (self.kv, self.net)

    def attach_prefix(self, req: Request, keys: list[bytes]) -> None:
        """NOTE: in sync after: covered = done − feature_offset + pending = len(keys) pages."""
        st = self.state[req.request_id] = self._new_state()
        st.page_table, extras = self.prefix.take(keys)
        st.done, st.cached = len(keys) * self.kv.page_size, len(keys)
        st.restore(st.done, [extras[-1][None]] if self.feature_offset else [])

    def _add(self, st: FeatState, first: int, feats: torch.Tensor) -> None:
        """Pending features of positions first.. ; a chain drafter notes each page's last one."""
        st.add(feats)
        if self.prefix is not None and self.feature_offset:
            ps = self.kv.page_size
            for t in range(first + (-(first + 1)) % ps, first + len(feats), ps):  # t + 1 ≡ 0 (mod ps)
                st.carry[t // ps] = feats[t - first].clone()

    def _cache(self, req: Request, st: FeatState) -> None:
        if self.prefix is None:
            return
        st.cached = self.prefix.insert(req, st.page_table, st.done, st.cached,
                                       st.carry.get if self.feature_offset else None)
        for p in [p for p in st.carry if p < st.cached]:  # kept in the cache entry now
            del st.carry[p]

    def _new_state(self) -> FeatState:
        return FeatState()

    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        """NOTE: retry-safe. A batched propose that raises is retried one request at a time
        (runtime/isolate.py), but its catch-up may already have consumed pending features and
        advanced `done` before the failure: both are restored, so the retry rebuilds the same rows
        (rewriting draft KV slots with the values they already hold). The engine restores generators."""
        saved = {r.request_id: (st.done, list(st.pending)) for r in reqs if (st := self.state.get(r.request_id))}
        try:
            return self._propose(reqs, plan.windows)
        except Exception:
            for rid, (done, pending) in saved.items():
                if rid in self.state:
                    self.state[rid].restore(done, pending)
            raise

    @abstractmethod
    def _propose(self, reqs: list[Request], window: list[int]) -> Proposal:
        """The runtime's drafting (chain or block), free to consume pending features."""

    def _st(self, req: Request) -> FeatState:
        st = self.state.get(req.request_id)
        if st is None:
            st = self.state[req.request_id] = self._new_state()
        return st

    def _covered(self, st: FeatState) -> int:
        """Positions whose target features the drafter holds (built into its state or pending)."""
        return st.done - self.feature_offset + st.num_pending

    def _in_sync(self, req: Request) -> bool:
        return self._covered(self._st(req)) == req.committed_len

    def ctx_first(self, seq_len: int) -> int:
        """First position a draft round reads: the last W committed positions up to the anchor
        (position seq_len − 1) — everything, without --speculative-draft-attention-window."""
        return 0 if self.window is None else max(0, seq_len - self.window)

    def trim(self, st: FeatState) -> None:
        """Free draft KV pages behind the window: later rounds read positions ≥ done − W only."""
        if self.window is not None:
            self.kv.free_below(st.page_table, st.done - self.window)

    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor] | None = None) -> None:
        for (req, start, _), f in zip(chunks, feats or []):
            st = self._st(req)
            if self._covered(st) == start:
                self._add(st, start, f.to(self.dtype))

    def commit(self, reqs: list[Request], num_accepted: list[int], feats: list[torch.Tensor] | None = None) -> None:
        for req, n, f in zip(reqs, num_accepted, feats or []):
            st = self.state.get(req.request_id)
            if st is None:  # finished in this step (released already)
                continue
            # verify covered positions committed_len_before .. +n (the last token and n accepted drafts)
            if self._covered(st) == req.committed_len - n - 1:
                self._add(st, req.committed_len - n - 1, f[: n + 1].to(self.dtype))
            self._cache(req, st)

    def release(self, req: Request) -> None:
        st = self.state.pop(req.request_id, None)
        if st is not None:
            self._cache(req, st)
            self.kv.release(st.page_table, req.finish_reason == "error")

    def _choose(self, req: Request, logits: torch.Tensor, drafts: list[int],
                probs: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """One draft token from draft-vocabulary logits [V_d] (`probs`: their softmax), processed as the target
        processes its row (grammar mask, penalties, temperature, top-k/p, min-p) so that q is the distribution
        it was drawn from (`probs` None: the caller needs no confidence from an argmax). Under a grammar that allows nothing in the draft vocabulary, the draft is drawn
        uniformly from what it allows (a valid draft with its true q, likely rejected).
        Returns (token, q or None, its draft confidence): argmax, the probability of the token drafted among
        what the grammar allows; sampled, E_{x~q}[q(x)] = Σ q², the drafted token's probability in expectation.
        NOTE: never q(token) of a sampled token: a window cut that reads the drafted token's own value biases the
        output (a draft kept only when q(x) is high is accepted at min(p, q) from a q it no longer follows);
        a function of the row alone keeps it lossless. Never the row's top probability either (it overstates
        a sampled draft's chance)."""
        ids = self.net.draft_ids
        allowed = grammar_allowed(req, drafts)
        ok = None if allowed is None or not bool(allowed.any()) else allowed[ids]
        if req.params.greedy or self.greedy_draft:  # deterministic: verified one-hot
            if ok is None:
                j = int(logits.argmax())
                return int(ids[j]), None, None if probs is None else probs[j]
            if not bool(ok.any()):  # the draft puts no mass there
                return int(allowed.nonzero()[0]), None, None if probs is None else probs.new_zeros(())
            j = int(logits.masked_fill(~ok, float("-inf")).argmax())
            return int(ids[j]), None, None if probs is None else probs[j] / probs[ok].sum()
        dt = torch.promote_types(logits.dtype, torch.float32)
        full = logits.new_full((self.vocab,), float("-inf"), dtype=dt)
        full[ids] = logits.to(dt)  # q is 0 outside the draft vocabulary
        if ok is not None:
            full = full.masked_fill(~allowed, float("-inf")) if bool(ok.any()) else \
                torch.zeros_like(full).masked_fill(~allowed, float("-inf"))
        x = target_logits(full[None], req.params, req.prompt_ids, req.output_ids + drafts, [], req.min_tokens_stop)[0]
        q = torch.softmax(x, dim=-1)
        if not bool(torch.isfinite(q).all()):  # NOTE: raised, not sampled: the engine fails this request alone
            raise FloatingPointError("draft distribution contains NaN/Inf (non-finite target features or draft weights)")
        return sample(q, req.generator), q, expected_q(q)
