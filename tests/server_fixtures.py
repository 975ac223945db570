"""Shared fixtures of the HTTP server tests (tests/test_server_*.py): a tiny fp64 model directory, a live
server over it with NGRAM speculation on (one per test module), an `openai` client for it, and a helper
joining streamed completion text.
"""
from __future__ import annotations

import openai
import pytest

from .server_utils import ServerThread, make_tiny_dir


SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_dir(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def srv(model_dir: str):  # noqa: ANN201
    s = ServerThread(model_dir, **SPEC).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _text(chunks: list, index: int = 0) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
