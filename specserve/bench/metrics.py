"""Benchmark arithmetic, kept pure so tests can check it on recorded inputs.

Acceptance length τ = tokens per verify forward = 1 + accepted drafts / verify forwards: the
bonus/correction token is always counted (DFlash/EAGLE/SGLang convention; vLLM's "mean accepted"
is τ − 1). Inter-token latency is per token, not per chunk: a chunk of n tokens arriving g seconds
after the previous one contributes n gaps of g / n (SGLang #12064 counted one gap of g).
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable


def acceptance(metas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Pool per-request meta_info (spec_verify_ct, spec_accepted_tokens, spec_accepted_per_pos)."""
    verify = accepted = drafted = 0
    per_pos: list[int] = []
    for m in metas:
        verify += m.get("spec_verify_ct", 0)
        accepted += m.get("spec_accepted_tokens", 0)
        drafted += m.get("spec_draft_tokens", 0)
        for i, a in enumerate(m.get("spec_accepted_per_pos", [])):
            per_pos += [0] * (i + 1 - len(per_pos))
            per_pos[i] += a
    return {
        "verify_forwards": verify,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "accept_length": 1.0 + accepted / verify if verify else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        # P(draft position i accepted) per verify forward
        "per_position": [a / verify for a in per_pos] if verify else [],
    }


def per_token_itl(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """chunk_times[j]: arrival of chunk j (chunk 0 carries the first token); chunk_tokens[j] ≥ 1."""
    out: list[float] = []
    for j in range(1, len(chunk_times)):
        gap = chunk_times[j] - chunk_times[j - 1]
        n = chunk_tokens[j]
        out += [gap / n] * n
    first = chunk_tokens[0] if chunk_tokens else 0
    out = [0.0] * (first - 1) + out if first > 1 else out  # tokens that arrived with the first
    return out


def tpot(e2e: float, ttft: float, completion_tokens: int) -> float | None:
    """Time per output token after the first."""
    return (e2e - ttft) / (completion_tokens - 1) if completion_tokens > 1 else None


def percentiles(xs: list[float], ps: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    if not xs:
        return {f"p{int(p)}": float("nan") for p in ps} | {"mean": float("nan")}
    s = sorted(xs)
    out = {f"p{int(p)}": s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] for p in ps}
    out["mean"] = statistics.fmean(s)
    return out
