"""Engine-level distribution check: the joint law of the first L generated tokens, enumerated
exactly on a tiny-vocabulary model, against the engine's empirical law over N seeded requests.
The statistic is Pearson's X² over the joint's cells; its bar comes from direct samples of the exact law
with the same N (the null distribution, Monte Carlo: small cells make the χ² approximation unreliable).
X² sees a 1.2× ratio bias that total variation did not (tests/speculative/test_dist_power.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.core import SamplingParams


def exact_joint(model, prompt: list[int], length: int, params: SamplingParams,  # noqa: ANN001
                allowed=None, stop_ids: tuple[int, ...] = ()) -> dict[tuple[int, ...], float]:  # noqa: ANN001
    """Exact distribution of the first `length` tokens under `params` (enumeration, full recompute).
    `allowed(seq) → bool [V]`: a grammar's allowed set after output `seq`, applied to the raw logits.
    `stop_ids`: what params.min_tokens holds back."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner
    from specserve.runtime.sampling import target_logits

    def probs(ids: list[int]) -> torch.Tensor:
        kv = KVPool(model.cfg, 4, 16, model.dtype)
        pt: list[int] = []
        kv.ensure(pt, len(ids))
        logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [[len(ids) - 1]])
        raw = logits[0] if allowed is None else logits[0].masked_fill(~allowed(ids[len(prompt):]), float("-inf"))
        x = target_logits(raw, params, prompt, ids[len(prompt):], [], stop_ids)
        return torch.softmax(x, dim=-1)[0]

    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, pr in joint.items():
            for t, pt_ in enumerate(probs(prompt + list(seq)).tolist()):
                if pt_ > 0:
                    nxt[seq + (t,)] = pr * pt_
        joint = nxt
    return joint


NULL_DRAWS, NULL_SDS = 2000, 5.0


@dataclass
class JointFit:
    """The engine's first-L-token counts against the exact joint."""
    x2: float  # Pearson X² (inf when the engine emitted a sequence of probability 0)
    bar: float  # mean + NULL_SDS·sd of X² over NULL_DRAWS direct samples of the exact joint, same N
    tv: float  # total variation (reported only)
    outs: list

    @property
    def ok(self) -> bool:
        return self.x2 <= self.bar

    def __str__(self) -> str:
        return f"X² {self.x2:.1f} vs bar {self.bar:.1f} (TV {self.tv:.4f}, N {len(self.outs)})"


def joint_fit(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], n: int,
              outs: list | None = None) -> JointFit:
    keys = list(exact)
    p = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    c = torch.tensor([float(counts.get(k, 0)) for k in keys], dtype=torch.float64)
    impossible = sum(v for k, v in counts.items() if exact.get(k, 0.0) == 0.0)
    x2 = float(((c - n * p) ** 2 / (n * p)).sum()) if not impossible else math.inf
    # the null: X² of direct samples of the exact joint (deterministic generator: a fixed bar)
    draws = torch.multinomial(p.expand(NULL_DRAWS, -1), n, replacement=True, generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(draws, dtype=torch.float64)
    null_c = torch.zeros(NULL_DRAWS, len(keys), dtype=torch.float64).scatter_add_(1, draws, ones)
    null = ((null_c - n * p) ** 2 / (n * p)).sum(1)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    return JointFit(x2, float(null.mean() + NULL_SDS * null.std()), tv, outs or [])


def engine_vs_exact_joint(llm, prompt: list[int], length: int, base: SamplingParams, n: int,  # noqa: ANN001
                          allowed=None, stop_ids: tuple[int, ...] = ()) -> JointFit:  # noqa: ANN001
    """The engine's outputs of n seeded requests against the exact joint (assert fit.ok, fit)."""
    exact = exact_joint(llm.engine.model, prompt, length, base, allowed, stop_ids)
    outs = llm.generate([prompt] * n, [SamplingParams(**{**base.__dict__, "seed": s}) for s in range(n)])
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return joint_fit(counts, exact, n, outs)


# ---- negative controls: deliberately wrong acceptance rules (they must FAIL the test above) ----
# NOTE: the one place that names the module whose rule functions the accept stage runs (speculative/rules.py: its
# registry calls them by these names), so patching them there swaps the rule.
ACCEPT_STAGE = "specserve.speculative.rules"


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen).item())


def biased_ratio_rule(factor: float = 1.2):  # noqa: ANN201
    """accept x_i with min(1, factor · p/q) instead of min(1, p/q); residual as the real rule."""
    def rule(p, q, draft, gen):  # noqa: ANN001, ANN202
        for i, x in enumerate(draft):
            u = torch.rand((), generator=gen, dtype=torch.float64).item()
            if u * float(q[i, x]) > factor * float(p[i, x]):
                r = torch.clamp(p[i] - q[i], min=0)
                return i, _draw(r if r.sum() > 0 else p[i], gen)
        return len(draft), _draw(p[len(draft)], gen)
    return rule


def no_residual_rule(p, q, draft, gen):  # noqa: ANN001, ANN201
    """the right ratio test, but the correction drawn from p instead of the residual max(p − q, 0)."""
    for i, x in enumerate(draft):
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        if u * float(q[i, x]) > float(p[i, x]):
            return i, _draw(p[i], gen)
    return len(draft), _draw(p[len(draft)], gen)
