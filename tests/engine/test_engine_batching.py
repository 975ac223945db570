"""Greedy exactness of the plain engine under scheduling: continuous batching with requests joining
mid-run, chunked prefill, small pages, preemption with recompute (also with aborts mid-run), aborts by
request id, and requests that outgrow the KV pool or max_model_len — always equal to the
full-recompute oracle, with no pages leaked.
"""
from __future__ import annotations

import random

import pytest

from specserve.core import SamplingParams, Status
from tests.engine_helpers import assert_no_leak, greedy_ref, llama, make_llm, rand_prompt, run  # noqa: F401, F811
from tests.tiny import reference_greedy, tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_joining_chunked_small_pages(arch: str) -> None:
    model = tiny_model(arch, seed=3)
    rng = random.Random(arch)
    lengths = [1, 3, 7, 12, 20, 33, 5, 16]
    max_tokens = [9, 20, 14, 24, 6, 17, 1, 22]
    join_at = [0, 0, 1, 2, 3, 5, 8, 13]
    prompts = [rand_prompt(rng, n) for n in lengths]
    llm = make_llm(model, page_size=4, max_prefill_tokens=7)
    eng = llm.engine
    reqs = [None] * 8
    step = 0
    while step <= max(join_at) or eng.has_unfinished():
        for i, j in enumerate(join_at):
            if j == step:
                reqs[i] = eng.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i]))
        eng.step()
        step += 1
        assert step < 500
    for r, p, n in zip(reqs, prompts, max_tokens):
        assert r.output_ids == reference_greedy(model, p, n), r.request_id
        assert r.finish_reason == "length" and r.finished
        assert r.num_preemptions == 0
    assert_no_leak(eng)


def test_greedy_generate_api_and_meta(llama) -> None:  # noqa: ANN001
    rng = random.Random(1)
    prompts = [rand_prompt(rng, n) for n in (2, 9, 17, 30)]
    llm = make_llm(llama, page_size=16, max_prefill_tokens=8, max_running_requests=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert len(outs) == 4
    for o, p in zip(outs, prompts):
        assert o.token_ids == greedy_ref(llama, p, 12)
        assert o.prompt_token_ids == p and o.finish_reason == "length" and o.text == ""
        assert o.meta_info["prompt_tokens"] == len(p) and o.meta_info["completion_tokens"] == 12
        assert "spec_verify_ct" not in o.meta_info
    assert_no_leak(llm.engine)
    # a single token-id prompt is one prompt, not a batch
    single = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=3))
    assert len(single) == 1 and single[0].token_ids == greedy_ref(llama, prompts[0], 3)


@pytest.mark.parametrize("page_size,mem,max_prefill", [(4, "24KiB", 7), (1, "20KiB", 3), (8, "32KiB", 64)])
def test_preemption_recompute_is_exact(llama, page_size: int, mem: str, max_prefill: int) -> None:  # noqa: ANN001
    rng = random.Random(page_size)
    prompts = [rand_prompt(rng, rng.randint(2, 10)) for _ in range(7)]
    max_tokens = [rng.randint(8, 18) for _ in prompts]
    llm = make_llm(llama, kv_cache_memory=mem, page_size=page_size, max_prefill_tokens=max_prefill)
    eng = llm.engine
    assert eng.kv.num_slots < sum(len(p) + n for p, n in zip(prompts, max_tokens)) / 2  # must preempt
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        reqs.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=n)))
        if i % 2:
            eng.step()
    run(eng)
    assert sum(r.num_preemptions for r in reqs) > 0
    for r, p, n in zip(reqs, prompts, max_tokens):
        assert r.output_ids == greedy_ref(llama, p, n)
        assert r.finish_reason == "length"
    assert_no_leak(eng)


def test_preemption_with_aborts_mid_run_leaks_nothing(llama) -> None:  # noqa: ANN001
    rng = random.Random(7)
    prompts = [rand_prompt(rng, rng.randint(3, 9)) for _ in range(8)]
    llm = make_llm(llama, kv_cache_memory="24KiB", page_size=4, max_prefill_tokens=6, max_running_requests=5)
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=16)) for p in prompts]
    aborted: set[str] = set()
    step = 0
    saw_preempted_abort = False
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step == 3:
            running = [r for r in eng.scheduler.running if not r.in_prefill]
            waiting = list(eng.scheduler.waiting)
            for r in running[:1] + waiting[:1]:
                assert eng.abort(r.request_id) is r
                aborted.add(r.request_id)
        if step >= 4 and not saw_preempted_abort:
            pre = [r for r in eng.scheduler.waiting if r.num_preemptions > 0]
            if pre:
                eng.abort(pre[0].request_id)
                aborted.add(pre[0].request_id)
                saw_preempted_abort = True
        if step == 6:
            mid = [r for r in eng.scheduler.running if r.in_prefill]
            if mid:  # a partially prefilled request
                eng.abort(mid[0].request_id)
                aborted.add(mid[0].request_id)
        assert step < 2000
    assert len(aborted) >= 2
    assert sum(r.num_preemptions for r in reqs) > 0
    for r, p in zip(reqs, prompts):
        ref = greedy_ref(llama, p, 16)
        if r.request_id in aborted:
            assert r.finish_reason == "abort" and r.output_ids == ref[: len(r.output_ids)]
            assert r.page_table == []
        else:
            assert r.finish_reason == "length" and r.output_ids == ref
    assert_no_leak(eng)


def test_request_larger_than_pool_stops_instead_of_stalling(llama) -> None:  # noqa: ANN001
    """A lone request that outgrows the whole KV pool must finish ("length"), not wait forever."""
    llm = make_llm(llama, kv_cache_memory="8KiB", page_size=4)  # 4 pages = 16 slots
    eng = llm.engine
    assert eng.kv.num_slots == 16
    p = [1, 2, 3, 4, 5]
    r = eng.add_request(p, SamplingParams(temperature=0, max_tokens=100))
    other = eng.add_request([9, 8], SamplingParams(temperature=0, max_tokens=100))
    run(eng, max_steps=300)
    assert r.finish_reason == "length" and r.seq_len <= eng.kv.num_slots
    assert r.output_ids == greedy_ref(llama, p, len(r.output_ids)) and len(r.output_ids) >= 10
    assert other.finish_reason == "length" and other.output_ids == greedy_ref(llama, [9, 8], len(other.output_ids))
    assert_no_leak(eng)


def test_max_model_len_stops_with_length(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama, max_model_len=12)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=100))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    assert out.token_ids == greedy_ref(llama, [1, 2, 3, 4, 5], 7)


def test_abort_by_id_mid_run(llama) -> None:  # noqa: ANN001
    rng = random.Random(11)
    prompts = [rand_prompt(rng, n) for n in (4, 6, 8, 10)]
    llm = make_llm(llama, page_size=4, max_running_requests=3)
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=15), request_id=f"r{i}")
            for i, p in enumerate(prompts)]
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request([1], SamplingParams(), request_id="r0")
    for _ in range(4):
        eng.step()
    assert reqs[3].status is Status.WAITING  # max_running_requests=3
    assert eng.abort("r1") is reqs[1]
    assert eng.abort("r3") is reqs[3]
    assert eng.abort("r1") is None and eng.abort("nope") is None
    run(eng)
    assert reqs[1].finish_reason == "abort" and 0 < len(reqs[1].output_ids) < 15
    assert reqs[1].output_ids == greedy_ref(llama, prompts[1], len(reqs[1].output_ids))
    assert reqs[3].finish_reason == "abort" and reqs[3].output_ids == []
    for i in (0, 2):
        assert reqs[i].finish_reason == "length" and reqs[i].output_ids == greedy_ref(llama, prompts[i], 15)
    assert eng.abort("r0") is None  # finished already
    assert_no_leak(eng)
