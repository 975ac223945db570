"""Token trees (EAGLE-2 drafts): depths and ancestor masks (the walk is in speculative/rules.py, the KV
compaction of the accepted path in speculative/commit.py).

A tree proposal for one request is `tokens[i]`, `parents[i]` for nodes i = 0..m−1 in topological
order (parents[i] < i; −1 = the root, the request's last token, which is row 0 of the verify
window). Verify row i + 1 holds node i. A chain of k drafts is the tree parents = [−1, 0, …, k−2].
"""
from __future__ import annotations

import torch



def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def depths(parents: list[int]) -> list[int]:
    """Depth of every node (root children have depth 1)."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[m+1, m+1] bool over verify rows (row 0 = root): row v may attend to u iff u is an ancestor
    of v or v itself. Built as M[v] = M[parent(v)] ∪ {v}."""
    m = len(parents)
    mask = torch.eye(m + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def children_of(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids
