"""Repetition, presence and frequency penalties in the plain engine: greedy tokens are the argmax of
independently penalized reference logits, penalties move repetition in the expected direction, a huge
repetition penalty never repeats, and penalized sampling is seeded and stays in its support.
"""
from __future__ import annotations

import pytest

from specserve.core import SamplingParams
from tests.engine_helpers import PROMPTS, greedy_ref, llama, make_llm, output_rows  # noqa: F401, F811


def _reference_penalized_ok(model, prompt: list[int], out: list[int], sp: SamplingParams) -> None:  # noqa: ANN001
    """Independent oracle: every greedy token is the argmax of penalized reference logits."""
    rows = output_rows(model, prompt, out)
    for j, (row, t) in enumerate(zip(rows, out)):
        x = row.clone()
        seen_out = out[:j]
        if sp.repetition_penalty != 1.0:
            for tok in set(prompt) | set(seen_out):
                x[tok] = x[tok] / sp.repetition_penalty if x[tok] > 0 else x[tok] * sp.repetition_penalty
        for tok in set(seen_out):
            x[tok] -= sp.frequency_penalty * seen_out.count(tok) + sp.presence_penalty
        assert t == int(x.argmax()), (j, sp)


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


@pytest.mark.parametrize("kw,direction", [
    (dict(presence_penalty=2.0), "fewer"), (dict(frequency_penalty=2.0), "fewer"),
    (dict(repetition_penalty=1.5), "fewer"), (dict(presence_penalty=-2.0), "more"),
    (dict(repetition_penalty=0.2), "more"), (dict(frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.2), "fewer"),
])
def test_penalties_exact_and_direction(llama, kw, direction: str) -> None:  # noqa: ANN001
    llm = make_llm(llama, page_size=4)
    sp = SamplingParams(temperature=0, max_tokens=30, **kw)
    outs = llm.generate(PROMPTS, sp)
    base = sum(_repeats(greedy_ref(llama, p, 30)) for p in PROMPTS)
    for o, p in zip(outs, PROMPTS):
        _reference_penalized_ok(llama, p, o.token_ids, sp)
    got = sum(_repeats(o.token_ids) for o in outs)
    assert got < base if direction == "fewer" else got > base


def test_huge_repetition_penalty_never_repeats(llama) -> None:  # noqa: ANN001
    outs = make_llm(llama).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, repetition_penalty=10.0))
    for o, p in zip(outs, PROMPTS):
        assert _repeats(o.token_ids) == 0 and not set(o.token_ids) & set(p)


def test_penalties_with_sampling_are_seeded_and_valid(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    sp = SamplingParams(temperature=0.8, top_k=4, max_tokens=20, presence_penalty=2.0, seed=3)
    a = llm.generate(PROMPTS, sp)
    b = make_llm(llama).generate(PROMPTS, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o, p in zip(a, PROMPTS):  # support: top-4 of the *penalized* logits
        rows = output_rows(llama, p, o.token_ids)
        for j, (row, t) in enumerate(zip(rows, o.token_ids)):
            x = row.clone()
            for tok in set(o.token_ids[:j]):
                x[tok] -= 2.0
            assert int((x > x[t]).sum()) < 4
