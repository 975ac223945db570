"""Input validation of the plain engine: invalid sampling parameters and prompts (empty, out of vocabulary,
non-integer, longer than max_model_len or the KV pool) are refused with a ValueError naming the field,
and a failed batch leaves nothing behind.
"""
from __future__ import annotations

import pytest

from specserve.core import SamplingParams
from tests.engine_helpers import V, assert_no_leak, greedy_ref, llama, make_llm  # noqa: F401, F811


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=50), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n"), (dict(n=65), "n"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(seed=-1), "seed"), (dict(stop_token_ids=[V]), "stop_token_ids"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params_name_the_field(llama, kw, field: str) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        llm.generate([[1, 2]], SamplingParams(**kw))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        llm.engine.add_request([1, 2], SamplingParams(**kw))
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("prompt,match", [
    ([], "prompt"), ([V], "prompt"), ([0, -1], "prompt"), ([1, 2.0], "prompt"), (list(range(64)) * 8, "max-model-len"),
])
def test_invalid_prompts(llama, prompt, match: str) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(prompt, SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=2))
    assert_no_leak(llm.engine)  # the valid first prompt of the failed batch was aborted


def test_prompt_longer_than_max_model_len_option(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama, max_model_len=10)
    with pytest.raises(ValueError, match="prompt.*max-model-len"):
        llm.generate([list(range(10))], SamplingParams())
    assert llm.generate([list(range(9))], SamplingParams(temperature=0, max_tokens=5))[0].token_ids == \
        greedy_ref(llama, list(range(9)), 1)


def test_prompt_larger_than_pool_rejected(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama, kv_cache_memory="8KiB", page_size=4)  # 16 slots
    with pytest.raises(ValueError, match="kv-cache-memory"):
        llm.engine.add_request(list(range(16)), SamplingParams())
    llm.engine.add_request(list(range(15)), SamplingParams())
