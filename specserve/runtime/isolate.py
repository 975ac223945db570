"""Failure isolation: an exception in a batched call fails only the requests that cause it."""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ..core import FatalEngineError

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("specserve")


def isolate(fn: Callable[[list[T]], list[R]], items: list[T], fail: Callable[[T, Exception], None]) -> list[tuple[T, R]]:
    """fn(items) → one result per item. If the batch raises, every item runs alone, so only the items
    that also fail alone are handed to `fail`; the others get what they would have got in the batch
    (same inputs, same per-request state). NOTE: fn must be safe to re-run on items it already saw
    (target forwards rewrite the same KV slots; drafter commits are idempotent)."""
    if not items:
        return []
    try:
        return list(zip(items, fn(items)))
    except FatalEngineError:
        raise  # the engine itself is broken (a tensor-parallel rank died): no request is to blame
    except Exception as e:  # noqa: BLE001 - find the culprit below
        if len(items) == 1:
            fail(items[0], e)
            return []
        log.warning("batched call failed (%s: %s); retrying its %d requests one by one", type(e).__name__, e, len(items))
    out: list[tuple[T, R]] = []
    for it in items:
        try:
            out += zip([it], fn([it]))
        except FatalEngineError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(it, e)
    return out
