"""The optional grammar backend: xgrammar (`pip install 'specserve[xgrammar]'`, pulls triton).
Its vocabulary is built from our tokenizer's raw token bytes (no HF download)."""
from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from .backend import GrammarBackend, GrammarError, GrammarSpec, Matcher, register_backend


class XGrammarMatcher(Matcher):
    def __init__(self, m: xgr.GrammarMatcher, vocab_size: int, eos_ids: list[int]) -> None:
        self.m, self.vocab_size = m, vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.text_tokens = torch.ones(vocab_size, dtype=torch.bool)
        self.text_tokens[eos_ids] = False

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def try_accept(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if self.is_terminated() or not self.m.accept_token(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def allowed(self) -> torch.Tensor:
        self.m.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask[0].to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, None] >> torch.arange(32)) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def is_terminated(self) -> bool:
        # NOTE: as llguidance: the grammar has ended once it is complete and allows only EOS, so both
        # backends end a request at the same token (xgrammar alone would wait for the EOS token)
        if self.m.is_terminated():
            return True
        return bool(self.m.is_completed()) and not bool((self.allowed() & self.text_tokens).any())

    def forced_tokens(self) -> list[int]:
        return []  # xgrammar forces strings, not tokens; the drafts stay the drafter's


@register_backend("xgrammar")
class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:  # noqa: ANN401
        super().__init__(tokenizer, vocab_size, eos_ids)
        special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        # special tokens spell no text (xgrammar then never allows them inside a grammar); EOS ends it
        vocab = [b"" if i in special or i >= tokenizer.vocab_size else tokenizer.token_bytes(i)
                 for i in range(vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.source)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.source)
            return self.compiler.compile_grammar(spec.source)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses for bad input
            raise GrammarError(" ".join(str(e).split())[:600]) from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled), self.vocab_size, self.eos_ids)
