"""ACCEPT stage for one request: process the target rows, pick the rule, run it.

Rule per request (`choose_rule`, over the registry speculative/rules.py:RULES): temperature 0 → greedy;
a deterministic draft (q absent) → onehot; a sampled draft → the configured rule (auto: `sample`);
a tree draft (parents given; its children are deterministic) → the tree walk, greedy or sample-and-match.
"""
from __future__ import annotations

import math

import torch

from ..core import AcceptResult, Request
from ..runtime.sampling import target_logits
from .grammar import masked_chain, masked_row
from .rules import AUTO_RULE, RULES, walk_tree


def choose_rule(greedy: bool, has_q: bool, configured: str) -> str:
    """NOTE: config refuses rules no flag may select (greedy), so T > 0 never runs greedy acceptance."""
    if greedy:
        return "greedy"
    if not has_q:
        return "onehot"
    return AUTO_RULE if configured == "auto" else configured


def _probs(x: torch.Tensor) -> torch.Tensor:
    # at least fp32 (docs/speculative.md, "The rules as formulas", numerics): a bf16 softmax does not sum
    # to 1, and q.to(bf16) would round the fp32 q the draft was sampled from — both bias the ratio test
    return torch.softmax(x.double() if x.dtype == torch.float64 else x.float(), dim=-1)


_BAD_P = "sampling distribution is NaN/Inf after penalties and temperature; request failed"


def accept_tree(req: Request, raw: torch.Tensor, draft: list[int], parents: list[int]) -> AcceptResult:
    """Tree drafts (deterministic top-k children): walk from the root, each visited row processed
    with the accepted path as its history (penalties see exactly what plain decoding would)."""
    def dist(row: int, hist: list[int]) -> torch.Tensor:
        rows = raw[row : row + 1] if req.grammar is None else masked_row(req, raw[row], hist)[None]
        x = target_logits(rows, req.params, req.prompt_ids, req.output_ids + hist, [], req.min_tokens_stop)[0]
        if req.params.greedy:
            return x
        p = _probs(x)
        if not all_finite(p):
            raise ValueError(_BAD_P)
        return p

    try:
        path, y = walk_tree(dist, draft, parents, req.params.greedy, req.generator)
    except ValueError as e:
        return AcceptResult(0, [], error=str(e))
    return AcceptResult(len(path), [draft[v] for v in path] + [y], path=path)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN and no ±inf in t. NOTE: one fused min/max pass (NaN propagates into both), ~4x cheaper than
    isfinite().all() on a vocabulary row; it runs per request per step."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def accept_request(req: Request, raw: torch.Tensor, draft: list[int], q: torch.Tensor | None, configured: str,
                   parents: list[int] | None = None) -> AcceptResult:
    """raw: target logits [k+1, V] from verify. NaN/Inf fails this request only; so does a grammar
    that allows no token (the NaN check runs first, on the unmasked logits)."""
    if not all_finite(raw):
        return AcceptResult(0, [], error="target logits contain NaN/Inf for this request; request failed")
    try:
        if parents is not None:
            return accept_tree(req, raw, draft, parents)
        if req.grammar is not None:  # every rule judges the masked target (drafts were cut to valid ones)
            raw = masked_chain(req, raw, draft)
    except ValueError as e:
        return AcceptResult(0, [], error=str(e))
    x = target_logits(raw, req.params, req.prompt_ids, req.output_ids, draft, req.min_tokens_stop)
    rule = RULES[choose_rule(req.params.greedy, q is not None, configured)]
    if rule.on_logits:
        n, y = rule.run(x, None, draft, None)
    else:
        p = _probs(x)
        if not all_finite(p):
            return AcceptResult(0, [], error=_BAD_P)
        n, y = rule.run(p, None if q is None else q.to(p.dtype), draft, req.generator)
    return AcceptResult(n, draft[:n] + [y])
