"""Stop conditions of the plain engine: stop token ids, the model's EOS (also as the very first token),
ignore_eos (which does not ignore explicit stop ids), and max_tokens.
"""
from __future__ import annotations

import pytest

from specserve.core import SamplingParams
from tests.engine_helpers import PROMPTS, llama, make_llm  # noqa: F401, F811
from tests.tiny import reference_greedy, tiny_model


def _first_occurrence_token(ref: list[int], start: int) -> tuple[int, int]:
    for j in range(start, len(ref)):
        if ref[j] not in ref[:j]:
            return ref[j], j
    raise AssertionError("no fresh token")


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    base = tiny_model("llama", seed=0)
    p = [1, 2, 3, 4, 5]
    ref = reference_greedy(base, p, 30)
    t, j = _first_occurrence_token(ref, 4)
    # stop_token_ids
    o = make_llm(base).generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t]))[0]
    assert o.token_ids == ref[: j + 1] and o.finish_reason == "stop"
    # the model's EOS (same weights, eos set in the config)
    eos_model = tiny_model("llama", seed=0, eos_token_ids=(t,))
    llm = make_llm(eos_model)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=30))[0]
    assert o.token_ids == ref[: j + 1] and o.finish_reason == "stop"
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert o.token_ids == ref and o.finish_reason == "length"
    # ignore_eos does not ignore explicit stop ids
    t2, j2 = _first_occurrence_token(ref, j + 1)
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(t2,)))[0]
    assert o.token_ids == ref[: j2 + 1] and o.finish_reason == "stop"
    # EOS as the very first token
    eos_first = tiny_model("llama", seed=0, eos_token_ids=(ref[0],))
    o = make_llm(eos_first).generate([p], SamplingParams(temperature=0, max_tokens=30))[0]
    assert o.token_ids == ref[:1] and o.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(llama, max_tokens: int) -> None:  # noqa: ANN001
    outs = make_llm(llama).generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=max_tokens, seed=1))
    for o in outs:
        assert len(o.token_ids) == max_tokens and o.finish_reason == "length"
        assert o.meta_info["completion_tokens"] == max_tokens
