"""EAGLE-3: one decoder layer over fused features of three target layers, drafting a chain.

Row t of the drafter pairs the token x_t with the target feature of position t − 1 (a zero
feature before position 0) and predicts x_{t+1}; its K/V live in the drafter's own pool at
position t. A round: rows for the newly committed positions (target features), then the chain,
each step feeding the draft's own output hidden back in place of a target feature.
Draft vocabulary: the draft_vocab_size most frequent response tokens; d2t maps them to target ids.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..core import Proposal, Request
from ..cache.kv_pool import OutOfPages
from ..models.forward_batch import build_forward_batch
from .context import DrafterContext
from .learned import FeatState, LearnedDrafter
from .nets import DraftLayer, DraftNet, DrafterConfig, paged
from .tree import draft_tree

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ChainNet(DraftNet):
    """Contract of EAGLE-3 and MTP nets: fuse target features, one step, logits over draft vocab."""

    layer: DraftLayer

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[T, n_aux, H] target features → [T, H] step-0 hidden inputs."""
        raise NotImplementedError

    def inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input a, residual x) of the layer for these tokens and hidden inputs."""
        raise NotImplementedError

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        a, x = self.inputs(tokens, h)
        q, k, v = self.layer.project(a, *self.rope(positions))
        return self.layer.finish(x, attend(q, k, v))


class Eagle3Net(ChainNet):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        H = cfg.target_hidden_size
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.norm_e = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.norm_h = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layer = DraftLayer(self.mcfg, 2 * H)
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.head = nn.Linear(H, cfg.draft_vocab_size, bias=False)  # own head over the draft vocabulary

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(feats.flatten(1))

    def inputs(self, tokens: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.norm_e(self.embed(tokens)), self.norm_h(h)], dim=-1), h  # residual is h

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(o))


class ChainDrafter(LearnedDrafter):
    """Runtime for chain nets (EAGLE-3, MTP): rows for committed positions, then one row per draft
    (a chain), or with --speculative-eagle-topk > 1 an EAGLE-2 dynamic tree (drafters/tree.py)."""

    feature_offset = 1
    net: ChainNet

    def __init__(self, ctx: DrafterContext, net: DraftNet, label: str) -> None:
        super().__init__(ctx, net, label)
        self.topk, self.steps = ctx.settings.topk, ctx.settings.num_steps
        self.drafts_whole_window = self.topk > 1  # a tree costs its depth whatever its node count

    def _new_state(self) -> FeatState:
        H, n_aux = self.net.cfg.target_hidden_size, len(self.aux_layers)
        return FeatState(pending=[torch.zeros(1, n_aux, H, dtype=self.dtype)])  # feature "of position −1"

    def forward_rows(self, sts: list[FeatState], toks: list[list[int]], h: torch.Tensor, slot_starts: list[int],
                     seq_lens: list[int], positions: list[list[int]] | None = None,
                     masks: list[torch.Tensor] | None = None, catch_up: bool = False) -> torch.Tensor:
        """Rows toks[b] written at draft positions slot_starts[b].. (their RoPE positions too, unless
        `positions`), hidden inputs h (packed); returns every row's output (packed). Reads start at
        ctx_first(seq_len); `catch_up` rows (committed positions) slide the window row by row.
        masks[b] (trees) cover the context from position 0."""
        firsts = [min(self.ctx_first(n), s) for n, s in zip(seq_lens, slot_starts)]
        if catch_up and self.window is not None:
            firsts = [max(0, s - self.window + 1) for s in slot_starts]
        ends = [s + len(t) for s, t in zip(slot_starts, toks)]
        slots = [self.kv.slots(st.page_table, s, e) for st, s, e in zip(sts, slot_starts, ends)]
        ctx = [self.kv.slots(st.page_table, f, e) for st, f, e in zip(sts, firsts, ends)]
        if masks is not None:
            masks = [m[:, f:] for m, f in zip(masks, firsts)]
        fb = build_forward_batch(toks, slot_starts, slots, ctx, None, positions=positions, masks=masks,
                                 ctx_first=firsts, window=self.window if catch_up else None)
        return self.net.step(fb.input_ids, h, fb.positions, paged(fb, self.kv.k[0], self.kv.v[0]))

    def root_rows(self, reqs: list[Request], window: list[int],
              room: Callable[[int], int]) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        """Requests that draft this step (index, window) and the draft output at each one's last
        token: rows for the newly committed positions (target features), up to the anchor.
        `room(w)`: draft slots needed past the anchor for a window of w."""
        active = []
        for b, (req, w) in enumerate(zip(reqs, window)):
            w = min(w, self.max_pos - req.seq_len)
            if w <= 0 or not self._in_sync(req):
                continue
            try:
                self.kv.ensure(self._st(req).page_table, req.seq_len + room(w))
            except OutOfPages:
                continue  # no draft memory: plain decoding for this request this step
            active.append((b, w))
        if not active:
            return active, None
        sts = [self._st(reqs[b]) for b, _ in active]
        toks = [reqs[b].all_ids[st.done :] for (b, _), st in zip(active, sts)]
        h = self.net.fuse(torch.cat([st.take() for st in sts]))
        o = self.forward_rows(sts, toks, h, [st.done for st in sts], [reqs[b].seq_len for b, _ in active], catch_up=True)
        for st, t in zip(sts, toks):
            st.done += len(t)
            self.trim(st)
        return active, o[torch.tensor([len(t) for t in toks]).cumsum(0) - 1]

    @torch.no_grad()
    def _propose(self, reqs: list[Request], window: list[int]) -> Proposal:
        if self.topk > 1:
            return draft_tree(self, reqs, window)
        active, o = self.root_rows(reqs, window, lambda w: w - 1)
        if not active:
            return Proposal.empty(len(reqs))
        tokens: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        conf: list[list[torch.Tensor]] = [[] for _ in reqs]  # draft probability of each chosen token
        step, live = 0, [1.0] * len(reqs)  # cumulative confidence: stop below `stop_below`
        while active:
            logits = self.net.logits(o)
            probs = torch.softmax(logits, dim=-1)
            keep, keep_rows = [], []
            for i, ((b, w), row) in enumerate(zip(active, logits)):
                tok, q, c = self._choose(reqs[b], row, tokens[b], probs[i])
                conf[b].append(c)
                tokens[b].append(tok)
                live[b] *= float(c)
                if q is not None:
                    qs[b].append(q)
                if len(tokens[b]) < w and live[b] >= self.stop_below:
                    keep.append((b, w))
                    keep_rows.append(i)
            if not keep:
                break
            step += 1
            sts = [self._st(reqs[b]) for b, _ in keep]  # chain rows sit beyond `done`: overwritten next round
            o = self.forward_rows(sts, [[tokens[b][-1]] for b, _ in keep], o[torch.tensor(keep_rows)],
                                  [reqs[b].seq_len - 1 + step for b, _ in keep], [reqs[b].seq_len for b, _ in keep])
            active = keep
        q_out = [torch.stack(q) if q and len(q) == len(t) else None for q, t in zip(qs, tokens)]
        return Proposal(tokens=tokens, q=q_out if any(q is not None for q in q_out) else None,
                        confidence=[torch.stack(c) if c else None for c in conf])
