"""Lattice reranking for the block drafters (DFlash, DSpark): instead of choosing each block offset's
token on its own, keep the top-k candidates per offset and pick the best whole path.

Score of a path x_1..x_L (x_0 = the anchor, the request's last token):
    S(x) = Σ_k log softmax(base_k + T(x_{k−1}))[x_k]
base_k: the drafter's logits at offset k; T(prev): DSpark's Markov transition term (none for DFlash,
where S is a sum of independent per-offset terms and the best path is the per-offset argmax).
S is first-order Markov, so Viterbi applies: with δ_k(t) = best score of a path ending in token t
at offset k,
    δ_1(t) = log softmax(base_1 + T(x_0))[t]
    δ_k(t) = max_s δ_{k−1}(s) + log softmax(base_k + T(s))[t]      (s over the surviving states)
and only the k best tokens of δ_k survive as the states of offset k (a beam: exact when k = V).
"""
from __future__ import annotations

from typing import Callable

import torch

Transition = Callable[[torch.Tensor], torch.Tensor]


def best_paths(base: torch.Tensor, transition: Transition | None, topk: int,
               lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best draft path per row by Viterbi over the top-k candidates of every offset.

    base: [N, L, V] per-offset logits; row 0 already includes the anchor's transition term T(x_0).
    transition: draft-vocabulary states [N, k] → [N, k, V] logit terms T(s), or None (DFlash).
    lengths: [N] path length of each row in 1..L; row b gets the best path of exactly lengths[b]
      tokens (a different path, in general, from the first lengths[b] tokens of a longer best path).
    Returns (paths [N, L] draft-vocabulary ids, meaningful up to lengths[b]; scores [N] = S(path)).
    """
    N, L, V = base.shape
    k = min(topk, V)
    # offset 1: a single predecessor (the anchor), so δ_1 is just the log-probabilities
    score, state = torch.log_softmax(base[:, 0], dim=-1).topk(k, dim=-1)  # [N, k], best first
    scores, states, parents = [score], [state], []
    for j in range(1, L):
        x = base[:, j, None, :]  # [N, 1, V]
        if transition is not None:
            x = x + transition(state)  # [N, k, V]: each state s has its own row base_j + T(s)
        # δ_{j−1}(s) + log p(t | s) for every surviving state s and every token t
        total = score[:, :, None] + torch.log_softmax(x, dim=-1)  # [N, k, V]
        # Viterbi max over predecessors, per token. (Merging the top-k children of each state and
        # keeping the k best tokens gives the same states: a token outside its best predecessor's
        # top-k children already has k distinct better tokens ahead of it.)
        best, parent = total.max(dim=1)  # [N, V]
        score, state = best.topk(k, dim=-1)  # the k best tokens survive, best first
        scores.append(score)
        states.append(state)
        parents.append(parent.gather(1, state))  # [N, k]: index of each survivor's predecessor

    # backtrack each row from the best state (index 0: topk sorts) at its own last offset
    last = lengths.to(torch.long) - 1
    rows = torch.arange(N)
    final = torch.stack(scores, dim=1)[rows, last, 0]  # [N]
    paths = torch.zeros(N, L, dtype=torch.long)
    cur = torch.zeros(N, dtype=torch.long)  # beam index at offset j (junk for rows that end earlier)
    for j in range(L - 1, -1, -1):
        cur = torch.where(last == j, 0, cur)
        paths[:, j] = states[j].gather(1, cur[:, None]).squeeze(1)
        if j > 0:
            cur = parents[j - 1].gather(1, cur[:, None]).squeeze(1)
    return paths, final
