"""Token ids → text for responses: streaming deltas that never leak a stop string, the two
logprobs shapes (completions: parallel lists; chat: one object per token, with `bytes`) and vLLM's
`prompt_logprobs`."""
from __future__ import annotations

import math
from typing import Any

from ..core import TokenLogprob
from ..tokenizer.tokenizer import IncrementalDetokenizer


class TextStream:
    """One sequence's text, released delta by delta.

    Text that could be the beginning of a stop string is held back until the engine either finishes
    the sequence (then the final text is cut before the stop string) or the text moves past it.
    NOTE: the joined deltas equal `final_text` exactly, so streamed and non-streamed text agree.
    `keep`: special tokens spelled out in the text rather than skipped (token id → text: a tool-call marker
    such as Mistral's [TOOL_CALLS]); the text between them decodes as separate runs, alike in both paths.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), keep: dict[int, str] | None = None) -> None:
        self.tok = tokenizer
        self.det = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.keep = keep or {}
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = ""  # the part already released

    def step(self, ids: list[int], finished: bool = False, stop_text: str | None = None) -> str:
        """Text released by one Delta. NOTE: a finishing Delta must go through `finish` alone: its
        tokens may complete a stop string that `feed` would no longer hold back."""
        if finished:
            self.ids += ids
            return self.finish(stop_text)
        return self.feed(ids)

    def feed(self, ids: list[int]) -> str:
        self.ids += ids
        if self.det is not None:
            for t in ids:
                if t in self.keep:
                    self.text += self.det.flush() + self.keep[t]
                    self.det = IncrementalDetokenizer(self.tok)
                else:
                    self.text += self.det.feed(t)
        end = len(self.text) - self._holdback()
        if end <= len(self.sent):
            return ""
        delta = self.text[len(self.sent) : end]
        self.sent += delta
        return delta

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def final_text(self, stop_text: str | None) -> str:
        if self.tok is None:
            return stop_text or ""
        if not self.keep:
            return stop_text if stop_text is not None else self.tok.decode(self.ids)
        full = self._decode_keeping()
        if stop_text is None:
            return full
        # the engine cut a text without the kept tokens: cut ours at the same first stop string
        hits = [i for s in self.stop if (i := full.find(s)) >= 0]
        return full[: min(hits)] if hits else stop_text

    def _decode_keeping(self) -> str:
        parts, run = [], []
        for t in self.ids:
            if t in self.keep:
                parts += [self.tok.decode(run), self.keep[t]]
                run = []
            else:
                run.append(t)
        return "".join([*parts, self.tok.decode(run)])

    def finish(self, stop_text: str | None) -> str:
        """The rest of the text at the end of the sequence."""
        final = self.final_text(stop_text)
        if not final.startswith(self.sent):  # cannot happen with a consistent tokenizer; never resend
            final = self.sent + (self.det.flush() if self.det is not None else "")
        delta = final[len(self.sent) :]
        self.sent = final
        return delta


def finite(x: float) -> float:
    """JSON has no -inf: an underflowed logprob is reported as -9999.0 (vLLM's convention)."""
    return x if math.isfinite(x) else -9999.0


def token_str(tok: Any, token_id: int) -> str:
    if tok is None:
        return f"token_id:{token_id}"
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tok: Any, lps: list[TokenLogprob | None], offset: int = 0, ids: list[int] | None = None,
                        top_n: int | None = None) -> dict[str, Any]:
    """Completions shape: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}. An echoed
    prompt's first entry is None (nothing predicts it): null logprob and top_logprobs, its token from `ids` (the
    entries' token ids). top_n: at most that many alternatives (prompt logprobs may hold more)."""
    tokens, offsets = [], []
    for i, lp in enumerate(lps):
        s = token_str(tok, ids[i] if lp is None else lp.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else finite(lp.logprob) for lp in lps],
        "top_logprobs": [None if lp is None else {token_str(tok, i): finite(v) for i, v in lp.top[:top_n]}
                         for lp in lps],
        "text_offset": offsets,
    }


def prompt_logprobs(tok: Any, lps: list[TokenLogprob | None], top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt token and its top_n alternatives (ranks 1..top_n), the prompt token first."""
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": token_str(tok, token_id)}

    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (i, v) in enumerate(lp.top[:top_n], 1):
            d.setdefault(str(i), entry(i, v, rank))
        out.append(d)
    return out


def chat_logprobs(tok: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    """Chat shape: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        b = tok.token_bytes(token_id) if tok is not None else b""
        return {"token": token_str(tok, token_id), "logprob": finite(logprob), "bytes": list(b)}

    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}
                        for lp in lps]}


def stop_reason(ids: list[int], stop_token_ids: tuple[int, ...], stop_text: str | None, full: str,
                stops: tuple[str, ...]) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the sequence, None for EOS."""
    if stop_text is not None:
        rest = full[len(stop_text) :]
        return next((s for s in stops if rest.startswith(s)), None)
    if ids and ids[-1] in stop_token_ids:
        return ids[-1]
    return None
