"""Lossless acceptance rules, one pure function each (one request's chain per call).

Inputs, for a chain of k drafts x_1..x_k verified by one target forward:
  p      [k+1, V]  target distributions after all logits processors; row i is the distribution
                   for the token after x_1..x_i (row k is the bonus position).
  q      [k, V]    the draft distributions x_i was *sampled* from (sample / block rules only).
  gen    the request's own torch.Generator (per-request seeds).
Each returns (n, y): n accepted drafts, then y, the correction (n < k) or bonus (n == k) token.
The emitted tokens are x_1..x_n, y; acceptance length = n + 1.
`RULES` is the one list of them (--speculative-accept's choices and help, config validation, the
accept stage's dispatch); a new rule is a function here and its `register_rule` at the bottom.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.sampling import argmax_rows, sample
from .tree import children_of


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """Temperature 0: p_i is one-hot at a_i = argmax. Accept while x_i == a_i; emit a_{n+1}.
    Draws no random numbers."""
    a = argmax_rows(logits)
    n = 0
    while n < len(draft) and draft[n] == a[n]:
        n += 1
    return n, a[n]


def accept_onehot(p: torch.Tensor, draft: list[int], gen: torch.Generator | None) -> tuple[int, int]:
    """Deterministic drafts (argmax, n-gram): q_i = δ(x_i), so accept with min(1, p_i(x_i)/1) and on
    rejection sample the residual p_i restricted to y ≠ x_i. Equivalent and simpler ("sample and
    match"): draw y_i ~ p_i; accept while y_i == x_i; the first mismatch is already a sample of the
    residual, and with every draft accepted y_{k+1} ~ p_{k+1} is the bonus."""
    for i in range(len(draft) + 1):
        y = sample(p[i], gen)
        if i == len(draft) or y != draft[i]:
            return i, y
    raise AssertionError("unreachable")


def _residual_sample(p_row: torch.Tensor, q_row: torch.Tensor, gen: torch.Generator | None) -> int:
    """y ~ max(p − q, 0) normalised; if p == q (no residual mass) sample p itself."""
    r = torch.clamp(p_row - q_row, min=0)
    return sample(r if r.sum() > 0 else p_row, gen)


def accept_sample(p: torch.Tensor, q: torch.Tensor, draft: list[int], gen: torch.Generator | None) -> tuple[int, int]:
    """Leviathan/Chen: accept x_i with prob min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    emit y ~ max(p_i − q_i, 0). P(emit x) = min(p, q) + (1 − Σmin(p, q))·r(x) = p(x)."""
    k = len(draft)
    for i in range(k):
        x = draft[i]
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        if u * float(q[i, x]) > float(p[i, x]):  # u > p/q without dividing by a tiny q
            return i, _residual_sample(p[i], q[i], gen)
    return k, sample(p[k], gen)


def accept_block(p: torch.Tensor, q: torch.Tensor, draft: list[int], gen: torch.Generator | None) -> tuple[int, int]:
    """Block verification (Sun et al., ICLR 2025): judge prefixes by their joint ratio.

    w_0 = 1, w_i = min(w_{i−1} · p_i(x_i)/q_i(x_i), 1)                   running clipped joint ratio
    Z_{i+1} = Σ_v max(w_i · p_{i+1}(v) − q_{i+1}(v), 0)                   residual mass after i drafts
    h_k = w_k;  h_i = Z_{i+1} / (Z_{i+1} + 1 − w_i)  (1 ≤ i < k; 1 if the denominator is 0)
    τ = the LARGEST i with η_i ≤ h_i (η_i ~ U(0,1)), 0 if none — not the first failure.
    Emit x_1..x_τ then y ~ max(w_τ · p_{τ+1} − q_{τ+1}, 0)/Z_{τ+1} (τ < k) or y ~ p_{k+1} (τ = k).
    """
    k = len(draft)
    if k == 0:
        return 0, sample(p[0], gen)
    pd, qd = p.double(), q.double()
    w = [1.0]
    for i in range(k):
        ratio = float(pd[i, draft[i]]) / max(float(qd[i, draft[i]]), 1e-300)
        w.append(min(w[-1] * ratio, 1.0))
    resid = [torch.clamp(w[i] * pd[i] - qd[i], min=0) for i in range(k)]  # resid[i]: after i drafts
    eta = torch.rand(k, generator=gen, dtype=torch.float64).tolist()
    tau = 0
    for i in range(1, k + 1):
        if i == k:
            h = w[k]
        else:
            z = float(resid[i].sum())
            den = z + 1.0 - w[i]
            h = z / den if den > 0 else 1.0
        if eta[i - 1] <= h:
            tau = i
    if tau == k:
        return k, sample(p[k], gen)
    r = resid[tau]
    return tau, sample(r if r.sum() > 0 else pd[tau], gen)


def walk_tree(dist: Callable[[int, list[int]], torch.Tensor], tokens: list[int], parents: list[int], greedy: bool,
              gen: torch.Generator | None) -> tuple[list[int], int]:
    """Tree acceptance for deterministic children (docs/speculative.md, "The rules as formulas"), one request.

    dist(row, path_tokens): the processed target row at verify row `row` (0 = root, node i = i + 1)
    given the accepted path so far — logits at T = 0, probabilities otherwise. From the root: draw
    y ~ P_v (argmax at T = 0); if a child of v carries y, move there and repeat, else emit y and stop.
    Each emitted token is an exact draw from the target given the tokens before it, whatever the
    tree holds: P(move to child c) = P_v(token c), and the emitted y is P_v restricted to non-children
    renormalised times P(no child) = P_v itself. Returns (accepted node path, correction/bonus token).
    """
    kids = children_of(parents)
    v, path, hist = -1, [], []
    while True:
        x = dist(v + 1, hist)
        y = argmax_rows(x[None])[0] if greedy else sample(x, gen)
        c = next((c for c in kids.get(v, ()) if tokens[c] == y), None)
        if c is None:
            return path, y
        path.append(c)
        hist.append(y)
        v = c


#: (processed target rows, q or None, drafts, generator) → (accepted drafts, correction/bonus token)
RuleFn = Callable[[torch.Tensor, "torch.Tensor | None", list[int], "torch.Generator | None"], tuple[int, int]]


@dataclass(frozen=True)
class AcceptRule:
    name: str
    run: RuleFn
    help: str
    on_logits: bool = False  # judges processed logits (argmax), not probabilities
    requires_q: bool = False  # needs sampled drafts' q: refused where drafts are deterministic
    chains_only: bool = False  # trees walk with their own lossless rule
    selectable: bool = True  # --speculative-accept may name it


#: NOTE: each `run` names its function at call time, so substituting a rule function of this module (a test's
#: deliberately biased rule) changes what the accept stage runs
RULES: dict[str, AcceptRule] = {}
#: what --speculative-accept auto runs for drafts sampled from q (deterministic drafts: onehot; T = 0: greedy)
AUTO_RULE = "sample"


def register_rule(rule: AcceptRule) -> None:
    RULES[rule.name] = rule


def selectable_rules() -> tuple[str, ...]:
    """--speculative-accept's choices: auto, then every rule a flag may name."""
    return ("auto", *(n for n, r in RULES.items() if r.selectable))


def check_rule(name: str) -> None:
    """Refuse a --speculative-accept value, saying why: unknown, or a rule no flag selects."""
    rule = RULES.get(name)
    if rule is not None and not rule.selectable:
        raise ValueError(f"--speculative-accept {name}: {rule.help}; choose one of {', '.join(selectable_rules())}")
    if rule is None and name != "auto":
        raise ValueError(f"--speculative-accept: {name!r} is not one of {', '.join(selectable_rules())}")


def rules_help() -> str:
    return "; ".join(f"{n} = {r.help}" for n, r in RULES.items() if r.selectable)


register_rule(AcceptRule("greedy", lambda x, q, d, g: accept_greedy(x, d), on_logits=True, selectable=False,
                         help="runs for every temperature-0 request whatever the flag says; at temperature > 0 it "
                              "would emit the target's argmax instead of sampling it (not lossless)"))
register_rule(AcceptRule("sample", lambda p, q, d, g: accept_sample(p, q, d, g),
                         help="min(1, p/q) per draft, residual on rejection (deterministic drafts: onehot)"))
register_rule(AcceptRule("onehot", lambda p, q, d, g: accept_onehot(p, d, g),
                         help="sample the target and match the draft (any drafts)"))
register_rule(AcceptRule("block", lambda p, q, d, g: accept_block(p, q, d, g), requires_q=True, chains_only=True,
                         help="block verification: the longest prefix by clipped joint ratio (sampled chains)"))
