"""Target K/V after every commit: at each engine step, the target KV cache at [0, committed_len) of every
running request (and SYNTHETIC's draft KV, which uses the target's own weights) equals the K/V of a
from-scratch forward — nothing written for rejected drafts survives.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.core import SamplingParams, Status
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, drive, fresh_kv, make_llm
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)
from tests.tiny import tiny_model


def _check_kv(model, eng) -> int:  # noqa: ANN001
    checked = 0
    for r in list(eng.requests.values()):
        c = r.committed_len
        if r.status is not Status.RUNNING or c == 0:
            continue
        assert c <= r.seq_len - (0 if r.in_prefill else 1)
        fk, fv = fresh_kv(model, r.all_ids[:c])
        slots = torch.tensor(eng.kv.slots(r.page_table, 0, c))
        for l in range(model.cfg.num_layers):
            torch.testing.assert_close(eng.kv.k[l][slots], fk[l], atol=1e-9, rtol=0)
            torch.testing.assert_close(eng.kv.v[l][slots], fv[l], atol=1e-9, rtol=0)
        st = getattr(eng.drafter, "state", {}).get(r.request_id)
        if st is not None and st.done:  # SYNTHETIC drafts with the target's own weights
            d = st.done
            assert d <= r.seq_len - 1 or r.in_prefill
            dslots = torch.tensor(eng.drafter.kv.slots(st.page_table, 0, d))
            for l in range(model.cfg.num_layers):
                torch.testing.assert_close(eng.drafter.kv.k[l][dslots], fk[l][:d] if d <= c else fresh_kv(
                    model, r.all_ids[:d])[0][l], atol=1e-9, rtol=0)
        checked += 1
    return checked


@pytest.mark.parametrize("algo,K,page_size", [(SYN, 16, 4), (SYN, 5, 16), (NGRAM, 16, 4), (NGRAM, 3, 1)])
def test_kv_after_commit_equals_recompute(algo: str, K: int, page_size: int, verify_mode: str) -> None:
    model = tiny_model("qwen3", seed=8)
    rng = random.Random(K * 7 + page_size)
    plan = []
    for i in range(5):
        L = rng.randint(1, 20)
        unit = [rng.randrange(V) for _ in range(3)]
        plan.append((i, (unit * L)[:L], SamplingParams(temperature=0, max_tokens=(6, 40, 15, 40, 25)[i])))
    llm = make_llm(model, algo, K, rate=0.7, page_size=page_size, max_prefill_tokens=9)
    counts = []
    spec = drive(llm, plan, on_step=lambda eng, step: counts.append(_check_kv(model, eng)))
    assert sum(counts) > 20
    finish_steps = sorted(r.finish_time for r in spec)
    assert finish_steps[0] < finish_steps[-1]  # some finished while others continued
    assert llm.engine.stats.num_accepted_tokens > 0
    assert_no_leak(llm.engine)
