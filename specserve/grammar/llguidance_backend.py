"""The default grammar backend: llguidance (JSON schema, regex, Lark; GBNF converted to Lark).
It builds its token trie from the `tokenizers` JSON we already hold, so it needs no HF download."""
from __future__ import annotations

from typing import Any

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark
import numpy as np
import torch

from .backend import GrammarBackend, GrammarError, GrammarSpec, Matcher, register_backend

# NOTE: llguidance stops a grammar as soon as nothing but EOS can follow, so `is_terminated` holds
# right after the last grammar token: the request ends there with finish_reason "stop".
# Compile/parse limits (llguidance's defaults, stated): a grammar past them is refused, not run.
_LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
               step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


class LLGuidanceMatcher(Matcher):
    def __init__(self, m: llg.LLMatcher, vocab_size: int) -> None:
        self.m, self.vocab_size = m, vocab_size

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    def try_accept(self, tokens: list[int]) -> int:
        return int(self.m.try_consume_tokens(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise GrammarError(f"grammar rollback of {n} tokens failed: {self.m.get_error()}")

    def allowed(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(np.bool_))

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())

    def forced_tokens(self) -> list[int]:
        return list(self.m.compute_ff_tokens())


@register_backend("llguidance")
class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:  # noqa: ANN401
        super().__init__(tokenizer, vocab_size, eos_ids)
        self.lltok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos_ids)
        self.limits = llg.LLParserLimits(**_LIMITS)

    def compile(self, spec: GrammarSpec) -> str:
        try:
            if spec.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.source)
            elif spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.source)
            else:
                grammar = llg.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
        except Exception as e:  # noqa: BLE001 - the converters raise plain exceptions for bad input
            raise GrammarError(str(e).strip()) from None
        err = llg.LLMatcher.validate_grammar(grammar, self.lltok)
        if err:
            raise GrammarError(" ".join(err.split())[:600])
        return grammar

    def matcher(self, compiled: str) -> Matcher:
        m = llg.LLMatcher(self.lltok, compiled, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(m.get_error())
        return LLGuidanceMatcher(m, self.vocab_size)
