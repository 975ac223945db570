"""DFlash: a block drafter. One non-causal forward over [anchor, MASK × (B − 1)] drafts B − 1 tokens.

Fused target features of the committed context are injected as K/V in every draft layer (each
layer's own k/v projections), cached in the drafter's pool; block K/V are written past the
context and overwritten by the next round. Offset k of the block predicts the token *at* anchor + k.
The embedding and LM head are the target's (frozen, restricted to the draft vocabulary).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..cache.kv_pool import OutOfPages
from ..core import Proposal, Request
from ..models.forward_batch import build_forward_batch
from ..models.llama import LlamaModel
from .lattice import best_paths
from .context import DrafterContext
from .learned import LearnedDrafter
from .nets import DraftLayer, DraftNet, DrafterConfig, dense_head, paged

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DFlashNet(DraftNet):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        H, eps = cfg.target_hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.mask_embed = nn.Parameter(torch.zeros(H))  # the MASK input (learned, not a vocabulary id)
        self.input_norms = nn.ModuleList(nn.RMSNorm(H, eps=eps) for _ in range(cfg.num_layers))
        self.layers = nn.ModuleList(DraftLayer(self.mcfg, H) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(H, eps=eps)
        self.head_w: torch.Tensor | None = None  # target LM head rows of the draft vocabulary (bound)

    def bind(self, target: LlamaModel) -> None:
        super().bind(target)
        self.head_w = dense_head(target)[self.draft_ids].to(self.cos_table.dtype)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """[T, n_aux, H] target features → [T, H] fused context, shared by all draft layers."""
        return self.hidden_norm(self.fc(feats.flatten(1)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rope(positions)
        return [layer.project_kv(ctx, cos, sin) for layer in self.layers]

    def block_input(self, anchors: torch.Tensor) -> torch.Tensor:
        """[N] anchor ids → [N * B, H]: each block is the anchor's embedding then B − 1 MASKs."""
        B = self.cfg.block_size
        x = self.mask_embed.expand(len(anchors), B, -1).clone()
        x[:, 0] = self.embed(anchors)
        return x.reshape(len(anchors) * B, -1)

    def block_forward(self, x: torch.Tensor, positions: torch.Tensor, attends: list[Attend]) -> torch.Tensor:
        cos, sin = self.rope(positions)
        for norm, layer, attend in zip(self.input_norms, self.layers, attends):
            q, k, v = layer.project(norm(x), cos, sin)
            x = layer.finish(x, attend(q, k, v))
        return x

    def base_logits(self, o: torch.Tensor) -> torch.Tensor:
        """[..., H] block outputs → [..., V_d] logits (one matmul for every offset)."""
        return self.norm(o) @ self.head_w.T

    def transition(self, prev: torch.Tensor) -> torch.Tensor | None:
        """Logit term from the token drafted at the previous offset (DSpark); DFlash has none."""
        return None

    def confidence(self, o: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        return None


class BlockDrafter(LearnedDrafter):
    """Runtime for block nets (DFlash, DSpark)."""

    net: DFlashNet
    drafts_whole_window = True

    def __init__(self, ctx: DrafterContext, net: DraftNet, label: str) -> None:
        super().__init__(ctx, net, label)
        #: --speculative-lattice-topk: > 0 drafts the best path of the block's top-k lattice (deterministic;
        #: config validation refuses it with --speculative-accept block)
        self.lattice_topk: int = ctx.config.value("speculative_lattice_topk")
        if self.lattice_topk:
            self.supplies_q = False

    def _write_context(self, reqs: list[Request]) -> None:
        """Turn pending target features into context K/V of every draft layer (all requests at once)."""
        sts = [self._st(r) for r in reqs]
        todo = [st for st in sts if st.pending]
        if not todo:
            return
        n = [st.num_pending for st in todo]
        pos = torch.cat([torch.arange(st.done, st.done + k) for st, k in zip(todo, n)])
        slots = torch.tensor([s for st, k in zip(todo, n) for s in self.kv.slots(st.page_table, st.done, st.done + k)])
        kvs = self.net.context_kv(self.net.context(torch.cat([st.take() for st in todo])), pos)
        for i, (k, v) in enumerate(kvs):
            self.kv.k[i].index_copy_(0, slots, k.to(self.dtype))
            self.kv.v[i].index_copy_(0, slots, v.to(self.dtype))
        for st, k in zip(todo, n):
            st.done += k
            self.trim(st)

    @torch.no_grad()
    def _propose(self, reqs: list[Request], window: list[int]) -> Proposal:
        B = self.net.cfg.block_size
        active = []
        for b, (req, w) in enumerate(zip(reqs, window)):
            c = req.seq_len - 1  # the anchor's position == committed_len
            if w <= 0 or c + B > self.max_pos or not self._in_sync(req):
                continue
            try:
                self.kv.ensure(self._st(req).page_table, c + B)
            except OutOfPages:
                continue  # no draft memory: plain decoding for this request this step
            active.append((b, min(w, B - 1)))
        if not active:
            return Proposal.empty(len(reqs))
        areqs = [reqs[b] for b, _ in active]
        self._write_context(areqs)
        sts = [self._st(r) for r in areqs]
        starts = [r.seq_len - 1 for r in areqs]
        toks = [[r.output_ids[-1]] + [0] * (B - 1) for r in areqs]  # ids past the anchor are unused (MASK)
        firsts = [self.ctx_first(r.seq_len) for r in areqs]  # the anchor's position is seq_len − 1
        fb = build_forward_batch(toks, starts, [self.kv.slots(st.page_table, s, s + B) for st, s in zip(sts, starts)],
                                 [self.kv.slots(st.page_table, f, s + B) for st, f, s in zip(sts, firsts, starts)], None,
                                 causal=False, ctx_first=firsts)
        attends = [paged(fb, self.kv.k[i], self.kv.v[i]) for i in range(len(self.net.layers))]
        o = self.net.block_forward(self.net.block_input(torch.tensor([t[0] for t in toks])), fb.positions, attends)
        o = o.view(len(areqs), B, -1)[:, 1:]
        if self.lattice_topk:
            return self._pick_lattice(reqs, active, o, self.net.base_logits(o))
        return self._pick(reqs, active, o)

    def _pick(self, reqs: list[Request], active: list[tuple[int, int]], o: torch.Tensor) -> Proposal:
        """Choose tokens offset by offset (the transition term needs the previous offset's token).
        The LM head runs per offset, only for requests still drafting: a request stops once its
        cumulative confidence falls below `stop_below` (the window policy would cut there anyway)."""
        tokens: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        conf: list[list[torch.Tensor]] = [[] for _ in reqs]
        prev = torch.tensor([reqs[b].output_ids[-1] for b, _ in active])
        live = [1.0] * len(active)  # cumulative confidence so far
        for k in range(max(w for _, w in active)):
            rows = [i for i, (_, w) in enumerate(active) if k < w and live[i] >= self.stop_below]
            if not rows:
                break
            idx = torch.tensor(rows)
            logits = self.net.base_logits(o[idx, k])
            t = self.net.transition(prev[idx])
            if t is not None:
                logits = logits + t
            head = self.net.confidence(o[idx, k], logits)  # DSpark's confidence head; DFlash has none
            probs = torch.softmax(logits, dim=-1) if head is None else None
            for j, i in enumerate(rows):
                b = active[i][0]
                tok, q, p_tok = self._choose(reqs[b], logits[j], tokens[b], None if probs is None else probs[j])
                c = p_tok if head is None else head[j]  # DFlash: the draft probability of the token drafted
                tokens[b].append(tok)
                prev[i] = tok
                live[i] *= float(c)
                conf[b].append(c)
                if q is not None:
                    qs[b].append(q)
        q_out = [torch.stack(q) if q and len(q) == len(t) else None for q, t in zip(qs, tokens)]
        c_out = [torch.stack(c) if c else None for c in conf]
        return Proposal(tokens=tokens, q=q_out if any(q is not None for q in q_out) else None,
                        confidence=c_out if any(c is not None for c in c_out) else None)

    def _pick_lattice(self, reqs: list[Request], active: list[tuple[int, int]], o: torch.Tensor,
                      base: torch.Tensor) -> Proposal:
        """The best path of each request's window through the top-k lattice (`lattice.best_paths`):
        deterministic drafts (q = None, verified one-hot at any temperature); confidence is taken on
        the logits the chosen path sees (base_k + transition of the chosen previous token)."""
        L = max(w for _, w in active)
        o, base = o[:, :L], base[:, :L]
        ids = self.net.draft_ids  # draft id → target id
        anchors = torch.tensor([reqs[b].output_ids[-1] for b, _ in active])
        t0 = self.net.transition(anchors)
        rows = base if t0 is None else torch.cat([(base[:, 0] + t0)[:, None], base[:, 1:]], dim=1)
        trans = None if t0 is None else (lambda s: self.net.transition(ids[s]))
        paths, _ = best_paths(rows, trans, self.lattice_topk, torch.tensor([w for _, w in active]))
        toks = ids[paths]  # [N, L] target ids
        t = self.net.transition(torch.cat([anchors[:, None], toks[:, :-1]], dim=1))
        logits = base if t is None else base + t
        c = self.net.confidence(o, logits)
        if c is None:  # DFlash: the draft probability of the chosen token
            c = torch.softmax(logits, dim=-1).gather(-1, paths[..., None]).squeeze(-1)
        tokens: list[list[int]] = [[] for _ in reqs]
        conf: list[torch.Tensor | None] = [None] * len(reqs)
        for i, (b, w) in enumerate(active):
            tokens[b], conf[b] = toks[i, :w].tolist(), c[i, :w]
        return Proposal(tokens=tokens, confidence=conf)
