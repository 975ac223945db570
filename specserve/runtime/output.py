"""EMIT: append tokens one by one and cut the run at the first finish condition.

NOTE (invariant 4): EOS, stop ids, max_tokens, the context limit and stop strings are checked
after every token of an accepted run; tokens after the cut are never emitted, counted or cached.
A request's grammar matcher advances here, one emitted token at a time, after that scan: a token
that ends the request is not fed to it, and a grammar that has terminated ends the request ("stop").
"""
from __future__ import annotations

import torch

from ..core import Request
from ..grammar.backend import GrammarError
from ..tokenizer.tokenizer import IncrementalDetokenizer
from .sampling import token_logprobs


class Emitter:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int) -> None:  # noqa: ANN001
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len
        self.detok: dict[str, object] = {}
        self.text: dict[str, str] = {}

    def emit(self, r: Request, tokens: list[int], raw: torch.Tensor) -> tuple[int, str | None]:
        """Returns (tokens emitted, finish reason or None). raw[j] are the logits that produced tokens[j]."""
        p = r.params
        reason = None
        n = 0
        for t in tokens:
            r.output_ids.append(t)
            n += 1
            if (not p.ignore_eos and t in self.eos_ids) or t in p.stop_token_ids:
                reason = "stop"
            elif p.stop and self._stop_string_hit(r, t):
                reason = "stop"
            elif len(r.output_ids) >= p.max_tokens or r.seq_len >= self.max_model_len:
                reason = "length"
            elif r.grammar is not None:
                if not r.grammar.accept(t):
                    raise GrammarError(f"token {t} violates the grammar (a mask was not applied)")
                if r.grammar.is_terminated():
                    reason = "stop"
            if reason:
                break
        if p.logprobs is not None:
            r.logprobs += token_logprobs(raw, r.output_ids[len(r.output_ids) - n :], p.logprobs)
        return n, reason

    def _stop_string_hit(self, r: Request, token: int) -> bool:
        """Incremental text; on a match the text is cut before the stop string (OpenAI semantics)."""
        if self.tokenizer is None:
            return False
        det = self.detok.setdefault(r.request_id, IncrementalDetokenizer(self.tokenizer))
        delta = det.feed(token)
        text = self.text.get(r.request_id, "") + delta
        self.text[r.request_id] = text
        window_start = max(0, len(text) - len(delta) - max(len(s) for s in r.params.stop) + 1)
        hits = [i for s in r.params.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            r.stop_text = text[: min(hits)]
            return True
        return False

    def forget(self, request_id: str) -> None:
        self.detok.pop(request_id, None)
        self.text.pop(request_id, None)
