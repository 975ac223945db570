"""Shared nouns of the engine: sampling parameters, requests, proposals, acceptance results, stats."""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .grammar.backend import GrammarSpec, check_grammar_fields


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM names). `validate()` raises ValueError naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI style, over output
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: OpenAI `logit_bias`: (token id, bias) pairs added to the raw logits of every position (a dict is accepted)
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids cannot be generated before this many output tokens (vLLM)
    n: int = 1
    logprobs: int | None = None  # None = off; k ≥ 0 = logprob of the chosen token plus top-k alternatives
    #: None = off; k ≥ 0 = per prompt position ≥ 1 the logprob of the prompt token plus top-k alternatives (vLLM)
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # OpenAI: {"type": "text" | "json_object" | "json_schema", ...}
    # SGLang-style structured output (at most one grammar per request, response_format included)
    json_schema: str | None = None  # a JSON schema as JSON text (a dict is serialized)
    regex: str | None = None
    ebnf: str | None = None  # GBNF: `root ::= ...`

    def __post_init__(self) -> None:
        # Accept a single string or lists from callers; store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    @property
    def greedy(self) -> bool:
        # below 1e-5 the softmax over-/underflows; vLLM treats such temperatures as greedy too
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_processing(self) -> bool:
        """Some processor changes the raw logits (penalties, logit_bias, min_tokens)."""
        return self.needs_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(field_: str, msg: str) -> None:
            raise ValueError(f"{field_}: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (0.01 <= self.repetition_penalty <= 10.0):
            bad("repetition_penalty", f"must be in [0.01, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.n, int) or not (1 <= self.n <= 64):
            bad("n", f"must be an integer in [1, 64], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not (0 <= k <= 20)):
                bad(name, f"must be an integer in [0, 20], got {k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "every stop string must be a non-empty string")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"token id {t!r} out of range [0, {vocab_size})")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("logit_bias", f"token id {t!r} out of range [0, {vocab_size})")
            if not isinstance(b, (int, float)) or not (-100.0 <= b <= 100.0):
                bad("logit_bias", f"bias of token {t} must be in [-100, 100], got {b!r}")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.min_tokens and self.has_grammar:  # a grammar that must end could be left no token at all
            bad("min_tokens", "not supported with structured output (response_format, json_schema, regex, ebnf)")
        check_grammar_fields(self)

    @property
    def has_grammar(self) -> bool:
        return GrammarSpec.from_params(self) is not None


class FatalEngineError(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died): every request in flight fails with this
    message, nothing is retried per request, and a server reports unhealthy and exits."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N alternatives (token id, logprob), best first
    rank: int  # 1-based rank of token_id: how many tokens have a logprob ≥ its own (vLLM's count)


@dataclass(eq=False)  # NOTE: an entity: compared by identity (a field-by-field == made `req in running` O(fields))
class Request:
    """One sequence. NOTE: committed_len counts tokens whose KV is final in the target pool;
    tokens [committed_len, len(all_ids)) are known but their KV is not (the last token, always)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # None for greedy: greedy rows draw no random numbers
    grammar: Any = None  # grammar.Matcher of structured output (None = unconstrained); advanced only by Emit
    #: ids masked while the output is shorter than params.min_tokens: the engine's EOS ids and stop_token_ids
    min_tokens_stop: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: params.prompt_logprobs: per prompt position collected so far (None at position 0: nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    committed_len: int = 0
    state_slot: int | None = None  # hybrid targets: its StatePool slot (state after committed_len tokens)
    # prefix cache: the hash chain of its full pages (grown as pages fill), how many leading page-table
    # entries are cached pages, and the prompt tokens its first admission found cached (None = not admitted)
    page_keys: list[bytes] = field(default_factory=list)
    num_cached_pages: int = 0
    cached_tokens: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    stop_text: str | None = None  # the output text, cut before the stop string that matched
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # speculative stats (acceptance length = 1 + accepted_tokens / spec_verify_ct, bonus included)
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_decode_steps: int = 0  # decode steps, with or without drafts (mean window = draft_tokens / steps)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must exist before decoding: the prompt, or after a preemption everything
        but the last token (which the next decode step feeds)."""
        return self.seq_len - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        return self.committed_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all collected: its prefill computes the logits of its prompt rows,
        which a cached prefix cannot give (the cache holds KV, not logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)


@dataclass
class DraftPlan:
    """The draft stage's plan for a decode batch, per request: which of the drafter's `sources` drafts for it
    (decided from committed tokens only) and at most how many tokens it may propose (0: none). The window
    policy fills the windows in; the drafter drafts under it."""

    sources: list[str]
    windows: list[int]

    def split(self) -> list["DraftPlan"]:
        return [DraftPlan([s], [w]) for s, w in zip(self.sources, self.windows)]

    @staticmethod
    def join(parts: list["DraftPlan"]) -> "DraftPlan":
        return DraftPlan([s for p in parts for s in p.sources], [w for p in parts for w in p.windows])


@dataclass
class Proposal:
    """Draft tokens for a decode batch, ragged: request b proposes len(tokens[b]) ≥ 0 tokens.

    q[b]: [len, V] draft distributions the tokens were *sampled* from, or None for deterministic
    (argmax / lookup) drafts, which are verified as one-hot. confidence[b]: optional per-token scores.
    """

    tokens: list[list[int]]
    q: list[torch.Tensor | None] | None = None
    confidence: list[torch.Tensor | None] | None = None
    # tree drafts (EAGLE-2): parents[b][i] = index of node i's parent (−1 = the root, the last token);
    # nodes are in topological order, so any prefix of a tree proposal is a tree (speculative/tree.py)
    parents: list[list[int] | None] | None = None

    @staticmethod
    def empty(batch_size: int) -> "Proposal":
        return Proposal(tokens=[[] for _ in range(batch_size)])

    def split(self) -> list["Proposal"]:
        """One single-request proposal per request."""
        def one(xs: list | None, b: int) -> list | None:
            return None if xs is None else [xs[b]]

        return [Proposal([t], one(self.q, b), one(self.confidence, b), one(self.parents, b))
                for b, t in enumerate(self.tokens)]

    @staticmethod
    def join(parts: list["Proposal"]) -> "Proposal":
        def cat(name: str) -> list | None:
            if all(getattr(p, name) is None for p in parts):
                return None
            return [x for p in parts for x in (getattr(p, name) or [None] * len(p.tokens))]

        return Proposal([t for p in parts for t in p.tokens], cat("q"), cat("confidence"), cat("parents"))

    def truncate(self, windows: list[int]) -> "Proposal":
        """The first windows[b] drafts of each request (a prefix of a tree proposal is a tree: nodes
        are in topological order)."""
        def cut(xs: list | None) -> list | None:
            return None if xs is None else [None if x is None else x[:w] for x, w in zip(xs, windows)]

        return Proposal([t[:w] for t, w in zip(self.tokens, windows)], cut(self.q), cut(self.confidence),
                        cut(self.parents))


@dataclass
class AcceptResult:
    """Per request: accepted draft count and the emitted tokens (accepted drafts + one bonus/correction)."""

    num_accepted: int
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # e.g. NaN in this request's logits: fail it alone
    path: list[int] | None = None  # trees: the accepted node indices, root's child first


def count_per_pos(per_pos: list[int], num_draft: int, num_accepted: int) -> None:
    """Grow `per_pos` to num_draft positions and count one acceptance at each of the first num_accepted."""
    if len(per_pos) < num_draft:
        per_pos += [0] * (num_draft - len(per_pos))
    for i in range(num_accepted):
        per_pos[i] += 1


@dataclass
class SpecStats:
    """Engine-wide counters, named as vLLM names them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_tokens_per_pos: list[int] = field(default_factory=list)
    window_counts: list[int] = field(default_factory=list)  # decode rows by window size chosen (0 = plain)
    #: draft source (drafters/base.py `sources`, "grammar" for forced tokens) → [draft tokens, accepted tokens]
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def copy(self) -> "SpecStats":
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_tokens_per_pos), list(self.window_counts),
                         {k: list(v) for k, v in self.by_source.items()})

    def record_window(self, k: int) -> None:
        if len(self.window_counts) <= k:
            self.window_counts += [0] * (k + 1 - len(self.window_counts))
        self.window_counts[k] += 1

    def record(self, num_draft: int, num_accepted: int, source: str = "") -> None:
        if num_draft == 0:
            return
        if source:
            per = self.by_source.setdefault(source, [0, 0])
            per[0] += num_draft
            per[1] += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        count_per_pos(self.accepted_tokens_per_pos, num_draft, num_accepted)

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify forward, bonus included: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Completion:
    """One generated sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    meta_info: dict[str, Any]
    error: str | None = None


@dataclass
class RequestOutput:
    """Result for one prompt; `outputs` holds its n samples. text/token_ids/... mirror outputs[0]."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    #: SamplingParams.prompt_logprobs: per prompt position None (position 0) or the prompt token's TokenLogprob
    prompt_logprobs: list[TokenLogprob | None] | None = None

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    logprobs = property(lambda self: self.outputs[0].logprobs)
    meta_info = property(lambda self: self.outputs[0].meta_info)
    error = property(lambda self: self.outputs[0].error)
