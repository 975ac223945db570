"""NGRAM (prompt lookup): find the longest suffix of the context (max_match down to min_match
tokens) that occurred earlier, and propose the tokens that followed its most recent occurrence.
No model, no state: the context is re-read each step, so commit is trivially consistent."""
from __future__ import annotations

from ..core import Proposal, Request
from .base import Capabilities, Drafter, register_drafter
from .context import DrafterContext


def ngram_lookup(ids: list[int], min_match: int, max_match: int, k: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix."""
    n = len(ids)
    if k <= 0:
        return []
    for m in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = ids[n - m :]
        # scan right to left for the most recent earlier occurrence (not the suffix itself)
        for start in range(n - m - 1, -1, -1):
            if ids[start : start + m] == suffix:
                follow = ids[start + m : start + m + k]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    label = "NGRAM"

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def propose(self, reqs: list[Request], window: list[int]) -> Proposal:
        return Proposal(tokens=[ngram_lookup(r.all_ids, self.min_match, self.max_match, w) for r, w in zip(reqs, window)])


@register_drafter("NGRAM", Capabilities(extra_flags=("speculative_ngram_min_match", "speculative_ngram_max_match")),
                  aliases=("PROMPT_LOOKUP",))
def _make(ctx: DrafterContext) -> Drafter:
    c = ctx.config
    return NgramDrafter(c.value("speculative_ngram_min_match"), c.value("speculative_ngram_max_match"))
