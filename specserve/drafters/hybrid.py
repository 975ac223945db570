"""HYBRID: prompt lookup where the context repeats itself, a model drafter everywhere else.

Per request and step, the first source with a draft: "lookup", when a suffix of the committed context of at least
--speculative-ngram-min-match tokens (default 3 here: a long match) occurred earlier; "suffix", when requests that
finished before continue the context (lookups.py); else "learned", the inner drafter: --speculative-draft-model-
path's learned artifact (any kind) or draft model (a GGUF or checkpoint of the target's tokenizer: STANDALONE),
else the DSpark shipped for the target. Where the draft stage turns a draft model off for a request (its forwards
do not pay there), the n-gram table shipped for the target ("table", as NGRAM's) drafts instead, if one ships.
NOTE: the choice reads only committed tokens, never a draft, so each request's proposal is an ordinary
proposal of one drafter — lossless as each of them is. The inner drafter sees every commit
(a learned drafter's features stay in sync; a draft model catches up on the tokens it did not draft)
whether or not it drafted that step.
"""
from __future__ import annotations

import torch

from ..cache.kv_pool import KVPool
from ..core import DraftPlan, Proposal, Request
from .artifact import is_drafter_artifact, learned_artifact, learned_factory, read_config
from .base import AUTO_ARTIFACT, Capabilities, Drafter, register_drafter
from .context import DrafterContext
from .lookups import Lookups, make_lookups
from .ngram import load_table
from .ngram_table import NgramTable
from .standalone import make_standalone

LONG_MATCH = 3  # HYBRID's default --speculative-ngram-min-match


class HybridDrafter(Drafter):
    def __init__(self, learned: Drafter, lookups: Lookups, table: NgramTable | None = None, floor: float = 0.0) -> None:
        self.learned = learned  # the inner drafter (a learned one or a draft model): the source "learned"
        self.label = f"HYBRID(NGRAM+{learned.label})"
        self.aux_layers = learned.aux_layers
        self.supplies_q = learned.supplies_q
        self.drafts_whole_window = learned.drafts_whole_window
        self.runner = getattr(learned, "runner", None)  # a draft model's runner: `cost` prices its forwards
        self.lookups, self.table, self.floor = lookups, table, floor
        # NOTE: cheapest first; the draft model, last, is what `cost` prices by its forwards
        self.sources = lookups.names + (("table",) if table is not None else ()) + ("learned",)

    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor] | None = None) -> None:
        self.learned.prefill(chunks, feats)

    def draft_source(self, req: Request, model: bool = True) -> str:
        found = self.lookups.source(req)
        if found is not None:
            return found
        return "learned" if model else "table" if self.table is not None else self.sources[0]

    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        # NOTE: plan.sources is draft_source's answer this step, on the same committed context ("lookup" also
        # where the draft stage turned a draft model off and no other source answers: no match drafts nothing)
        rest = [w if s == "learned" else 0 for s, w in zip(plan.sources, plan.windows)]
        inner = DraftPlan([self.learned.sources[-1]] * len(reqs), rest)
        parts = (self.learned.propose(reqs, inner) if any(rest) else Proposal.empty(len(reqs))).split()
        for b, (r, s, w) in enumerate(zip(reqs, plan.sources, plan.windows)):
            if s == "table":
                t, c = self.table.draft(r.all_ids, w, self.floor)
                parts[b] = Proposal([t], confidence=[torch.tensor(c, dtype=torch.float32) if t else None])
            elif s != "learned" and (found := self.lookups.draft(r, s, w)):
                parts[b] = Proposal([found])
        return Proposal.join(parts)

    def commit(self, reqs: list[Request], num_accepted: list[int], feats: list[torch.Tensor] | None = None) -> None:
        self.learned.commit(reqs, num_accepted, feats)

    def release(self, req: Request) -> None:
        self.lookups.release(req)
        self.learned.release(req)

    def save(self, now: bool = False) -> None:
        self.lookups.save(now)

    def use_prefix_cache(self) -> None:
        self.learned.use_prefix_cache()

    def cached_prefix(self, req: Request, keys: list[bytes]) -> int:
        return self.learned.cached_prefix(req, keys)

    def attach_prefix(self, req: Request, keys: list[bytes]) -> None:
        self.learned.attach_prefix(req, keys)

    def prefix_pool(self) -> tuple[KVPool, torch.nn.Module] | None:
        return self.learned.prefix_pool()


@register_drafter("HYBRID", Capabilities(block=True, features=True, samples=True, draft_model=True,
                                         default_window="confidence",
                                         extra_flags=("speculative_ngram_min_match", "speculative_ngram_max_match",
                                                      "speculative_draft_vocab", "speculative_suffix_cache_tokens",
                                                      "speculative_ngram_table")),
                  help="n-gram lookup on long matches, else the learned drafter or draft model")
def _make(ctx: DrafterContext) -> Drafter:
    c = ctx.config
    path = learned_artifact(c, ctx.target_cfg, "HYBRID")
    if path is not None and not is_drafter_artifact(path):
        learned = make_standalone(ctx)
    else:
        learned = learned_factory(read_config(path).algorithm if path else AUTO_ARTIFACT)(ctx)
    max_match = c.value("speculative_ngram_max_match")
    min_match = c.speculative_ngram_min_match or min(LONG_MATCH, max_match)
    # NOTE: the table drafts only where a draft model is turned off: a learned drafter without one never is
    table = load_table(ctx) if getattr(learned, "runner", None) is not None else None
    return HybridDrafter(learned, make_lookups(ctx, min_match, max_match), table, ctx.floor)
