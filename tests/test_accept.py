"""Acceptance rules are lossless: the emitted tokens are distributed exactly as plain sampling from p.

Method (ALGORITHMS.md §1–§2): on toy *context-dependent* target/draft models over a small vocabulary,
run many independent speculative rounds (draft γ tokens, verify with the rule under test, then
complete the output to a fixed length L by sampling from the target) and compare the empirical
joint of the first L tokens with the EXACT target joint obtained by enumeration. The total-variation
distance must sit at the Monte-Carlo noise floor, which is measured on the spot: the TV of samples of
the same size drawn directly from the exact joint. A negative control (the classic bug "argmax
draft, but ratio test against the draft softmax") shows the same threshold does catch a biased rule.

Everything is seeded, so the outcome is deterministic.
"""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from specserve.spec import accept as acc
from specserve.spec.accept import accept_block, accept_greedy, accept_onehot, accept_sample
from tests.tiny import tiny_model

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Everything here is tiny tensors in Python loops; intra-op threads only add contention (badly so
    when other processes load the 2 cores). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Total-variation distance between empirical counts and an exact distribution (same cells)."""
    emp = counts.double() / counts.sum()
    return 0.5 * float((emp - exact).abs().sum())


def reference_tv(exact: torch.Tensor, n: int, seed: int, reps: int = 4) -> float:
    """Noise floor: mean TV of `reps` samples of size n drawn directly from the exact joint."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(reps):
        s = torch.multinomial(exact, n, replacement=True, generator=g)
        out.append(tv(torch.bincount(s, minlength=exact.numel()), exact))
    return sum(out) / reps


def threshold(tv_ref: float, margin: float = 0.01) -> float:
    return max(3.0 * tv_ref, tv_ref + margin)


def sample_rows(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One draw per row of a [N, V] stack of distributions (vectorised)."""
    return torch.multinomial(rows, 1, generator=g).squeeze(1)


def encode(seqs: torch.Tensor, V: int) -> torch.Tensor:
    """[N, L] token sequences → cell index (base V, first token most significant)."""
    code = torch.zeros(seqs.shape[0], dtype=torch.long)
    for j in range(seqs.shape[1]):
        code = code * V + seqs[:, j]
    return code


# ---------------------------------------------------------------------------------------------
# toy context-dependent models: distribution of token j depends on (j, previous token)
# ---------------------------------------------------------------------------------------------

START = 0  # the context token before the first generated position


class Toy:
    """P[j, a] = target distribution for output position j given that the previous token is a;
    Q likewise for the draft. Some rows have zero entries (target / draft truncation)."""

    def __init__(self, V: int, L: int, seed: int, scale: float = 1.5, zero_frac: float = 0.3) -> None:
        g = torch.Generator().manual_seed(seed)

        def table() -> torch.Tensor:
            logits = torch.randn(L, V, V, generator=g, dtype=torch.float64) * scale
            kill = torch.rand(L, V, generator=g, dtype=torch.float64) < zero_frac
            worst = logits.argmin(dim=-1)
            for j, a in kill.nonzero().tolist():
                logits[j, a, worst[j, a]] = float("-inf")
            return torch.softmax(logits, dim=-1)

        self.V, self.L = V, L
        self.P, self.Q = table(), table()

    def exact_joint(self, L: int) -> torch.Tensor:
        V = self.V
        joint = torch.zeros(V**L, dtype=torch.float64)
        for seq in itertools.product(range(V), repeat=L):
            prob, prev = 1.0, START
            for j, t in enumerate(seq):
                prob *= float(self.P[j, prev, t])
                prev = t
            joint[encode(torch.tensor([seq]), V)] = prob
        return joint

    def draft(self, n: int, gamma: int, g: torch.Generator, mode: str) -> torch.Tensor:
        """[n, γ] draft chains: sampled from Q ('sample') or its argmax ('argmax', deterministic)."""
        prev = torch.full((n,), START, dtype=torch.long)
        cols = []
        for j in range(gamma):
            rows = self.Q[j, prev]
            x = rows.argmax(dim=-1) if mode == "argmax" else sample_rows(rows, g)
            cols.append(x)
            prev = x
        return torch.stack(cols, dim=1)

    def rows(self, drafts: torch.Tensor, table: torch.Tensor, n_rows: int) -> torch.Tensor:
        """[N, n_rows, V]: row i is the distribution for position i after drafts x_1..x_i."""
        N = drafts.shape[0]
        prev = torch.cat([torch.full((N, 1), START, dtype=torch.long), drafts], dim=1)[:, :n_rows]
        return table[torch.arange(n_rows)[None, :], prev]

    def complete(self, outs: list[list[int]], L: int, g: torch.Generator) -> torch.Tensor:
        """Truncate/extend each output to exactly L tokens by sampling the target (vectorised)."""
        N = len(outs)
        seq = torch.full((N, L), -1, dtype=torch.long)
        lens = torch.tensor([min(len(o), L) for o in outs])
        for i, o in enumerate(outs):
            seq[i, : lens[i]] = torch.tensor(o[:L])
        for j in range(L):
            need = lens <= j
            if need.any():
                prev = seq[need, j - 1] if j > 0 else torch.full((int(need.sum()),), START, dtype=torch.long)
                seq[need, j] = sample_rows(self.P[j, prev], g)
        return seq


def run_rounds(toy: Toy, rule: str, gamma: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n independent rounds of draft → verify(rule) → complete to L = γ + 1.
    Returns ([n, L] sequences, [n] accepted-draft counts)."""
    g_draft = torch.Generator().manual_seed(seed)
    g_rule = torch.Generator().manual_seed(seed + 1)
    g_fill = torch.Generator().manual_seed(seed + 2)
    mode = "argmax" if rule in ("onehot", "biased_onehot_ratio") else "sample"
    drafts = toy.draft(n, gamma, g_draft, mode)
    P = toy.rows(drafts, toy.P, gamma + 1)
    Qr = toy.rows(drafts, toy.Q, gamma)
    dl = drafts.tolist()
    outs, acc_n = [], []
    for r in range(n):
        d = dl[r]
        if rule == "sample":
            k, y = accept_sample(P[r], Qr[r], d, g_rule)
        elif rule == "block":
            k, y = accept_block(P[r], Qr[r], d, g_rule)
        elif rule in ("onehot", "onehot_sampled_draft"):
            k, y = accept_onehot(P[r], d, g_rule)
        elif rule == "biased_onehot_ratio":  # negative control: argmax draft, ratio test with softmax q
            k, y = accept_sample(P[r], Qr[r], d, g_rule)
        else:
            raise ValueError(rule)
        assert 0 <= k <= gamma and 0 <= y < toy.V
        outs.append(d[:k] + [y])
        acc_n.append(k)
    return toy.complete(outs, gamma + 1, g_fill), torch.tensor(acc_n)


# ---------------------------------------------------------------------------------------------
# 1. greedy
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 2. distribution tests (the core)
# ---------------------------------------------------------------------------------------------

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


def exact_n_y(rule: str, P: torch.Tensor, Q: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """Exact law of (n, y) for ONE fixed draft chain, straight from the formulas of ALGORITHMS.md
    §1.1 / §2.1 (written independently of accept.py). Cell n·V + y."""
    k, V = len(draft), P.shape[1]
    law = torch.zeros((k + 1) * V, dtype=torch.float64)
    if rule == "sample":
        a = [min(1.0, float(P[i, x]) / float(Q[i, x])) for i, x in enumerate(draft)]
        stop = [math.prod(a[:i]) * (1 - a[i]) for i in range(k)] + [math.prod(a)]
        rows = [torch.clamp(P[i] - Q[i], min=0) for i in range(k)]
    else:
        w = [1.0]
        for i, x in enumerate(draft):
            w.append(min(w[-1] * float(P[i, x]) / float(Q[i, x]), 1.0))
        rows = [torch.clamp(w[i] * P[i] - Q[i], min=0) for i in range(k)]
        h = [1.0]  # h_0: stopping at 0 when every later test fails
        for i in range(1, k + 1):
            z = float(rows[i].sum()) if i < k else 0.0
            h.append(w[k] if i == k else (z / (z + 1 - w[i]) if z + 1 - w[i] > 0 else 1.0))
        stop = [h[i] * math.prod(1 - h[j] for j in range(i + 1, k + 1)) for i in range(k + 1)]
    rows.append(P[k])
    for n in range(k + 1):
        if stop[n] > 0:
            law[n * V : (n + 1) * V] = stop[n] * rows[n] / rows[n].sum()
    return law


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


# ---------------------------------------------------------------------------------------------
# 3. block ≥ token-wise on the binary toy of ALGORITHMS.md §2.4
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# 4. edge cases
# ---------------------------------------------------------------------------------------------


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
    V = 4
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
    from specserve.core import Request, SamplingParams
    from specserve.spec import rules

    V = 64
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(3, V, generator=g) * 3).to(torch.bfloat16)
    q = torch.softmax(raw[:2].float() + 0.5 * torch.randn(2, V, generator=g), -1)  # fp32, as StandaloneDrafter
    seen = {}

    def spy(p, q_in, draft, gen):  # noqa: ANN001
        seen.update(p=p, q=q_in)
        return 0, 0

    monkeypatch.setattr(rules, f"accept_{rule}", spy)
    req = Request("r", [1, 2], SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(1))
    rules.accept_request(req, raw, [int(q[0].argmax()), int(q[1].argmax())], q, rule)
    assert seen["p"].dtype in (torch.float32, torch.float64)
    assert torch.allclose(seen["p"].double().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-6)
    assert torch.equal(seen["q"].double(), q.double())  # not rounded


# ---------------------------------------------------------------------------------------------
# 5. engine level: tiny fp64 model, SYNTHETIC and NGRAM drafters, temperature 1 and top-k/top-p
# ---------------------------------------------------------------------------------------------

VOCAB = 5
PROMPT = [4, 0, 2, 4, 0]  # repeats, so NGRAM finds drafts
L_ENGINE = 3


@pytest.fixture(scope="module")
def tiny5():
    return tiny_model(vocab=VOCAB, seed=9)  # seed 9: a fairly flat joint (perplexity ≈ 10 of 125)


def model_last_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Raw next-token logits after `ids`, by a plain full-recompute forward (as tests/tiny.py)."""
    from specserve.cache.kv_pool import KVPool
    from specserve.engine.runner import ModelRunner

    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [[len(ids) - 1]])
    return logits[0][0].double()


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Independent reference for temperature → top-k → top-p (keep the token crossing top_p)."""
    probs = torch.softmax(logits / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in keep)
    kept, cum = [], 0.0
    for i in keep:
        if cum >= top_p:
            break
        kept.append(i)
        cum += float(probs[i]) / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def exact_engine_joint(model, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:  # noqa: ANN001
    joint = torch.zeros(VOCAB**L_ENGINE, dtype=torch.float64)
    cond: dict[tuple[int, ...], torch.Tensor] = {}
    for prefix_len in range(L_ENGINE):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            cond[prefix] = reference_probs(model_last_logits(model, PROMPT + list(prefix)), temperature, top_k, top_p)
    for seq in itertools.product(range(VOCAB), repeat=L_ENGINE):
        prob = 1.0
        for j in range(L_ENGINE):
            prob *= float(cond[seq[:j]][seq[j]])
        joint[encode(torch.tensor([seq]), VOCAB)] = prob
    return joint


SYNTH = dict(speculative_algorithm="SYNTHETIC", speculative_num_draft_tokens=3, speculative_synthetic_accept_rate=0.5)
STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="(in-memory tiny draft)",
                  speculative_num_draft_tokens=3)
ENGINE_N = 3000
ENGINE_CASES = {
    # name: (engine options, sampling kwargs, max_tokens, seed base). max_tokens sets the first
    # verify window (max_tokens − 2 drafts; the first token comes from prefill), so across cases
    # the first 3 tokens cover draft, correction and bonus positions.
    "synthetic_t1": (SYNTH, dict(temperature=1.0), 4, 10_000),
    "ngram_t1": (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3), dict(temperature=1.0), 3, 20_000),
    "synthetic_topk_topp": (SYNTH, dict(temperature=1.0, top_k=4, top_p=0.9), 5, 30_000),
    # a sampled model draft carries q, so these run accept_sample / accept_block inside the engine
    "standalone_sample_t1": ({**STANDALONE, "speculative_accept": "sample"}, dict(temperature=1.0), 4, 40_000),
    "standalone_block_topk": ({**STANDALONE, "speculative_accept": "block"}, dict(temperature=1.0, top_k=3), 5, 50_000),
}


@pytest.fixture
def in_memory_standalone(monkeypatch):  # noqa: ANN001
    """Make STANDALONE draft with an in-memory tiny model (a different one than the target)."""
    from specserve.drafters import base, standalone

    monkeypatch.delenv("SPECSERVE_GREEDY_DRAFT", raising=False)
    draft = tiny_model(vocab=VOCAB, seed=11, layers=1)
    monkeypatch.setitem(base._REGISTRY, "STANDALONE",
                        lambda eng: standalone.StandaloneDrafter(standalone.build_draft_runner(eng, draft)))


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_first_tokens_match_target_joint(tiny5, in_memory_standalone, case: str) -> None:  # noqa: ANN001
    from specserve.core import SamplingParams
    from specserve.engine.llm import LLM

    opts, sp_kw, max_tokens, seed0 = ENGINE_CASES[case]
    n = ENGINE_N
    proc = (sp_kw["temperature"], sp_kw.get("top_k", -1), sp_kw.get("top_p", 1.0))
    exact = exact_engine_joint(tiny5, *proc)
    llm = LLM.from_model(tiny5, seed=0, **opts)
    outs = llm.generate([list(PROMPT)] * n, [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **sp_kw)
                                             for i in range(n)])
    seqs = torch.tensor([o.outputs[0].token_ids[:L_ENGINE] for o in outs])
    assert seqs.shape == (n, L_ENGINE)
    counts = torch.bincount(encode(seqs, VOCAB), minlength=exact.numel())
    assert float(exact[counts > 0].min()) > 0, "engine emitted a sequence the target cannot produce"
    drafted = sum(o.outputs[0].meta_info["spec_draft_tokens"] for o in outs)
    accepted = sum(o.outputs[0].meta_info["spec_accepted_tokens"] for o in outs)
    assert drafted > 0 and 0 < accepted < drafted  # speculation really ran, with both outcomes
    t_eng = tv(counts, exact)
    t_ref = reference_tv(exact, n, seed=seed0)
    # power check: the same threshold rejects a nearby wrong target (temperature off by 0.3, and
    # top-k/top-p not applied)
    t_wrong = tv(counts, exact_engine_joint(tiny5, proc[0] + 0.3))
    print(f"engine {case}: TV={t_eng:.4f} ref={t_ref:.4f} thr={threshold(t_ref):.4f} "
          f"vs-wrong-target={t_wrong:.4f} accepted {accepted}/{drafted}")
    assert t_eng <= threshold(t_ref), (case, t_eng, t_ref)
    assert t_wrong > threshold(t_ref), (case, t_wrong, t_ref)
