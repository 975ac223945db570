"""Drafter contract and registry.

A drafter proposes up to `window[b]` tokens for each decoding request. Lifecycle per request:
  prefill(chunks, feats)                after each target prefill chunk (build draft-side state)
  propose(reqs, window) → Proposal      DRAFT stage of a step (chains; or trees with `parents`,
                                        nodes in topological best-first order, ≤ window[b] nodes)
  commit(reqs, num_accepted, feats)     after the target committed accepted + 1 tokens
`feats` are the target's hidden states of the drafter's `aux_layers` ([n, len(aux), H] per request:
the prefill chunk's tokens, or the verify window's rows) — None for drafters that need none.
  release(req)                          at finish / abort / preemption: free draft-side state
NOTE: after commit, the drafter must agree with the target about what is committed: anything it
built for rejected drafts is dropped (truncated), never reused.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

from ..core import Proposal, Request

if TYPE_CHECKING:
    from ..engine.engine import Engine


class Drafter(ABC):
    #: True when proposals carry the draft distributions q the tokens were sampled from
    #: (then `sample` / `block` acceptance apply); False for deterministic drafts (verified one-hot).
    supplies_q: bool = False
    #: Shown in outputs and logs (the SYNTHETIC drafter labels itself test-only).
    label: str = ""
    #: target layers whose outputs the drafter consumes (learned drafters); () = no capture at all.
    aux_layers: tuple[int, ...] = ()
    #: draft tokens per step when --speculative-num-draft-tokens is not given.
    default_num_draft_tokens: int = 4
    #: pays for its whole window up front (DFlash/DSpark blocks: one forward; EAGLE-2 trees: their
    #: depth), so `confidence` and `cost` choose windows after drafting, from the per-token confidence.
    drafts_whole_window: bool = False

    def prefill(self, chunks: list[tuple[Request, int, int]], feats: list[torch.Tensor] | None = None) -> None:
        """(request, start, num_tokens) target prefill chunks just run. Default: nothing to build."""

    @abstractmethod
    def propose(self, reqs: list[Request], window: list[int]) -> Proposal:
        """Draft at most window[b] tokens for reqs[b] (fewer, even zero, is always allowed)."""

    def commit(self, reqs: list[Request], num_accepted: list[int], feats: list[torch.Tensor] | None = None) -> None:
        """Target committed num_accepted[b] drafts + 1 token for reqs[b]."""

    def release(self, req: Request) -> None:
        """Forget a request's draft-side state."""


_REGISTRY: dict[str, Callable[["Engine"], Drafter]] = {}


def register_drafter(name: str) -> Callable[[Callable[["Engine"], Drafter]], Callable[["Engine"], Drafter]]:
    def deco(factory: Callable[["Engine"], Drafter]) -> Callable[["Engine"], Drafter]:
        _REGISTRY[name] = factory
        return factory

    return deco


def create_drafter(name: str, engine: "Engine") -> Drafter:
    from . import artifact, ngram, standalone, synthetic  # noqa: F401  (registration side effect)

    if name not in _REGISTRY:
        raise ValueError(f"--speculative-algorithm: no drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](engine)
