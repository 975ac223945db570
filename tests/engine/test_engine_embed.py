"""Engine.embed: one forward per input between steps, its pages given back; bad inputs refused naming `input`."""
from __future__ import annotations

import pytest

from specserve import LLM
from tests.tiny import tiny_model


def test_embed_gives_pages_back_and_names_bad_input() -> None:
    llm = LLM.from_model(tiny_model("llama"), kv_cache_memory="256KiB")
    eng = llm.engine
    free = eng.kv.allocator.num_free
    a, b = eng.embed([[5, 6, 7], [5, 6, 7, 8]])
    assert len(a) == eng.model.cfg.hidden_size and abs(sum(x * x for x in a) - 1) < 1e-9 and a != b
    assert eng.embed([[5, 6, 7]])[0] == a  # deterministic, no state kept
    assert eng.kv.allocator.num_free == free
    with pytest.raises(ValueError, match="^input: token ids must be integers"):
        eng.embed([[5, 10_000]])
    with pytest.raises(ValueError, match="^input: .* tokens"):
        eng.embed([[5] * 100_000])
    assert eng.kv.allocator.num_free == free
