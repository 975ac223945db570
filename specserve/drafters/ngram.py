"""NGRAM: drafts without a model. Prompt lookup first: the tokens that followed the most recent earlier occurrence
of the longest suffix of the context (max_match down to min_match tokens); then the suffix index over requests
that finished before (lookups.py). With a corpus n-gram table (ngram_table.py; one ships for the default target),
requests with neither draft from the table instead, with its calibrated per-token confidence, so window policies
cut those drafts where they stop paying; a continuation shorter than the window is extended from the table the
same way."""
from __future__ import annotations

import torch

from ..core import DraftPlan, Proposal, Request
from .base import Capabilities, Drafter, register_drafter
from .context import DrafterContext
from .lookups import Lookups, make_lookups
from .ngram_table import NgramTable, shipped_table

TABLE_MIN_MATCH = 2  # prompt lookup's shortest match when a table drafts the rest (docs/speculative.md)


class NgramDrafter(Drafter):
    label = "NGRAM"

    def __init__(self, lookups: Lookups, table: NgramTable | None = None, floor: float = 0.0) -> None:
        self.lookups, self.table, self.floor = lookups, table, floor
        self.sources = lookups.names + (("table",) if table is not None else ())
        if table is not None:
            self.label = "NGRAM(table)"
            # NOTE: a table draft costs microseconds: draft the whole window, let the policy cut by confidence
            self.drafts_whole_window = True

    def draft_source(self, req: Request, model: bool = True) -> str:
        return self.lookups.source(req) or self.sources[-1]

    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        tokens: list[list[int]] = []
        conf: list[torch.Tensor | None] = []
        for r, s, w in zip(reqs, plan.sources, plan.windows):
            # NOTE: `s` is draft_source's answer this step, on the same committed context
            if s == "table":
                t, c = self.table.draft(r.all_ids, w, self.floor)
                tokens.append(t)
                conf.append(torch.tensor(c, dtype=torch.float32) if t else None)
                continue
            t = self.lookups.draft(r, s, w)
            # a short continuation (its match is recent) is extended from the table: +0.09 τ on HumanEval
            ext, c = self.table.draft(r.all_ids + t, w - len(t), self.floor) if self.table and len(t) < w else ([], [])
            tokens.append(t + ext)
            # NOTE: NaN = no confidence of its own: the policy uses the source's acceptance estimate (as for a
            # continuation without extension, which carries none)
            conf.append(torch.tensor([float("nan")] * len(t) + c, dtype=torch.float32) if ext else None)
        return Proposal(tokens=tokens, confidence=conf if self.table is not None else None)

    def release(self, req: Request) -> None:
        self.lookups.release(req)

    def save(self, now: bool = False) -> None:
        self.lookups.save(now)


def load_table(ctx: DrafterContext) -> NgramTable | None:
    """--speculative-ngram-table: a path, `none`, or (unset) the table shipped for the target."""
    path = ctx.config.speculative_ngram_table
    if path is not None and path.lower() == "none":
        return None
    path = path or shipped_table(ctx.target_cfg)
    return NgramTable.load(path, ctx.target_cfg) if path else None


@register_drafter("NGRAM", Capabilities(extra_flags=("speculative_ngram_min_match", "speculative_ngram_max_match",
                                                     "speculative_ngram_table", "speculative_suffix_cache_tokens")),
                  aliases=("PROMPT_LOOKUP",), help="prompt lookup, then a corpus n-gram table")
def _make(ctx: DrafterContext) -> Drafter:
    c = ctx.config
    table = load_table(ctx)
    max_match = c.value("speculative_ngram_max_match")
    min_match = c.speculative_ngram_min_match or (min(TABLE_MIN_MATCH, max_match) if table else 1)
    return NgramDrafter(make_lookups(ctx, min_match, max_match), table, ctx.floor)
