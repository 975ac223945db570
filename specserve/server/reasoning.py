"""Reasoning output (`--reasoning-parser`): a thinking model's `<think>…</think>` block moves out of the chat
answer's `content` into `reasoning_content`, streamed as `delta.reasoning_content`, as SGLang and vLLM do.

Formats (SGLang's names):
  qwen3           the output opens with `<think>` when the model thinks (Qwen3 hybrid models); otherwise it is
                  all content
  qwen3-thinking  the chat template opens the block itself (Qwen3 thinking-only models): the output starts
                  inside it
  deepseek-r1     as qwen3-thinking (DeepSeek-R1's template ends with `<think>\\n`)
Everything up to `</think>` is reasoning once inside; what follows (leading newlines dropped) is content. A
request may send `separate_reasoning: false` (SGLang) to keep it all in `content`. Only the text is split:
the tokens, and so speculation, are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_inside: bool  # the prompt opened the block: the output begins as reasoning


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", False),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", True),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", True),
}


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag split across chunks)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Text chunks in, (reasoning, content) pieces out; the pieces of a stream join to `split` of the whole."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt, self.buf = fmt, ""
        self.state = "reasoning" if fmt.starts_inside else "undecided"  # → reasoning → after → content
        self.thought = fmt.starts_inside  # the output has a reasoning block

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "undecided":  # does the output open with the start tag?
                head = self.buf.lstrip()
                if head.startswith(self.fmt.start):
                    self.state, self.buf, self.thought = "reasoning", head[len(self.fmt.start):], True
                elif self.fmt.start.startswith(head):
                    break  # whitespace or a partial tag so far: wait for more
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(self.fmt.end)
                if i < 0:
                    keep = partial_tail(self.buf, self.fmt.end)
                    reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                reasoning += self.buf[:i]
                self.state, self.buf = "after", self.buf[i + len(self.fmt.end):]
            elif self.state == "after":  # the newlines between the block and the answer are dropped
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.state = "content"
            else:
                content, self.buf = content + self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end of the output: an unclosed block stays reasoning."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", "" if self.state == "after" else rest)


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning_content or None when the output has none, content) of a whole output."""
    s = ReasoningSplitter(fmt)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2
