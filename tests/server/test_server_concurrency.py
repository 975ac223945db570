"""Concurrency: 32 concurrent streamed completions over one live server each equal the same request
served alone.
"""
from __future__ import annotations

import asyncio
import random

import openai

from tests.server_fixtures import client, model_dir, srv  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread


def test_32_concurrent_streams_equal_each_request_alone(client: openai.OpenAI, srv: ServerThread) -> None:
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(97)}" for _ in range(rng.randrange(2, 20))) for _ in range(32)]
    kw = dict(model="tiny", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(p: str) -> str:
            text, finish = "", []
            async for c in await ac.completions.create(prompt=p, stream=True, **kw):
                text += c.choices[0].text
                finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
            assert finish == ["length"]
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await ac.close()

    together = asyncio.run(run())
    assert [i for i, (a, b) in enumerate(zip(alone, together)) if a != b] == []
    assert all(len(t.split()) == 20 for t in together)
