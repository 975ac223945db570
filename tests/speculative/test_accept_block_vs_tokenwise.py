"""Block verification accepts at least as many drafts as token-wise verification, on the binary toy of
docs/speculative.md ("The rules as formulas", the worked case): the table of exact expected accepted counts
is re-derived (closed form for token-wise, enumeration of the formulas for both rules) and matched by
simulation, with block strictly ahead for γ ≥ 2 and equal in expectation for γ = 1.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from specserve.speculative.rules import accept_block, accept_sample
from tests.accept_helpers import exact_n_y
from tests.accept_helpers import _one_thread  # noqa: F401  (autouse: one intra-op thread)


EXACT_ACCEPTED = {  # γ: (token-wise, block)
    1: (Fraction(2, 3), Fraction(2, 3)),
    2: (Fraction(10, 9), Fraction(11, 9)),
    3: (Fraction(38, 27), Fraction(5, 3)),
    4: (Fraction(130, 81), Fraction(166, 81)),
}


def exact_tokenwise_binary(gamma: int) -> Fraction:
    """Independent check of the table's token-wise column: β = Σ min(p, q) = 2/3, E = Σ_{i=1..γ} β^i."""
    beta = Fraction(2, 3)
    return sum(beta**i for i in range(1, gamma + 1))


def exact_mean_accepted(rule: str, P: torch.Tensor, Q: torch.Tensor) -> float:
    """E[n] by enumerating every draft chain (context-independent toy) with exact_n_y's law."""
    gamma, V = Q.shape
    total = 0.0
    for x in itertools.product(range(V), repeat=gamma):
        px = math.prod(float(Q[i, t]) for i, t in enumerate(x))
        law = exact_n_y(rule, P, Q, list(x)).view(gamma + 1, V).sum(1)
        total += px * float((law * torch.arange(gamma + 1)).sum())
    return total


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_block_accepts_more_than_tokenwise_binary_toy(gamma: int) -> None:
    p_row = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    q_row = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    P = p_row.expand(gamma + 1, 2).contiguous()
    Q = q_row.expand(gamma, 2).contiguous()
    # the table itself, re-derived: closed form for token-wise, enumeration of the formulas for both
    assert exact_tokenwise_binary(gamma) == EXACT_ACCEPTED[gamma][0]
    for rule, exact in zip(("sample", "block"), EXACT_ACCEPTED[gamma]):
        assert exact_mean_accepted(rule, P, Q) == pytest.approx(float(exact), abs=1e-12)
    n = 10000
    g_draft = torch.Generator().manual_seed(5 + gamma)
    drafts = torch.multinomial(q_row, n * gamma, replacement=True, generator=g_draft).view(n, gamma).tolist()
    means, ses = {}, {}
    for name, fn in (("sample", accept_sample), ("block", accept_block)):
        g = torch.Generator().manual_seed(99 + gamma)
        ks = torch.tensor([fn(P, Q, d, g)[0] for d in drafts], dtype=torch.float64)
        means[name], ses[name] = float(ks.mean()), float(ks.std()) / math.sqrt(n)
    print(f"γ={gamma}: token-wise {means['sample']:.4f} (exact {float(EXACT_ACCEPTED[gamma][0]):.4f}), "
          f"block {means['block']:.4f} (exact {float(EXACT_ACCEPTED[gamma][1]):.4f})")
    for name, exact in zip(("sample", "block"), EXACT_ACCEPTED[gamma]):
        assert abs(means[name] - float(exact)) <= 4 * ses[name], (name, gamma, means[name], float(exact))
    if gamma == 1:  # identical in expectation
        assert abs(means["block"] - means["sample"]) <= 4 * math.hypot(ses["block"], ses["sample"])
    else:
        assert means["block"] > means["sample"]
