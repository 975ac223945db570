"""SGLang's launch surface: `--model-path`, `--tp`, `--context-length`, `--chunked-prefill-size`,
`SGLANG_RAGGED_VERIFY_MODE`, `python -m specserve.launch_server`; the arguments a CPU cannot honour are refused
with the reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import _model, build_parser
from specserve.flags import REFUSED, config_from_args


def _serve(argv: list[str]):  # noqa: ANN202
    return build_parser().parse_args(["serve", *argv])


def test_sglang_spellings_set_our_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "padded")
    a = _serve(["--model-path", "m", "--tp", "2", "--speculative-algorithm", "DSPARK",
                "--speculative-dspark-block-size", "8", "--context-length", "512", "--chunked-prefill-size", "64"])
    c = config_from_args(a, _model(a))
    assert (c.model, c.tp_size, c.speculative_algorithm, c.speculative_dspark_block_size) == ("m", 2, "DSPARK", 8)
    assert (c.max_model_len, c.max_prefill_tokens, c.speculative_verify_packing) == (512, 64, "padded")
    monkeypatch.setenv("SPECSERVE_SPECULATIVE_VERIFY_PACKING", "compact")  # our own spelling wins
    assert config_from_args(a, _model(a)).speculative_verify_packing == "compact"


def test_model_path_and_positional_must_agree() -> None:
    assert _model(_serve(["m"])) == _model(_serve(["--model-path", "m"])) == _model(_serve(["m", "--model-path", "m"]))
    with pytest.raises(SystemExit, match="--model-path 'a' and the positional model 'b' differ"):
        _model(_serve(["b", "--model-path", "a"]))


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_arguments_a_cpu_cannot_honour_are_refused_with_the_reason(flag: str,
                                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _serve([flag, "1"])
    assert f"{flag}: not supported: {REFUSED[flag]}" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_server_module_answers_a_chat(tmp_path: Path) -> None:
    """`python -m specserve.launch_server --model-path M` as SGLang users type it, the speculative flags too."""
    import openai

    from tests.server_utils import free_port, make_tiny_dir, wait_healthy

    model, port = make_tiny_dir(tmp_path / "m"), free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--model-path", model, "--port", str(port),
                             "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"],
                            env={**os.environ, "SGLANG_RAGGED_VERIFY_MODE": "padded"}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=8,
                                      temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
