"""Greedy acceptance: accept_greedy takes the longest prefix of the draft that matches the target's
argmax, then emits the argmax of the next row (correction or bonus), and never consumes randomness
from either a generator or the global RNG.
"""
from __future__ import annotations

import torch

from specserve.speculative.rules import accept_greedy
from tests.accept_helpers import _one_thread  # noqa: F401  (autouse: one intra-op thread)


def test_accept_greedy_matches_argmax_and_draws_nothing() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0],   # argmax 1
                           [3.0, 0.0, 0.2, 0.1],    # argmax 0
                           [0.0, 0.1, 0.2, 5.0],    # argmax 3
                           [0.0, 4.0, 0.2, 0.3]],   # argmax 1 (bonus)
                          dtype=torch.float64)
    g = torch.Generator().manual_seed(123)
    state = g.get_state().clone()
    assert accept_greedy(logits, [1, 0, 3]) == (3, 1)  # all accepted → bonus = argmax of the last row
    assert accept_greedy(logits, [1, 0, 2]) == (2, 3)  # mismatch at 3rd → correction argmax row 2
    assert accept_greedy(logits, [1, 2, 3]) == (1, 0)  # later matches after a mismatch do not count
    assert accept_greedy(logits, [2, 0, 3]) == (0, 1)
    assert accept_greedy(logits[:1], []) == (0, 1)     # k = 0: plain greedy
    assert torch.equal(g.get_state(), state)            # never touched a generator
    # and the global RNG is not consumed either
    torch.manual_seed(7)
    before = torch.get_rng_state().clone()
    accept_greedy(logits, [1, 0, 2])
    assert torch.equal(torch.get_rng_state(), before)
