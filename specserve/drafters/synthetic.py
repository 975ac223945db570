"""SYNTHETIC — for tests and benchmarks only. Drafts with the target's own weights (argmax, in a
separate KV pool) and replaces each drafted token by a random other token with probability
1 − rate, so at temperature 0 each draft position is accepted with probability `rate` (given its
predecessors were). Drafting costs a full target forward per token: its speed numbers measure
verification at a controlled acceptance, never a real drafter. Every output it touches says so.
"""
from __future__ import annotations

import torch

from ..core import Request
from .base import Capabilities, Drafter, register_drafter
from .context import DrafterContext
from .standalone import StandaloneDrafter, build_draft_runner


class SyntheticDrafter(StandaloneDrafter):
    label = "SYNTHETIC (test/benchmark only: target self-draft with injected errors)"
    supplies_q = False

    def __init__(self, runner, rate: float, seed: int) -> None:  # noqa: ANN001
        super().__init__(runner)
        self.rate = rate
        self.supplies_q = False
        self.rng = torch.Generator().manual_seed(seed)
        self.rngs: dict[str, torch.Generator] = {}

    def _rng(self, req: Request) -> torch.Generator:
        """Per-request error stream: a seeded request must not depend on its batch neighbours."""
        if req.request_id not in self.rngs:
            seed = req.params.seed if req.params.seed is not None else int(torch.randint(2**62, (), generator=self.rng))
            self.rngs[req.request_id] = torch.Generator().manual_seed(seed)
        return self.rngs[req.request_id]

    def release(self, req: Request) -> None:
        super().release(req)
        self.rngs.pop(req.request_id, None)

    def _draft_token(self, req: Request, logits: torch.Tensor, drafts: list[int]) -> tuple[int, None, float]:
        """The argmax, or any other token with probability 1 − rate; its confidence is `rate` (at T = 0 its
        acceptance probability by construction, whichever token was drawn)."""
        tok = int(logits.argmax())
        rng = self._rng(req)
        if torch.rand((), generator=rng).item() >= self.rate:
            shift = int(torch.randint(1, self.vocab, (), generator=rng))
            tok = (tok + shift) % self.vocab  # any token but the argmax
        return tok, None, self.rate


@register_drafter("SYNTHETIC", Capabilities(extra_flags=("speculative_synthetic_accept_rate",)),
                  help="the target's token at a set rate (tests/benchmarks only)")
def _make(ctx: DrafterContext) -> Drafter:
    c = ctx.config
    return SyntheticDrafter(build_draft_runner(ctx, ctx.target), c.value("speculative_synthetic_accept_rate"), c.seed)
