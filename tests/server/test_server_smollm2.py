"""The real default model through the real command (slow): `specserve serve --speculative-algorithm NGRAM`
on the embedded SmolLM2, driven by the `openai` client, answers as the offline LLM does and fills the
speculative usage extension.
"""
from __future__ import annotations

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams

from tests.server_utils import wait_healthy


@pytest.mark.slow
def test_specserve_serve_smollm2_ngram_chat(tmp_path) -> None:  # noqa: ANN001
    """`specserve serve --speculative-algorithm NGRAM` on the embedded SmolLM2, driven by the openai
    client; the answer equals the offline LLM's, and the speculative usage extension is filled."""
    import os
    import subprocess
    import sys

    from tests.server_utils import free_port

    port = free_port()
    env = {**os.environ, "SPECSERVE_PORT": str(port)}  # the port through the environment, the rest as flags
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--speculative-algorithm", "NGRAM",
                             "--speculative-num-draft-tokens", "4", "--dtype", "float32", "--log-interval", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=64, temperature=0)
        offline = LLM("smollm2-135m", dtype="float32").chat(messages, SamplingParams(temperature=0, max_tokens=64))
        assert r.choices[0].message.content == offline[0].text and "def" in offline[0].text
        spec = r.usage.model_extra["speculative"]
        assert spec["spec_verify_ct"] > 0 and spec["spec_accepted_tokens"] > 0 and spec["spec_accept_length"] > 1
        info = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
        assert info["resolved"]["speculative"]["algorithm"] == "NGRAM" and info["server_config"]["port"] == port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert "mean acceptance length" in (tmp_path / "serve.log").read_text()
