"""--reasoning-parser: the think block split from the answer, whole and streamed (any chunking joins to the
whole split), and end to end through the server."""
from __future__ import annotations

import random

import openai
import pytest

from specserve.server.reasoning import REASONING_PARSERS, ReasoningSplitter, split_reasoning
from tests.server_fixtures import model_dir  # noqa: F401  (fixture)
from tests.server_utils import ServerThread

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek-r1"]


@pytest.mark.parametrize("fmt,text,want", [
    (QWEN3, "<think>plan a, then b</think>\n\nThe answer is 4.", ("plan a, then b", "The answer is 4.")),
    (QWEN3, "  <think>x</think>y", ("x", "y")),
    (QWEN3, "The answer is 4. <think>not a block</think>", (None, "The answer is 4. <think>not a block</think>")),
    (QWEN3, "<think>cut off before the end", ("cut off before the end", "")),
    (QWEN3, "<thi", (None, "<thi")),
    (R1, "step 1, step 2\n</think>\n\n42", ("step 1, step 2\n", "42")),
    (R1, "still thinking", ("still thinking", "")),
    (QWEN3, "", (None, "")),
])
def test_split(fmt, text: str, want: tuple) -> None:  # noqa: ANN001
    assert split_reasoning(text, fmt) == want


@pytest.mark.parametrize("fmt", [QWEN3, R1])
def test_any_chunking_joins_to_the_whole_split(fmt) -> None:  # noqa: ANN001
    rng = random.Random(0)
    texts = ["<think>a</think>b", "<think>\nlong <thought> with </thin and more</think>\n\nfinal </think> text",
             "\n<think></think>\n\n", "plain answer", "x</think>y", "<think>unclosed </th"]
    for text in texts:
        whole = split_reasoning(text, fmt)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            s, r, c = ReasoningSplitter(fmt), "", ""
            for p in pieces:
                dr, dc = s.feed(p)
                r, c = r + dr, c + dc
            dr, dc = s.finish()
            assert (r + dr if s.thought else None, c + dc) == whole, (text, pieces)


def test_server_moves_the_reasoning_out_of_content(model_dir: str) -> None:  # noqa: F811
    """deepseek-r1 (the output starts inside the block): the tiny model never closes it, so its whole answer is
    reasoning, streamed and not; `separate_reasoning: false` keeps it in content; without the flag, no field."""
    srv = ServerThread(model_dir, server_options={"reasoning_parser": "deepseek-r1"}).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        kw = dict(model="tiny", messages=[{"role": "user", "content": "w1 w2"}], max_tokens=8, temperature=0)
        plain = client.chat.completions.create(**kw, extra_body={"separate_reasoning": False}).choices[0].message
        r = client.chat.completions.create(**kw).choices[0].message
        assert plain.content and r.content == "" and r.model_extra["reasoning_content"] == plain.content
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices)
        assert streamed == plain.content
        assert all(not ch.choices[0].delta.content for ch in chunks if ch.choices)
    finally:
        srv.stop()
