"""Sampled acceptance rules are lossless: the emitted tokens are distributed exactly as plain sampling from p.
Method (docs/speculative.md, "The rules as formulas"): on toy *context-dependent* target/draft models over a
small vocabulary, run many independent speculative rounds (draft γ tokens, verify with the rule under test,
then complete the output to a fixed length L by sampling from the target) and compare the empirical joint of
the first L tokens with the EXACT target joint obtained by enumeration; the total-variation distance must
sit at the Monte-Carlo noise floor measured on the spot. A negative control (the classic bug "argmax draft,
but ratio test against the draft softmax") shows the same threshold does catch a biased rule, and with one
draft chain held fixed the law of (n accepted, correction/bonus y) must be exactly the formula's. Everything
is seeded, so the outcome is deterministic.
"""
from __future__ import annotations

import pytest
import torch

from specserve.speculative.rules import accept_block, accept_sample
from tests.accept_helpers import Toy, encode, exact_n_y, reference_tv, run_rounds, threshold, tv
from tests.accept_helpers import _one_thread  # noqa: F401  (autouse: one intra-op thread)


V_TOY = 4
N_ROUNDS = {1: 15000, 2: 20000, 3: 24000}
TOY = Toy(V_TOY, L=4, seed=2024)
RULE_SEED = {"sample": 1, "block": 2, "onehot": 3, "onehot_sampled_draft": 4}


@pytest.mark.parametrize("rule,gamma", [(r, g) for r in ("sample", "block", "onehot") for g in (1, 2, 3)]
                         + [("onehot_sampled_draft", 3)])
def test_rule_is_lossless_on_context_dependent_toy(rule: str, gamma: int) -> None:
    n = N_ROUNDS[gamma]
    seqs, k = run_rounds(TOY, rule, gamma, n, seed=1000 * gamma + RULE_SEED[rule])
    exact = TOY.exact_joint(gamma + 1)
    counts = torch.bincount(encode(seqs, V_TOY), minlength=exact.numel())
    assert float(exact[counts > 0].min()) > 0, "emitted a sequence of target probability 0"
    t_rule = tv(counts, exact)
    t_ref = reference_tv(exact, n, seed=gamma)
    print(f"{rule} γ={gamma}: TV={t_rule:.4f} ref={t_ref:.4f} thr={threshold(t_ref):.4f} "
          f"mean accepted={k.double().mean():.3f}")
    assert t_rule <= threshold(t_ref), (rule, gamma, t_rule, t_ref)
    assert (k < gamma).any() and (k > 0).any()  # corrections at several positions ran
    if rule != "onehot":  # (the fixed argmax chain may contain a token the target truncated away)
        assert (k == gamma).any()  # the bonus path ran


@pytest.mark.parametrize("gamma", [2, 3])
def test_negative_control_biased_rule_is_detected(gamma: int) -> None:
    """Argmax drafts but accept_sample with the draft softmax as q: known to be biased. The same
    threshold the lossless rules pass must reject it clearly — proof the test has power."""
    n = 8000
    seqs, _ = run_rounds(TOY, "biased_onehot_ratio", gamma, n, seed=77 + gamma)
    exact = TOY.exact_joint(gamma + 1)
    t_bad = tv(torch.bincount(encode(seqs, V_TOY), minlength=exact.numel()), exact)
    t_ref = reference_tv(exact, n, seed=gamma)
    print(f"negative control γ={gamma}: TV={t_bad:.4f} ref={t_ref:.4f} thr={threshold(t_ref):.4f}")
    assert t_bad > 2 * threshold(t_ref), (t_bad, t_ref)


@pytest.mark.parametrize("draft", [[0, 1, 3], [0, 2, 3]])
@pytest.mark.parametrize("rule", ["sample", "block"])
def test_stop_position_and_residual_given_a_fixed_draft(rule: str, draft: list[int]) -> None:
    """Sharper than the joint test for the internals: with the draft chain held fixed, the law of
    (n accepted, correction/bonus y) must be exactly the formula's — in particular block's residual
    max(w_τ·p − q, 0) (weighted by the clipped joint ratio), not max(p − q, 0)."""
    fn = accept_sample if rule == "sample" else accept_block
    P = torch.tensor([[0.30, 0.40, 0.20, 0.10],
                      [0.50, 0.35, 0.05, 0.10],
                      [0.20, 0.20, 0.30, 0.30],
                      [0.10, 0.20, 0.30, 0.40]], dtype=torch.float64)
    Q = torch.tensor([[0.50, 0.20, 0.15, 0.15],
                      [0.10, 0.30, 0.40, 0.20],
                      [0.40, 0.10, 0.20, 0.30]], dtype=torch.float64)
    # [0, 1, 3]: ratios 0.6, 7/6, 1 — block: w = 0.6, 0.7, 0.7 and every τ in 0..3 has mass, with
    # residuals max(w·p − q, 0) that differ from max(p − q, 0); [0, 2, 3]: ratios 0.6, 1/8, 1.
    exact = exact_n_y(rule, P, Q, draft)
    law = exact.view(len(draft) + 1, -1).sum(1)
    assert (law > 0.03).sum() >= (3 if rule == "block" else 2)  # the stop position really varies
    n = 12000
    g = torch.Generator().manual_seed(8)
    cells = [k * 4 + y for k, y in (fn(P, Q, draft, g) for _ in range(n))]
    counts = torch.bincount(torch.tensor(cells), minlength=exact.numel())
    assert float(exact[counts > 0].min()) > 0, "an impossible (n, y) outcome occurred"
    t, ref = tv(counts, exact), reference_tv(exact, n, seed=9)
    print(f"fixed draft {rule} {draft}: TV={t:.4f} ref={ref:.4f} thr={threshold(ref):.4f}")
    assert t <= threshold(ref), (rule, t, ref)
