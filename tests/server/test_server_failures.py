"""Server lifecycle and failure isolation: /health answers 503 while the model loads, then 200, with API
key authentication; NaN logits or a crashing engine step fail only the affected request (500 naming
the cause, also when streaming) while the server keeps serving the others.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai

from tests.server_fixtures import SPEC
from tests.server_fixtures import model_dir  # noqa: F401, F811  (fixtures)
from tests.server_utils import ServerThread, sse_events, wait_healthy


POISON, CRASH = 96, 95  # prompt tokens that make the faulty engine below misbehave


def test_health_503_while_loading_then_200_and_api_key(model_dir: str) -> None:
    from specserve.engine.build import build_engine

    gate = threading.Event()

    def factory(cfg):  # noqa: ANN001, ANN202
        return lambda: (gate.wait(60), build_engine(cfg))[1]

    s = ServerThread(model_dir, engine_factory=factory, api_key="sekret").start(wait_ready=False)
    try:
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error", "param": None}}
        auth = {"Authorization": "Bearer sekret"}
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "w1"}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        gate.set()
        wait_healthy(s.url, 60)
        assert httpx.get(f"{s.url}/health").json() == {"status": "ok"}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{s.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="w1", max_tokens=2).usage.completion_tokens == 2
    finally:
        gate.set()
        s.stop()


def _faulty(cfg):  # noqa: ANN001, ANN202
    """An engine whose logits are NaN for prompts containing POISON, and whose step() raises while a
    prompt containing CRASH is in flight."""
    from specserve.engine.build import build_engine
    from specserve.engine.engine import Engine

    def build() -> Engine:
        eng = build_engine(cfg)
        fwd, step = eng.runner.forward, eng.step

        def forward(page_tables, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            logits, hidden = fwd(page_tables, *args, **kw)
            bad = {id(r.page_table) for r in list(eng.requests.values()) if POISON in r.prompt_ids}
            return [x.fill_(float("nan")) if id(pt) in bad else x for x, pt in zip(logits, page_tables)], hidden

        def crashing_step():  # noqa: ANN202
            if any(CRASH in r.prompt_ids for r in eng.requests.values()):
                raise RuntimeError("boom")
            return step()

        eng.runner.forward, eng.step = forward, crashing_step
        return eng

    return build


def test_engine_failure_fails_only_that_request(model_dir: str) -> None:
    s = ServerThread(model_dir, engine_factory=_faulty, **SPEC).start()
    try:
        good = {"prompt": "w1 w2 w3", "max_tokens": 16, "temperature": 0}
        ref = httpx.post(f"{s.url}/v1/completions", json=good, timeout=60).json()["choices"][0]["text"]

        async def pair() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                return await asyncio.gather(ac.post("/v1/completions", json={**good, "prompt": f"w1 w{POISON}"}),
                                            ac.post("/v1/completions", json=good))

        bad, ok = asyncio.run(pair())
        assert bad.status_code == 500 and "NaN" in bad.json()["error"]["message"]
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref
        events = sse_events(httpx.post(f"{s.url}/v1/completions", json={**good, "prompt": f"w{POISON}", "stream": True},
                                       timeout=60).text)
        assert "NaN" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        crash = httpx.post(f"{s.url}/v1/completions", json={**good, "prompt": f"w{CRASH}"}, timeout=60)
        assert crash.status_code == 500 and "boom" in crash.json()["error"]["message"]
        after = httpx.post(f"{s.url}/v1/completions", json=good, timeout=60)  # still serving
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == ref
    finally:
        s.stop()
