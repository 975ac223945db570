"""Fuzz the HTTP API from the server's own OpenAPI schema (schemathesis strategies driven by
hypothesis): valid and invalid bodies alike must never get a 5xx, nor an error event in a stream.
Bounded: a fixed number of derandomized examples per operation and generation mode."""
from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from specserve.config import EngineConfig  # noqa: E402
from specserve.server.app import create_app  # noqa: E402

from tests.server_utils import ServerThread, make_tiny_dir, sse_events  # noqa: E402

EXAMPLES = 20  # per (operation, mode)


def _labels() -> list[tuple[str, GenerationMode]]:
    """Operations of the app's schema (built without starting anything), each with its modes."""
    spec = create_app(EngineConfig.from_sources({"model": "unused"}, environ={})).openapi()
    out = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            out.append((f"{method.upper()} {path}", GenerationMode.POSITIVE))
            if "requestBody" in op:
                out.append((f"{method.upper()} {path}", GenerationMode.NEGATIVE))
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    # a short context keeps "max_tokens: 10**9" cheap; speculation on, as in production
    s = ServerThread(make_tiny_dir(tmp_path_factory.mktemp("fuzz") / "m"), max_model_len=24,
                     speculative_algorithm="NGRAM", speculative_num_draft_tokens=3).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schema(srv: ServerThread):  # noqa: ANN201
    return schemathesis.openapi.from_url(f"{srv.url}/openapi.json")


@pytest.mark.parametrize("label,mode", _labels(), ids=lambda x: x if isinstance(x, str) else x.value)
def test_no_server_errors(srv: ServerThread, schema, label: str, mode: GenerationMode) -> None:  # noqa: ANN001
    op = schema.find_operation_by_label(label)
    assert op is not None, label

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(mode))
    def check(case) -> None:  # noqa: ANN001
        r = case.call(base_url=srv.url, timeout=60)
        assert r.status_code < 500, f"{case.method} {case.path} body={case.body!r} -> {r.status_code} {r.text[:500]}"
        assert "internal_server_error" not in r.text, f"body={case.body!r} -> {r.text[-500:]}"

    check()


# ---- hypothesis: valid completions bodies, checked for invariants -----------------------------------
WORD = st.integers(0, 96).map(lambda i: f"w{i}")
TEXT = st.lists(WORD, min_size=1, max_size=8).map(" ".join)
STOP = st.one_of(WORD, st.lists(WORD, min_size=2, max_size=2).map(" ".join), st.sampled_from(["w", " w1", "1 w", "w9"]))
BODY = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2), st.lists(st.integers(0, 96), min_size=1, max_size=8)),
     "seed": st.integers(0, 2**63 - 1)},
    optional={"max_tokens": st.integers(1, 12), "temperature": st.one_of(st.just(0.0), st.floats(0, 2)),
              "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 120), "min_p": st.floats(0, 1),
              "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
              "frequency_penalty": st.floats(-2, 2), "stop": st.one_of(STOP, st.lists(STOP, max_size=3)),
              "stop_token_ids": st.lists(st.integers(0, 96), max_size=3), "n": st.integers(1, 3),
              "logprobs": st.integers(0, 5), "ignore_eos": st.booleans(), "echo": st.booleans()},
)


@settings(max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=BODY)
def test_valid_completions_keep_their_invariants(srv: ServerThread, body: dict) -> None:
    """Seeded, so deterministic: the stream must carry exactly the non-streamed text, no stop string
    may appear in an output, and usage must add up (the same token counts streamed or not)."""
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    prompts = [body["prompt"]] if isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int) else body["prompt"]
    n = body.get("n", 1)
    assert [c["index"] for c in j["choices"]] == list(range(len(prompts) * n))
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", [])
    for c in j["choices"]:
        assert c["finish_reason"] in ("stop", "length")
        out = c["text"][len(prompts[c["index"] // n]):] if body.get("echo") and isinstance(prompts[0], str) else c["text"]
        assert not any(s in out for s in stops), (out, stops)
        if "logprobs" in body:  # with echo, the prompt's tokens come first
            p = prompts[c["index"] // n]
            echoed = (len(p.split()) if isinstance(p, str) else len(p)) if body.get("echo") else 0
            assert len(c["logprobs"]["tokens"]) <= echoed + body.get("max_tokens", 16)
    assert j["usage"]["completion_tokens"] <= len(prompts) * n * body.get("max_tokens", 16)
    events = sse_events(httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                for i in range(len(j["choices"]))]
    assert streamed == [c["text"] for c in j["choices"]]
    # NOTE: the speculative figures depend on history (the suffix index learns from each finished request), the
    # tokens do not
    assert {k: v for k, v in chunks[-1]["usage"].items() if k != "speculative"} == {
        k: v for k, v in j["usage"].items() if k != "speculative"}
