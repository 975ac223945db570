"""Edge cases of the acceptance rules: p == q (zero residual), block's zero residual after a clipped
weight, tiny (even denormal) draft probabilities and target-truncated drafts, k = 0 (plain sampling
for every rule), and fp32 precision of p and q kept by accept_request for bf16 target logits.
"""
from __future__ import annotations

import pytest
import torch

from specserve.speculative import rules as acc
from specserve.speculative.rules import accept_block, accept_greedy, accept_onehot, accept_sample
from tests.accept_helpers import encode, reference_tv, threshold, tv
from tests.accept_helpers import _one_thread  # noqa: F401  (autouse: one intra-op thread)


def test_residual_zero_when_p_equals_q() -> None:
    """p == q: every draft is accepted (no residual mass is ever needed) and nothing crashes; the
    residual helper itself falls back to sampling p."""
    V, n = 5, 6000
    g = torch.Generator().manual_seed(3)
    p_row = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    # residual helper directly: zero residual → samples p
    ys = [acc._residual_sample(p_row, p_row.clone(), g) for _ in range(n)]
    ref = reference_tv(p_row, n, seed=4)
    assert tv(torch.bincount(torch.tensor(ys), minlength=V), p_row) <= threshold(ref)
    # whole rules with p == q on every row
    P = p_row.expand(3, V).contiguous()
    for fn in (accept_sample, accept_block):
        d = torch.multinomial(p_row, 2 * n, replacement=True, generator=g).view(n, 2).tolist()
        ys = []
        for dr in d:
            k, y = fn(P, P[:2].clone(), dr, g)
            assert k == 2  # w stays 1, every prefix passes
            ys.append(y)
        assert tv(torch.bincount(torch.tensor(ys), minlength=V), p_row) <= threshold(ref)


def test_block_zero_residual_after_clipped_weight() -> None:
    """Block: a position where w_i·p_{i+1} ≤ q_{i+1} everywhere (Z = 0) must never be the stopping
    point; nothing crashes and the output is still distributed as p."""
    V = 3
    p1 = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    q1 = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p2 = q2 = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)  # Z_2 = Σ max(w p2 − q2, 0) = 0 if w < 1
    P = torch.stack([p1, p2, p2])
    Q = torch.stack([q1, q2])
    g = torch.Generator().manual_seed(11)
    n = 20000
    x1 = torch.multinomial(q1, n, replacement=True, generator=g).tolist()
    x2 = torch.multinomial(q2, n, replacement=True, generator=g).tolist()
    seqs = []
    for a, b in zip(x1, x2):
        k, y = accept_block(P, Q, [a, b], g)
        out = [a, b][:k] + [y]
        if len(out) < 2:
            out.append(int(torch.multinomial(p2, 1, generator=g)))
        seqs.append(out[:2])
    exact = (p1[:, None] * p2[None, :]).reshape(-1)
    counts = torch.bincount(encode(torch.tensor(seqs), V), minlength=V * V)
    assert tv(counts, exact) <= threshold(reference_tv(exact, n, seed=12))


def test_tiny_draft_probability() -> None:
    """q(x) tiny (1e-300 and a denormal): accepted iff p(x) > 0, no overflow/NaN."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    for tiny in (1e-300, 5e-324, 1e-30):
        q = torch.tensor([[1 - 3 * tiny, tiny, tiny, tiny]], dtype=torch.float64)
        g = torch.Generator().manual_seed(0)
        for _ in range(50):
            assert accept_sample(p, q, [3], g)[0] == 1  # ratio 0.4 / tiny ≫ 1: always accepted
            assert accept_block(p, q, [3], g)[0] == 1
    # and with the target truncating x to probability 0 it is always rejected, the correction ≠ x
    p0 = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.5 - 1e-300, 1e-300]], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for fn in (accept_sample, accept_block):
        for _ in range(50):
            k, y = fn(p0, q, [3], g)
            assert k == 0 and y in (0, 1)
    for _ in range(50):
        k, y = accept_onehot(p0, [3], g)
        assert k == 0 and y in (0, 1)


def test_k0_is_plain_sampling_for_every_rule() -> None:
    V, n = 5, 12000
    g = torch.Generator().manual_seed(21)
    p = torch.softmax(torch.randn(1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.zeros(0, V, dtype=torch.float64)
    ref = reference_tv(p[0], n, seed=22)
    cases = {
        "onehot": lambda: accept_onehot(p, [], g),
        "sample": lambda: accept_sample(p, q, [], g),
        "block": lambda: accept_block(p, q, [], g),
    }
    for name, fn in cases.items():
        ys = []
        for _ in range(n):
            k, y = fn()
            assert k == 0
            ys.append(y)
        t = tv(torch.bincount(torch.tensor(ys), minlength=V), p[0])
        assert t <= threshold(ref), (name, t, ref)
    assert accept_greedy(torch.log(p), []) == (0, int(p.argmax()))


@pytest.mark.parametrize("rule", ["sample", "block"])
def test_accept_request_keeps_fp32_precision_for_bf16_logits(monkeypatch, rule: str) -> None:  # noqa: ANN001
    """bf16 target logits (the CUDA default): the rule must see p as a proper ≥fp32 distribution and
    q exactly as the draft sampled from it (fp32). Rounding q to bf16 before the ratio test, or a
    bf16 softmax for p (sums to 1 ± ~1e-3), biases the output by ~5e-4 TV per position."""
    import dataclasses

    from specserve.core import Request, SamplingParams
    from specserve.speculative import accept
    from specserve.speculative.rules import RULES

    V = 64
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(3, V, generator=g) * 3).to(torch.bfloat16)
    q = torch.softmax(raw[:2].float() + 0.5 * torch.randn(2, V, generator=g), -1)  # fp32, as StandaloneDrafter
    seen = {}

    def spy(p, q_in, draft, gen):  # noqa: ANN001
        seen.update(p=p, q=q_in)
        return 0, 0

    monkeypatch.setitem(RULES, rule, dataclasses.replace(RULES[rule], run=spy))  # the accept stage dispatches here
    req = Request("r", [1, 2], SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(1))
    accept.accept_request(req, raw, [int(q[0].argmax()), int(q[1].argmax())], q, rule)
    assert seen["p"].dtype in (torch.float32, torch.float64)
    assert torch.allclose(seen["p"].double().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-6)
    assert torch.equal(seen["q"].double(), q.double())  # not rounded
