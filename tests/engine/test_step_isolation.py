"""An exception inside an engine step fails only the request it concerns: the batched call is
retried request by request, and every neighbour finishes with exactly its fault-free output."""
from __future__ import annotations

import random

import pytest

import specserve.engine.engine as engine_mod
from specserve.core import SamplingParams
from tests.spec_helpers import SYN, V, assert_no_leak, drive, make_llm
from tests.tiny import tiny_model

VICTIM = "p2"


def _install_fault(eng, stage: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:  # noqa: ANN001
    """Make `stage` raise whenever the victim is in the batch it processes; returns the hit log."""
    hits: list[str] = []

    def boom(reqs) -> None:  # noqa: ANN001
        if any(r.request_id == VICTIM for r in reqs):
            hits.append(stage)
            raise RuntimeError(f"injected {stage} fault")

    if stage == "forward":  # the target forward (prefill and verify), recognised by the victim's page table
        real = eng.runner.forward

        def forward(page_tables, *a, **k):  # noqa: ANN001, ANN202
            boom([r for r in eng.requests.values() if any(pt is r.page_table for pt in page_tables)])
            return real(page_tables, *a, **k)
        monkeypatch.setattr(eng.runner, "forward", forward)
    elif stage == "draft":
        real_propose = eng.drafter.propose
        monkeypatch.setattr(eng.drafter, "propose", lambda reqs, w: boom(reqs) or real_propose(reqs, w))
    elif stage == "accept":
        real_accept = engine_mod.accept_request
        monkeypatch.setattr(engine_mod, "accept_request", lambda r, *a: boom([r]) or real_accept(r, *a))
    elif stage == "commit":
        real_commit = eng.drafter.commit
        monkeypatch.setattr(eng.drafter, "commit", lambda reqs, n, f=None: boom(reqs) or real_commit(reqs, n, f))
    return hits


@pytest.mark.parametrize("stage", ["forward", "draft", "accept", "commit"])
def test_a_fault_fails_only_its_request(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama", seed=4)
    rng = random.Random(5)
    plan = [(i % 2, [rng.randrange(V) for _ in range(rng.randint(2, 10))], SamplingParams(temperature=0, max_tokens=16))
            for i in range(5)]
    solo = [drive(make_llm(model, page_size=4), [(0, p, sp)])[0].output_ids for _, p, sp in plan]
    llm = make_llm(model, SYN, 3, rate=0.7, page_size=4)
    hits = _install_fault(llm.engine, stage, monkeypatch)
    reqs = drive(llm, plan)
    assert hits, "the fault never fired"
    for r, want in zip(reqs, solo):
        if r.request_id == VICTIM:
            assert r.finish_reason == "error" and f"injected {stage} fault" in r.error
        else:
            assert r.finish_reason == "length" and r.error is None
            assert r.output_ids == want
    assert_no_leak(llm.engine)


def test_failed_request_is_reported_by_the_step() -> None:
    """The step returns a request it failed, so the server publishes its end."""
    model = tiny_model("llama", seed=4)
    llm = make_llm(model, SYN, 3, page_size=4)
    eng = llm.engine
    a = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8), request_id="a")
    b = eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=8), request_id=VICTIM)
    eng.step()  # prefill both
    real = eng.drafter.propose
    eng.drafter.propose = lambda reqs, w: (_ for _ in ()).throw(ValueError("bad")) if b in reqs else real(reqs, w)
    touched = eng.step()
    assert b in touched and b.finish_reason == "error" and a in touched and not a.finished
