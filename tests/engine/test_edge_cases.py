"""Corner cases found while building the server: seeds under SYNTHETIC, extreme temperatures."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from tests.tiny import reference_greedy, tiny_model


@pytest.mark.parametrize("algo", ["SYNTHETIC", "NGRAM"])
def test_seeded_request_independent_of_neighbours_under_speculation(algo: str) -> None:
    m = tiny_model("llama", vocab=11, seed=9)
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=123)
    opts = dict(speculative_algorithm=algo, speculative_num_draft_tokens=4)
    if algo == "SYNTHETIC":
        opts["speculative_synthetic_accept_rate"] = 0.5
    alone = LLM.from_model(m, **opts).generate([[1, 2, 3]], sp)[0].token_ids
    crowd = LLM.from_model(m, **opts).generate(
        [[4, 5], [1, 2, 3], [6] * 9], [SamplingParams(temperature=1.0, max_tokens=16, seed=7), sp,
                                       SamplingParams(temperature=0.5, max_tokens=5)])[1].token_ids
    assert alone == crowd


def test_tiny_temperature_is_greedy() -> None:
    m = tiny_model("llama")
    out = LLM.from_model(m).generate([[1, 2, 3]], SamplingParams(temperature=1e-300, max_tokens=8))[0]
    assert out.token_ids == reference_greedy(m, [1, 2, 3], 8) and out.finish_reason == "length"


def test_extreme_repetition_penalty_refused() -> None:
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300).validate()
