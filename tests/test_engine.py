"""Engine correctness without speculation: continuous batching, chunked prefill, paging, preemption,
aborts, every sampling parameter and input validation — checked against full-recompute oracles on
tiny fp64 models."""
from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.core import SamplingParams, Status
from specserve.engine.llm import LLM
from tests.tiny import ref_logits, reference_greedy, tiny_model

V = 97  # tiny_model vocabulary


# ---------------------------------------------------------------- helpers
def make_llm(model, **opts) -> LLM:  # noqa: ANN001
    opts.setdefault("kv_cache_memory", "256KiB")
    return LLM.from_model(model, **opts)




def output_rows(model, prompt: list[int], out: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Row j: the raw logits that produced out[j]."""
    seq = prompt + out[:-1]
    return ref_logits(model, seq)[len(prompt) - 1 :]


def run(eng, max_steps: int = 5000) -> int:  # noqa: ANN001
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return steps


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


_REF: dict[tuple, list[int]] = {}


def greedy_ref(model, prompt: list[int], n: int, key=None) -> list[int]:  # noqa: ANN001
    k = (id(model) if key is None else key, tuple(prompt))
    if k not in _REF or len(_REF[k]) < n:
        _REF[k] = reference_greedy(model, prompt, n)
    return _REF[k][:n]


def assert_no_leak(eng) -> None:  # noqa: ANN001
    assert not eng.has_unfinished()
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_pages
    assert eng.requests == {}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


# ---------------------------------------------------------------- greedy exactness
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


# ---------------------------------------------------------------- abort
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


# ---------------------------------------------------------------- sampling parameters
def _sample(llm: LLM, prompts, **kw):  # noqa: ANN001, ANN202
    return llm.generate(prompts, SamplingParams(**kw))


PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [50, 60, 70, 80, 90, 10, 20], [33]]


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.9, min_p=0.5),
                                dict(temperature=1e-4)])
def test_truncation_to_one_token_equals_greedy(llama, kw) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    params = dict(temperature=1.3, max_tokens=12, seed=5)
    params.update(kw)
    outs = _sample(llm, PROMPTS, **params)
    for o, p in zip(outs, PROMPTS):
        assert o.token_ids == greedy_ref(llama, p, 12)


def _probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)


def test_top_k_top_p_min_p_support(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    T = 1.5
    cases = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=5, top_p=0.7, min_p=0.05), {}]
    outside = {}
    for ci, kw in enumerate(cases):
        outs = _sample(llm, PROMPTS * 2, temperature=T, max_tokens=12, n=2, **kw)
        violations = 0
        for o, p in zip(outs, PROMPTS * 2):
            for c in o.outputs:
                rows = output_rows(llama, p, c.token_ids)
                for row, t in zip(rows, c.token_ids):
                    pr = _probs(row, T)
                    ok = True
                    if "top_k" in kw:
                        ok &= int((row > row[t]).sum()) < kw["top_k"]
                    if "top_p" in kw:
                        ok &= float(pr[pr > pr[t]].sum()) < kw["top_p"] + 1e-9
                    if "min_p" in kw:
                        ok &= float(pr[t]) >= kw["min_p"] * float(pr.max()) - 1e-12
                    if not kw:  # unrestricted sampling must leave the top-3 sometimes: the tests above mean something
                        ok = int((row > row[t]).sum()) < 3
                    violations += not ok
        outside[ci] = violations
    assert outside[0] == outside[1] == outside[2] == outside[3] == 0
    assert outside[4] > 0


def test_temperature_scales_the_distribution(llama) -> None:  # noqa: ANN001
    """top_k=2 leaves a two-token distribution: P(top-1) = sigmoid((l1 - l2) / T)."""
    llm = make_llm(llama)
    prompt = None
    for cand in ([1, 2, 3], [4, 5], [10, 11, 12], [20], [30, 31], [40, 41, 42], [5], [6, 7]):
        row = ref_logits(llama, cand)[-1]
        top = torch.topk(row, 2).values
        gap = float(top[0] - top[1])
        if 0.3 < gap < 2.5:
            prompt = cand
            break
    assert prompt is not None
    best = int(row.argmax())
    N = 256
    for T in (0.5, 2.0):
        toks = []
        for s in range(N // 64):
            out = _sample(llm, [prompt], temperature=T, top_k=2, max_tokens=1, n=64, seed=1000 * s + 1)[0]
            toks += [c.token_ids[0] for c in out.outputs]
        assert set(toks) <= set(torch.topk(row, 2).indices.tolist())
        p = 1 / (1 + math.exp(-gap / T))
        freq = toks.count(best) / N
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / N) + 0.01, (T, freq, p)


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


def test_seeds_reproducible_and_independent_of_neighbours(llama) -> None:  # noqa: ANN001
    p = [3, 1, 4, 1, 5]
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = make_llm(llama).generate([p], sp)[0].token_ids
    assert make_llm(llama).generate([p], sp)[0].token_ids == alone
    assert make_llm(llama, seed=99).generate([p], sp)[0].token_ids == alone  # engine seed irrelevant when seeded
    other = make_llm(llama).generate([p], SamplingParams(temperature=1.0, max_tokens=16, seed=1235))[0].token_ids
    assert other != alone
    # in a crowded batch, joining mid-way, under preemption in a tiny pool: same tokens
    rng = random.Random(5)
    llm = make_llm(llama, kv_cache_memory="24KiB", page_size=4, max_prefill_tokens=5)
    eng = llm.engine
    neighbours = []
    for i in range(3):
        neighbours.append(eng.add_request(rand_prompt(rng, 6), SamplingParams(temperature=1.0, max_tokens=14)))
    eng.step()
    eng.step()
    target = eng.add_request(p, sp)
    for i in range(3):
        neighbours.append(eng.add_request(rand_prompt(rng, 4), SamplingParams(temperature=0, max_tokens=12)))
        eng.step()
    run(eng)
    assert target.output_ids == alone
    assert sum(r.num_preemptions for r in neighbours + [target]) > 0
    assert_no_leak(eng)


def test_unseeded_requests_differ_but_engine_seed_reproduces(llama) -> None:  # noqa: ANN001
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a = [o.token_ids for o in make_llm(llama, seed=7).generate([[1, 2]] * 3, sp)]
    b = [o.token_ids for o in make_llm(llama, seed=7).generate([[1, 2]] * 3, sp)]
    assert a == b and len({tuple(x) for x in a}) > 1


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


def test_n_samples(llama) -> None:  # noqa: ANN001
    llm = make_llm(llama)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, n=4))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.token_ids == out.outputs[0].token_ids
    # seeded: sample i uses seed + i
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=40))[0]
    for i, c in enumerate(out.outputs):
        single = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=10, seed=40 + i))[0]
        assert c.token_ids == single.token_ids
    # greedy: n identical copies
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, n=3))[0]
    assert all(c.token_ids == greedy_ref(llama, [1, 2, 3], 8) for c in out.outputs)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
def test_logprobs_match_reference(llama, top_n: int) -> None:  # noqa: ANN001
    llm = make_llm(llama, page_size=4, max_prefill_tokens=4)
    for kw in (dict(temperature=0), dict(temperature=1.2, seed=8, presence_penalty=1.0)):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, logprobs=top_n, **kw))
        for o, p in zip(outs, PROMPTS):
            assert len(o.logprobs) == len(o.token_ids) == 10
            lps = torch.log_softmax(output_rows(llama, p, o.token_ids).double(), dim=-1)
            for lp, t, row in zip(o.logprobs, o.token_ids, lps):
                assert lp.token_id == t
                assert abs(lp.logprob - float(row[t])) < 1e-9
                assert len(lp.top) == top_n
                vals = [v for _, v in lp.top]
                assert vals == sorted(vals, reverse=True)
                ref_top = torch.topk(row, top_n)
                assert [i for i, _ in lp.top] == ref_top.indices.tolist()
                assert max((abs(a - b) for a, b in zip(vals, ref_top.values.tolist())), default=0) < 1e-9
                if top_n and kw["temperature"] == 0:
                    assert lp.top[0][0] == t
    off = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))[0]
    assert off.logprobs is None


# ---------------------------------------------------------------- invalid inputs
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


def test_capture_layers_returns_hidden_states_of_chosen_layers() -> None:
    """Drafters read target features: the residual stream after chosen layers, for every packed token."""
    import torch.nn.functional as F

    from specserve.cache.kv_pool import KVPool
    from specserve.engine.runner import ModelRunner
    from specserve.models.forward_batch import build_forward_batch

    m = tiny_model("llama", layers=3)
    kv = KVPool(m.cfg, 4, 16, m.dtype)
    pt: list[int] = []
    kv.ensure(pt, 6)
    slots = ModelRunner(m, kv)._slots(pt, 0, 6)
    fb = build_forward_batch([[1, 2, 3, 4, 5, 6]], [0], [slots], [slots], None)
    final, captured = m(fb, kv.k, kv.v, capture_layers=(0, 2))
    assert len(captured) == 2 and all(c.shape == (6, m.cfg.hidden_size) for c in captured)
    # the last captured layer is the input of the final norm
    assert torch.allclose(F.rms_norm(captured[1], (m.cfg.hidden_size,), m.norm, m.cfg.rms_norm_eps), final)
    assert not torch.allclose(captured[0], captured[1])
