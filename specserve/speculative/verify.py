"""VERIFY: one target forward over [last token, d_1..d_k] per request, k ragged across the batch.

--speculative-verify-packing compact (default) packs the windows back to back, so the linear
layers see exactly sum(k_b + 1) tokens; `padded` pads every window to the batch's longest (the
simple rectangle; the pad tokens' K/V land beyond committed_len and are overwritten later).
Logits are computed only at the k_b + 1 positions each request needs.
Tree proposals (`proposal.parents`) verify every node in the same forward: RoPE position = the
root's + depth, attention to the cached prefix and to the node's ancestors (speculative/tree.py).
Hybrid targets: the recurrent state after every row comes back too (rows follow their tree parent);
verify never writes a request's state slot, the commit stage does (speculative/commit.py, CommitState).
"""
from __future__ import annotations

import torch

from ..core import Proposal, Request
from ..runtime.runner import ModelRunner, split_features
from ..models.forward_batch import RowStates
from .tree import ancestor_mask, chain_parents, depths


def verify(runner: ModelRunner, reqs: list[Request], proposal: Proposal, mode: str = "compact",
           capture_layers: tuple[int, ...] = ()
           ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[RowStates] | None]:
    """Returns per request the raw target logits [k_b + 1, V] (row i follows d_1..d_i), when
    capture_layers is given the target features [window_b, len(capture_layers), H] of its rows, and for
    hybrid targets the recurrent state after each of its rows."""
    windows = [[r.output_ids[-1]] + d for r, d in zip(reqs, proposal.tokens)]
    offsets = [list(range(len(w))) for w in windows]
    if mode == "padded":
        width = max(len(w) for w in windows)
        ps = runner.kv.page_size
        for r, w in zip(reqs, windows):
            # never write past this request's pages, nor past the model's last position (RoPE table)
            room = min(len(r.page_table) * ps, runner.model.cfg.max_position_embeddings) - r.committed_len
            w.extend([w[-1]] * (min(width, room) - len(w)))
    positions = masks = tree = None
    if proposal.parents is not None and any(p is not None for p in proposal.parents):
        positions, masks, tree = [], [], []
        for r, w, par in zip(reqs, windows, proposal.parents):
            # pad nodes (padded mode) hang off the root; their rows are never read
            par = (par if par is not None else chain_parents(len(w) - 1))
            par = par + [-1] * (len(w) - 1 - len(par))
            tree.append(par)
            L = r.committed_len
            positions.append([L] + [L + d for d in depths(par)])
            masks.append(torch.cat([torch.ones(len(w), L, dtype=torch.bool), ancestor_mask(par)], dim=1))
    pool = runner.states
    states = pool.batch([r.state_slot for r in reqs], keep_rows=True, parents=tree) if pool is not None else None
    logits, captured = runner.forward([r.page_table for r in reqs], [r.committed_len for r in reqs], windows,
                                      offsets, tuple(sorted(capture_layers)), positions, masks, states)
    lengths = [len(w) for w in windows]
    feats = split_features(captured, capture_layers, lengths) if capture_layers else None
    return logits, feats, states.split(lengths) if states is not None else None
