"""Look-ahead on a request's matcher without moving it: every function here leaves the matcher in
the state it found it (NOTE: the invariant of grammar/backend.py — only the commit stage advances it)."""
from __future__ import annotations

import torch

from .backend import Matcher


def valid_prefix(m: Matcher, tokens: list[int]) -> int:
    """How many leading tokens the grammar accepts (stops at termination, too)."""
    n = m.try_accept(tokens)
    m.rollback(n)
    return n


def mask_after(m: Matcher, tokens: list[int]) -> torch.Tensor | None:
    """The allowed set after `tokens` (grammar-valid), or None when the grammar terminates within
    them (nothing after it is ever emitted: the request ends at termination; drafts past it are cut)."""
    n = m.try_accept(tokens)
    try:
        if m.is_terminated():
            return None
        if n < len(tokens):
            raise ValueError(f"mask_after: draft token {tokens[n]} is not grammar-valid (the draft cut missed it)")
        return m.allowed()
    finally:
        m.rollback(n)


def masks_along(m: Matcher, tokens: list[int]) -> list[torch.Tensor | None]:
    """The allowed sets of the len(tokens) + 1 verify rows of a chain (row i follows tokens[:i])."""
    out: list[torch.Tensor | None] = []
    n = 0
    try:
        for i in range(len(tokens) + 1):
            out.append(None if m.is_terminated() else m.allowed())
            if i < len(tokens):
                if m.try_accept(tokens[i : i + 1]) != 1:
                    raise ValueError(f"masks_along: draft token {tokens[i]} is not grammar-valid")
                n += 1
    finally:
        m.rollback(n)
    return out
