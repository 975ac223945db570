"""Structured output inside the step (requests with `req.grammar`, a grammar.Matcher):

  DRAFT   forced tokens (jump-forward): where the grammar allows exactly one continuation, those
          tokens are the request's drafts, verified like any other (so it stays lossless);
          then, after every window cut, chains are cut at the first grammar-invalid draft and
          trees keep only valid nodes — masks are computed for exactly the drafts verified
  ACCEPT  every verify row's raw target logits get −inf outside the grammar's allowed set, before
          penalties / temperature / top-k / top-p, whatever the rule (speculative/accept.py)
  COMMIT  the matcher advances one emitted token at a time, after the stop scan (runtime/output.py)
NOTE: cutting a chain before an invalid draft is lossless for deterministic drafts. Drafters that
sample (q) draw from the grammar-masked distribution (runtime/sampling.grammar_allowed), so their
drafts are always valid and the cut never depends on a random draft's value.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core import Proposal, Request
from ..grammar.ops import mask_after, masks_along, valid_prefix


def forced_drafts(reqs: list[Request], windows: list[int], limit: Callable[[Request], int]) -> dict[str, list[int]]:
    """request_id → the grammar's forced tokens (≤ limit(r)) for requests whose forced run is at least the
    window the policy planned for them: those skip the drafter this step. Decided from the grammar
    and the planned window only, never from draft values."""
    out: dict[str, list[int]] = {}
    for r, w in zip(reqs, windows):
        if r.grammar is None or r.grammar.is_terminated() or (lim := limit(r)) <= 0:
            continue
        ff = r.grammar.forced_tokens()[:lim]
        if ff and len(ff) >= w:
            out[r.request_id] = ff
    return out


def with_forced(reqs: list[Request], proposal: Proposal, forced: dict[str, list[int]]) -> Proposal:
    """The proposal with forced tokens as the drafts of the requests in `forced` (deterministic: no q)."""
    if not forced:
        return proposal
    return Proposal.join([Proposal([list(forced[r.request_id])]) if r.request_id in forced else part
                          for r, part in zip(reqs, proposal.split())])


def cut_to_grammar(reqs: list[Request], proposal: Proposal) -> Proposal:
    """Chains cut at their first grammar-invalid draft; trees pruned to their valid nodes."""
    if all(r.grammar is None for r in reqs):
        return proposal
    parts = proposal.split()
    for b, (r, part) in enumerate(zip(reqs, parts)):
        drafts = part.tokens[0]
        if r.grammar is None or not drafts:
            continue
        parents = part.parents[0] if part.parents else None
        if parents is None:
            parts[b] = part.truncate([valid_prefix(r.grammar, drafts)])
        else:
            parts[b] = _keep_nodes(part, _valid_nodes(r, drafts, parents))
    return Proposal.join(parts)


def _valid_nodes(r: Request, tokens: list[int], parents: list[int]) -> list[int]:
    """Nodes (topological order) whose root path the grammar accepts."""
    paths: dict[int, list[int]] = {-1: []}
    keep = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if p not in paths:
            continue  # an ancestor was invalid
        path = paths[p] + [t]
        if valid_prefix(r.grammar, path) == len(path):
            paths[i] = path
            keep.append(i)
    return keep


def _keep_nodes(part: Proposal, keep: list[int]) -> Proposal:
    """A one-request tree proposal restricted to `keep` (closed under ancestors), renumbered."""
    new = {old: j for j, old in enumerate(keep)}
    parents = [new.get(part.parents[0][i], -1) for i in keep]
    conf = part.confidence[0] if part.confidence else None
    q = part.q[0] if part.q else None
    idx = torch.tensor(keep, dtype=torch.long)
    return Proposal([[part.tokens[0][i] for i in keep]], None if q is None else [q[idx]],
                    None if conf is None else [conf[idx]], [parents])


EMPTY_MASK = "the grammar allows no next token (structured output cannot continue); request failed"


def masked_chain(req: Request, raw: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """raw [k + 1, V] with −inf outside each row's allowed set (row i follows drafts[:i]).
    Raises ValueError(EMPTY_MASK) for an empty set. NOTE: callers check raw for NaN first, so the
    −inf put here is never mistaken for a numerical failure."""
    out = raw.clone()
    for i, allowed in enumerate(masks_along(req.grammar, drafts)[: len(raw)]):
        _mask_row(out[i], allowed)
    return out


def masked_row(req: Request, row: torch.Tensor, path: list[int]) -> torch.Tensor:
    """One row [V] masked by the allowed set after `path` (tree walks)."""
    out = row.clone()
    _mask_row(out, mask_after(req.grammar, path))
    return out


def _mask_row(row: torch.Tensor, allowed: torch.Tensor | None) -> None:
    if allowed is None:  # the grammar terminated before this row: its token is never emitted
        return
    if not bool(allowed.any()):
        raise ValueError(EMPTY_MASK)
    row.masked_fill_(~allowed, float("-inf"))
