"""NaN isolation: NaN logits in one request's verify (bonus row only) or prefill fail that request alone
with an error naming NaN; its neighbours finish exactly as without the fault and nothing leaks.
"""
from __future__ import annotations

import random

import pytest
import torch

import specserve.engine.engine as engine_mod
from specserve.core import SamplingParams
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, check_stats, drive, make_llm
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)
from tests.tiny import tiny_model


@pytest.mark.parametrize("algo", [SYN, NGRAM, None])
def test_nan_in_verify_fails_only_that_request(algo: str | None, verify_mode: str, monkeypatch) -> None:  # noqa: ANN001
    model = tiny_model("qwen2", seed=6)
    rng = random.Random(3)
    plan = [(i % 3, [rng.randrange(V) for _ in range(rng.randint(2, 12))], SamplingParams(temperature=0, max_tokens=20))
            for i in range(5)]
    plain = drive(make_llm(model, page_size=4), plan)
    victim = "p2"
    real_verify = engine_mod.verify
    hits = []

    def nan_verify(runner, reqs, proposal, mode="compact", aux=()):  # noqa: ANN001, ANN202
        logits, feats, states = real_verify(runner, reqs, proposal, mode, aux)
        for i, r in enumerate(reqs):
            if r.request_id == victim and len(r.output_ids) >= 4:
                logits[i] = logits[i].clone()
                logits[i][-1, 3] = float("nan")  # the bonus row only: the drafts' rows look fine
                hits.append(len(r.output_ids))
        return logits, feats, states

    monkeypatch.setattr(engine_mod, "verify", nan_verify)
    llm = make_llm(model, algo, 6, rate=0.9, page_size=4)
    spec = drive(llm, plan)
    assert hits == [hits[0]]  # failed at the first poisoned verify, never verified again
    for (_, prompt, _), a, b in zip(plan, plain, spec):
        if b.request_id == victim:
            assert b.finish_reason == "error" and "NaN" in b.error
            assert b.output_ids == a.output_ids[: len(b.output_ids)] and len(b.output_ids) == hits[0]
        else:
            assert b.output_ids == a.output_ids and b.finish_reason == "length" and b.error is None
    if algo:
        check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


def test_nan_in_prefill_fails_only_that_request(monkeypatch) -> None:  # noqa: ANN001
    model = tiny_model("llama", seed=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14]]
    plain = make_llm(model).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    llm = make_llm(model, SYN, 4, rate=0.9, max_prefill_tokens=4)
    eng = llm.engine
    real_forward = eng.runner.forward
    victim_pt: list = []

    def nan_forward(page_tables, starts, tokens, offsets, *a, **k):  # noqa: ANN001, ANN202
        logits, cap = real_forward(page_tables, starts, tokens, offsets, *a, **k)
        for i, pt in enumerate(page_tables):
            if victim_pt and pt is victim_pt[0] and len(logits[i]):
                logits[i] = torch.full_like(logits[i], float("nan"))
        return logits, cap

    monkeypatch.setattr(eng.runner, "forward", nan_forward)
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12)) for p in prompts]
    victim_pt.append(reqs[1].page_table)
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "error" and "NaN" in reqs[1].error and reqs[1].output_ids == []
    for i in (0, 2):
        assert reqs[i].output_ids == plain[i].token_ids
    outs = [llm._completion(0, r) for r in reqs]
    assert outs[1].error and outs[1].finish_reason == "error"
    assert_no_leak(eng)
