"""EAGLE-2 dynamic draft trees on the chain runtime (EAGLE-3, MTP); docs/speculative.md, "EAGLE-2 dynamic trees".

Node score V(v) = Σ log q(token | ancestors) along its path (the log of the product of draft
confidences): EAGLE drafts are calibrated, so exp V(v) ≈ P(v is accepted) and Σ_v exp V(v) ≈ the
expected accepted length. Expansion: the root proposes its top-k children (depth 1, the first
beam); each of the `steps − 1` rounds runs the k beam nodes of every request through the draft
layer in one forward (tree-masked: a node sees the committed context, its ancestors and itself),
takes the top-k children of each, and keeps the k best of those k² by score as the next beam.
Rerank: the m best of all generated nodes. A child never scores above its parent and a stable sort
puts the (earlier-generated) parent first on ties, so the selection is a connected tree and its
best-first order is topological: any prefix of it is a tree too (window policies cut prefixes).
Draft K/V of beam nodes sit past the anchor (depth d at slots seq_len + (d−1)·k ..), beyond
`done`: the next round's rows overwrite them. Children are the draft's top-k, so they are
deterministic and verified by the tree walk (speculative/rules.py `walk_tree`), lossless at any temperature.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

import torch

from ..core import Proposal, Request
from .learned import FeatState
from .nets import DraftNet


class ChainRuntime(Protocol):
    """What a tree expansion needs of the chain drafter that runs it (eagle3.py's ChainDrafter)."""

    topk: int
    steps: int
    max_pos: int
    stop_below: float
    net: DraftNet

    def _st(self, req: Request) -> FeatState: ...

    def root_rows(self, reqs: list[Request], window: list[int],
                  room: Callable[[int], int]) -> tuple[list[tuple[int, int]], torch.Tensor | None]: ...

    def forward_rows(self, sts: list[FeatState], toks: list[list[int]], h: torch.Tensor, slot_starts: list[int],
                     seq_lens: list[int], positions: list[list[int]] | None = None,
                     masks: list[torch.Tensor] | None = None, catch_up: bool = False) -> torch.Tensor: ...


def draft_tree(d: ChainRuntime, reqs: list[Request], window: list[int]) -> Proposal:
    """Per request a tree of at most window[b] nodes (tokens, parents, per-node draft probability)."""
    k, D = d.topk, min(d.steps, max(window))  # a tree of w nodes is at most w deep
    window = [w if r.seq_len + D <= d.max_pos else 0 for r, w in zip(reqs, window)]
    active, o = d.root_rows(reqs, window, lambda w: (D - 1) * k)
    if not active:
        return Proposal.empty(len(reqs))
    N, H = o.shape
    sts = [d._st(reqs[b]) for b, _ in active]
    seq = [reqs[b].seq_len for b, _ in active]
    logp = torch.log_softmax(d.net.logits(o).float(), dim=-1)  # [N, V_d]
    cond, tok = logp.topk(k, dim=-1)  # depth 1: the root's children
    toks, conds, scores, parents = [tok], [cond], [cond], [torch.full((N, k), -1)]
    beam_gen = torch.arange(k).expand(N, k)  # generation index of each beam node
    beam_score, beam_tok, beam_h = cond, tok, o[:, None].expand(N, k, H)
    anc = torch.zeros(N, k, (D - 1) * k, dtype=torch.bool)  # beam nodes' ancestor slots (tree region)
    gen = k
    for depth in range(1, D):
        if float(beam_score.max()) < math.log(max(d.stop_below, 1e-30)):
            break  # every deeper node would fall below what the window policy keeps
        anc[:, :, (depth - 1) * k : depth * k] |= torch.eye(k, dtype=torch.bool)  # each sees itself
        masks = [torch.cat([torch.ones(k, s, dtype=torch.bool), a[:, : depth * k]], dim=1) for s, a in zip(seq, anc)]
        out = d.forward_rows(sts, d.net.draft_ids[beam_tok].tolist(), beam_h.reshape(N * k, H),
                             [s + (depth - 1) * k for s in seq], seq, [[s - 1 + depth] * k for s in seq], masks)
        out = out.view(N, k, H)
        c_cond, c_tok = torch.log_softmax(d.net.logits(out).float(), dim=-1).topk(k, dim=-1)  # [N, k, k]
        c_score = (beam_score[:, :, None] + c_cond).flatten(1)
        toks.append(c_tok.flatten(1))
        conds.append(c_cond.flatten(1))
        scores.append(c_score)
        parents.append(beam_gen[:, :, None].expand(N, k, k).flatten(1))
        best = c_score.topk(k, dim=-1).indices  # [N, k] among the k² children
        par = best // k  # the beam node each survivor hangs from
        beam_gen = gen + best
        beam_score, beam_tok = c_score.gather(1, best), c_tok.flatten(1).gather(1, best)
        beam_h = out.gather(1, par[:, :, None].expand(N, k, H))
        anc = anc.gather(1, par[:, :, None].expand(N, k, anc.shape[-1]))
        gen += k * k
    tok_all, cond_all = torch.cat(toks, 1), torch.cat(conds, 1)
    score_all, par_all = torch.cat(scores, 1), torch.cat(parents, 1)
    order = torch.sort(score_all, dim=1, descending=True, stable=True).indices
    tokens: list[list[int]] = [[] for _ in reqs]
    tree_parents: list[list[int] | None] = [None] * len(reqs)
    conf: list[torch.Tensor | None] = [None] * len(reqs)
    for i, (b, w) in enumerate(active):
        sel = order[i, : min(w, order.shape[1])]
        index = {g: j for j, g in enumerate(sel.tolist())}
        # NOTE: a selected node's parent is always selected before it (see the module docstring)
        tree_parents[b] = [index[p] if p >= 0 else -1 for p in par_all[i, sel].tolist()]
        tokens[b] = d.net.draft_ids[tok_all[i, sel]].tolist()
        conf[b] = cond_all[i, sel].exp()
    return Proposal(tokens=tokens, parents=tree_parents, confidence=conf)
