"""Shared machinery of the acceptance-rule tests (tests/test_accept_*.py): total-variation distance and
its measured Monte-Carlo noise floor, the toy context-dependent target/draft models with their exact
joint, the draft → verify(rule) → complete round driver, and the exact law of (accepted count,
correction/bonus token) for a fixed draft chain (docs/speculative.md, "The rules as formulas"). Every test module
imports the autouse `_one_thread` fixture so that the tiny tensor loops run on one intra-op thread.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from specserve.speculative.rules import accept_block, accept_onehot, accept_sample


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


# toy context-dependent models: distribution of token j depends on (j, previous token)
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


def exact_n_y(rule: str, P: torch.Tensor, Q: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """Exact law of (n, y) for ONE fixed draft chain, straight from the formulas in
    docs/speculative.md, "The rules as formulas" (written independently of accept.py). Cell n·V + y."""
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
