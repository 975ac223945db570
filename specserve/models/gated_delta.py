"""Gated DeltaNet's two recurrences over packed ragged rows: the causal depthwise convolution and the
gated delta rule, with the state after any row available to the commit stage.

Rows of one request are processed in order; a row's predecessor is its parent (the previous row of a
chain, the parent node of a tree; the request's committed state for the first row), so one code path
serves prefill chunks, ragged verify windows and tree paths. Padding rows of a window are ordinary
rows whose states nobody picks. The math, per value head (state S is dk × dv):
    S ← exp(g)·S;   S ← S + k ⊗ β·(v − Sᵀk);   o = Sᵀq        (q, k L2-normalised; q scaled by dk^-½)
NOTE: no op mixes rows of two requests: every gather is inside the request's own rows and state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RowLayout:
    """Per packed row: its request, its parent row (global index, −1 = the request's start state) and
    its depth below that start (0 for a first row); computed once per forward for every layer."""
    req: torch.Tensor  # [T]
    parent: torch.Tensor  # [T]
    depth: torch.Tensor  # [T]
    by_depth: list[torch.Tensor]  # rows at each depth (their parents are all at the depth above)
    last: torch.Tensor  # [B] each request's last row (chains: its newest token)

    @staticmethod
    def build(q_start: torch.Tensor, parents: torch.Tensor | None) -> "RowLayout":
        lens = q_start.diff()
        B, T = len(lens), int(q_start[-1])
        req = torch.repeat_interleave(torch.arange(B), lens)
        local = torch.arange(T) - q_start[:-1][req]
        if parents is None:
            parent = torch.where(local > 0, torch.arange(T) - 1, torch.full_like(local, -1))
            depth = local
        else:  # trees: parents are local and precede their children
            parent = torch.where(parents >= 0, parents + q_start[:-1][req], torch.full_like(parents, -1))
            depth = torch.zeros(T, dtype=torch.long)
            for r in range(T):
                if parent[r] >= 0:
                    depth[r] = depth[parent[r]] + 1
        by_depth = [torch.nonzero(depth == d).flatten() for d in range(int(depth.max()) + 1 if T else 0)]
        return RowLayout(req, parent, depth, by_depth, q_start[1:] - 1)


def causal_conv(x: torch.Tensor, init: torch.Tensor, weight: torch.Tensor, lay: RowLayout
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] new inputs, init [B, K-1, C] each request's previous inputs (oldest first), weight [C, K].
    Returns (silu(conv) [T, C], window after each row [T, K-1, C]: the next row's previous inputs)."""
    B, km1, C = init.shape
    ext = torch.cat([init.reshape(B * km1, C), x])
    rows = torch.arange(x.shape[0])
    cols = [rows + B * km1]  # newest first: the row itself, then its ancestors, then the start window
    anc = lay.parent
    for d in range(1, km1 + 1):
        from_init = lay.req * km1 + km1 + lay.depth - d  # the start window's column when ancestors run out
        cols.append(torch.where(lay.depth >= d, anc.clamp(min=0) + B * km1, from_init))
        anc = torch.where(anc >= 0, lay.parent[anc.clamp(min=0)], anc)
    win = ext[torch.stack(cols[::-1], dim=1)]  # [T, K, C], oldest first
    out = (win * weight.t()).sum(1)
    return F.silu(out), win[:, 1:]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               init: torch.Tensor, lay: RowLayout, keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]; init [B, Hv, dk, dv].
    Returns (o [T, Hv, dv], state after every row [T, ...] if keep_rows else after each request's last row
    [B, ...]). Rows at one depth run as one batch; each reads its parent's state."""
    rep = v.shape[1] // k.shape[1]
    q, k = _l2norm(q), _l2norm(k)
    if rep > 1:  # each q/k head serves `rep` consecutive value heads
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    decay = g.exp()[..., None, None]
    out = v.new_empty(v.shape)
    B = init.shape[0]
    # states: [start states of the B requests; one per row] (keep_rows or trees) or rolling per request
    states = torch.cat([init, init.new_empty((v.shape[0],) + init.shape[1:])]) if keep_rows else init.clone()
    for rows in lay.by_depth:
        par = lay.parent[rows]
        src = torch.where(par >= 0, par + B, lay.req[rows]) if keep_rows else lay.req[rows]
        s = states[src] * decay[rows]
        kr = k[rows]
        delta = (v[rows] - (s * kr[..., None]).sum(-2)) * beta[rows][..., None]
        s = s + kr[..., None] * delta[..., None, :]
        out[rows] = (s * q[rows][..., None]).sum(-2)
        states[rows + B if keep_rows else lay.req[rows]] = s
    return out, states[B:] if keep_rows else states
