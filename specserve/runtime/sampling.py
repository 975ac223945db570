"""Logits processors and sampling, shared by plain decoding, verification and model drafters.

Order: penalties on raw logits → logit_bias → min_tokens → temperature → min_p → top_k → top_p.
NOTE: a verify window's row i is processed with prefix `output_ids + drafts[:i]`, exactly the prefix
plain decoding would see at that position; that is what makes penalties and min_tokens lossless under
speculation (the target's distribution at every row is the one plain decoding samples from).
"""
from __future__ import annotations

import random

import torch

from ..core import Request, SamplingParams, TokenLogprob
from ..grammar.ops import mask_after
from ..models import fused


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], drafts: list[int]
) -> torch.Tensor:
    """logits [n, V]; row i sees output `output_ids + drafts[:i]` (n ≤ len(drafts) + 1)."""
    n, V = logits.shape
    counts = torch.zeros(n, V, dtype=logits.dtype)
    if output_ids:
        counts += torch.bincount(torch.tensor(output_ids), minlength=V).to(logits.dtype)
    for i, d in enumerate(drafts[: n - 1]):
        counts[i + 1 :, d] += 1  # cumulative: later rows have seen earlier drafts
    out = logits
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids)] = True
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if params.frequency_penalty or params.presence_penalty:
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def apply_truncation(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min_p / top_k / top_p masks (-inf). For temperature > 0 only."""
    x = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p  # keep the token crossing top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted), float("-inf"))
    return x


def apply_bias_and_min_tokens(logits: torch.Tensor, params: SamplingParams, num_output: int,
                              stop_ids: tuple[int, ...]) -> torch.Tensor:
    """logit_bias added to every row; `stop_ids` at -inf on row i while num_output + i < min_tokens."""
    x = logits
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x = x.index_add(-1, torch.tensor(ids), torch.tensor(bias, dtype=x.dtype).expand(x.shape[0], -1))
    short = max(0, min(params.min_tokens - num_output, x.shape[0]))  # rows still under min_tokens
    if short and stop_ids:
        x = x.clone() if x is logits else x
        x[:short, list(stop_ids)] = float("-inf")
    return x


def target_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], drafts: list[int],
    stop_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """Processed logits rows: greedy requests take argmax of these; others softmax them into p. `stop_ids`: the
    ids min_tokens holds back (the request's `min_tokens_stop`)."""
    x = logits
    if params.needs_processing:
        x = apply_penalties(x, params, prompt_ids, output_ids, drafts) if params.needs_penalties else x
        x = apply_bias_and_min_tokens(x, params, len(output_ids), stop_ids)
    return x if params.greedy else apply_truncation(x, params)


def grammar_allowed(req: Request, drafts: list[int]) -> torch.Tensor | None:
    """Drafters: the tokens the request's grammar allows after its output + `drafts` (bool [V]), or
    None when unconstrained. NOTE: a drafter that samples must draw from its distribution masked by
    this (speculative/grammar.py), so that q is what the draft was drawn from and every draft is valid."""
    return None if req.grammar is None else mask_after(req.grammar, drafts)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Per row of [n, V] logits, the index of its first maximum: torch.argmax's choice (a NaN counts as the
    maximum). NOTE: the extension's op when it loads: a few µs per 49k-token row where torch's argmax takes
    ~45 µs, once per request per step in greedy decoding; the same index either way (tested)."""
    if fused.available():
        return torch.ops.specserve.argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def request_generator(params: SamplingParams, engine_rng: random.Random) -> torch.Generator | None:
    """A sampled request's own generator: seeded by its `seed`, else by the engine's seeded stream (drawn only
    for sampled requests, so greedy ones leave later seeds unchanged); None for greedy requests."""
    if params.greedy:
        return None
    return torch.Generator().manual_seed(params.seed if params.seed is not None else engine_rng.getrandbits(63))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] distribution with the request's own generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def expected_q(q: torch.Tensor) -> torch.Tensor:
    """E_{x~q}[q(x)] = Σ q²: a sampled draft's confidence. NOTE: a function of the row alone, never of the token
    drawn, so a window cut that reads it cannot bias which drafts are verified (drafters/learned.py `_choose`)."""
    return (q * q).sum()


def token_logprobs(raw_logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of the raw model distribution (before penalties/temperature, as vLLM reports them)."""
    lp = torch.log_softmax(raw_logits[: len(tokens)].double(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
    ranks = (lp >= chosen[:, None]).sum(dim=-1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n > 0:
        vals, ids = torch.topk(lp, top_n, dim=-1)
        tops = [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]
    return [TokenLogprob(t, c, top, k) for t, c, top, k in zip(tokens, chosen.tolist(), tops, ranks)]
