"""Prefix cache in the engine (engine/prefix.py): a cached prefix gives the cold prefill's greedy tokens
and logprobs bit for bit in every precision mode and with every drafter, the drafter's state included
(equal acceptance per request); under concurrency, aborts and eviction nothing leaks."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.cli import build_parser
from specserve.flags import config_from_args
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from specserve.formats.quant import quantize_model
from tests.drafter_setup import ALGOS, _spec_llm  # noqa: F401  (the `trained` fixture: conftest.py)
from tests.hybrid_setup import tiny_hybrid
from tests.tiny import target_and_draft_dirs, tiny_model

SP = SamplingParams(temperature=0, max_tokens=10, logprobs=2)


def shared_prompts(seed: int = 0, n: int = 5, stem: int = 37) -> list[list[int]]:
    """Prompts sharing a stem of `stem` tokens (9 pages and a bit at page size 4), then their own tails."""
    rng = random.Random(seed)
    s = [rng.randrange(97) for _ in range(stem)]
    return [s + [rng.randrange(97) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def one_by_one(llm: LLM, prompts: list[list[int]], sp: SamplingParams = SP) -> list:
    return [llm.generate([p], sp)[0] for p in prompts]


def assert_same(hot: list, cold: list, tol: float = 0.0) -> None:
    """Same tokens; logprobs bit for bit (tol 0) or within tol."""
    for a, b in zip(hot, cold):
        assert a.token_ids == b.token_ids
        if tol == 0:
            assert [(x.logprob, x.top) for x in a.logprobs] == [(x.logprob, x.top) for x in b.logprobs]
        else:
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= tol


def assert_clean(eng) -> None:  # noqa: ANN001
    """No request holds a page: every page is free or cached and idle, and evicting the idle ones frees all."""
    for pool in [eng.kv] + ([eng.drafter.kv] if eng.drafter is not None and hasattr(eng.drafter, "kv") else []):
        a = pool.allocator
        assert a.num_free == a.num_pages
        if pool.prefix_cache is not None:
            assert all(e.ref == 0 for e in pool.prefix_cache.by_key.values())
            pool.prefix_cache.clear()
        assert a.num_unowned == a.num_pages


# NOTE: unquantized fp32/fp64 linears are torch's GEMM, whose rounding depends on how many rows it multiplies;
# a hit (a shorter prefill) then moves logprobs in the last bits, as batching with other requests does
BOUND = {"float64": 1e-13, "float32": 1e-5}


@pytest.mark.parametrize("mode", ["float64", "float32", "bfloat16", "w4a8", "w8a8", "int4"])
def test_cached_prefix_equals_cold_prefill(mode: str) -> None:
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(mode, torch.float32)
    m = tiny_model("llama", dtype=dtype)
    if mode in ("w4a8", "w8a8", "int4"):
        quantize_model(m, mode)
    prompts = shared_prompts()
    # chunked prefill too: the cold prefill splits where the cache does not, the cached one resumes mid-chunk
    opts = dict(page_size=4, kv_cache_memory="256KiB", max_prefill_tokens=11)
    hot_llm = LLM.from_model(m, **opts)
    hot = one_by_one(hot_llm, prompts)
    cold = one_by_one(LLM.from_model(m, disable_prefix_cache=True, **opts), prompts)
    assert_same(hot, cold, BOUND.get(mode, 0.0))
    assert [o.meta_info["cached_tokens"] for o in hot] == [0] + [36] * 4  # 9 whole pages of the 37-token stem
    s = hot_llm.engine.prefix.stats
    assert (s.queries, s.hits, s.hit_tokens) == (5, 4, 144)
    assert_clean(hot_llm.engine)


def test_next_turn_hits_the_answer_and_preemption_hits_its_own_work() -> None:
    m = tiny_model("llama")
    llm = LLM.from_model(m, page_size=4, kv_cache_memory="256KiB")
    p = shared_prompts(n=1)[0]
    first = llm.generate([p], SamplingParams(temperature=0, max_tokens=17))[0]
    turn2 = p + first.token_ids + [5, 6, 7]
    hot = llm.generate([turn2], SP)[0]
    # the prompt and its answer are committed KV but the last answer token (never fed back)
    assert hot.meta_info["cached_tokens"] == (len(p) + 16) // 4 * 4 > len(p)
    assert_same([hot], [LLM.from_model(m, page_size=4, disable_prefix_cache=True).generate([turn2], SP)[0]],
                BOUND["float64"])
    # a pool too small for all: preempted requests come back onto their own cached pages, outputs unchanged
    small = LLM.from_model(m, page_size=4, kv_cache_memory="20KiB", max_running_requests=8)
    prompts = shared_prompts(seed=3, n=8, stem=9)
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    want = LLM.from_model(m, page_size=4, kv_cache_memory="20KiB", max_running_requests=8,  # the same slot limit
                          disable_prefix_cache=True).generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    stats = small.engine.prefix.stats
    assert sum(o.meta_info["num_preemptions"] for o in outs) > 0 and stats.evictions > 0
    # one lookup per request: a preempted request's return (or a retried admission) is not a new query
    assert stats.queries == len(prompts) and stats.query_tokens == sum(map(len, prompts))
    assert_clean(small.engine)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return target_and_draft_dirs(tmp_path_factory.mktemp("models"))


def _spec_pair(make, prompts: list[list[int]], sp: SamplingParams) -> tuple[LLM, list, list]:  # noqa: ANN001
    hot_llm = make(False)
    return hot_llm, one_by_one(hot_llm, prompts, sp), one_by_one(make(True), prompts, sp)


def _same_drafting(hot: list, cold: list) -> None:
    """The drafter's state after a hit is the cold one: it drafts and gets accepted exactly the same."""
    assert [o.meta_info["spec_accepted_per_pos"] for o in hot] == [o.meta_info["spec_accepted_per_pos"] for o in cold]
    assert [o.meta_info["spec_draft_tokens"] for o in hot] == [o.meta_info["spec_draft_tokens"] for o in cold]


@pytest.mark.parametrize("algo", ["NGRAM", "SYNTHETIC", "STANDALONE"])
def test_model_free_and_draft_model_drafters(dirs: dict[str, str], algo: str) -> None:
    extra = {"NGRAM": {}, "SYNTHETIC": {"speculative_synthetic_accept_rate": 0.7},
             "STANDALONE": {"speculative_draft_model_path": dirs["small"]}}[algo]
    prompts = [p + p[-6:] for p in shared_prompts(seed=1)]  # a repeat, so prompt lookup drafts too
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1)

    def make(off: bool) -> LLM:
        return LLM(dirs["target"], dtype="float64", speculative_algorithm=algo, speculative_num_draft_tokens=3,
                   page_size=4, disable_prefix_cache=off, **extra)

    llm, hot, cold = _spec_pair(make, prompts, sp)
    assert_same(hot, cold)
    _same_drafting(hot, cold)
    assert all(o.meta_info["cached_tokens"] == 36 for o in hot[1:])
    if algo != "NGRAM":  # the draft pool cached its pages under the same keys: every request after the first hit them
        assert llm.engine.drafter.prefix.cache.stats.evictions == 0 and llm.engine.drafter.prefix.cache.by_key
    assert_clean(llm.engine)


@pytest.mark.parametrize("algo,opts", [(a, {}) for a in ALGOS] + [("eagle3", {"speculative_eagle_topk": 2}),
                                                                   ("dspark", {"speculative_algorithm": "HYBRID"})])
def test_learned_drafters(trained: dict, algo: str, opts: dict) -> None:
    prompts = shared_prompts(seed=2)
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=1)
    llm, hot, cold = _spec_pair(lambda off: _spec_llm(trained, algo, page_size=4, disable_prefix_cache=off, **opts),
                                prompts, sp)
    assert_same(hot, cold)
    _same_drafting(hot, cold)
    assert all(o.meta_info["cached_tokens"] == 36 for o in hot[1:])  # the draft pool had every stem page
    assert sum(o.meta_info["spec_accepted_tokens"] for o in hot) > 0
    assert_clean(llm.engine)


def test_draft_attention_window_turns_hits_off(trained: dict) -> None:
    llm = _spec_llm(trained, "dspark", page_size=4, speculative_draft_attention_window=8)
    outs = one_by_one(llm, shared_prompts(n=2))
    assert [o.meta_info["cached_tokens"] for o in outs] == [0, 0]  # its pages behind the window are gone


@pytest.mark.parametrize("algo", [None, "SYNTHETIC"])
def test_concurrent_shared_prefixes_with_aborts(algo: str | None) -> None:
    """64 requests over 3 shared stems join at random steps, some aborted mid-stream; a small pool forces
    eviction and preemption. Every finished answer equals its cold, sequential one; no page leaks."""
    rng = random.Random(5)
    m = tiny_model("llama")
    stems = [[rng.randrange(97) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    plan = [(rng.randrange(40), rng.choice(stems)[: rng.randrange(4, 40)] + [rng.randrange(97) for _ in range(rng.randrange(1, 6))],
             rng.randrange(4, 20)) for _ in range(64)]
    aborts = {i: rng.randrange(1, 6) for i in rng.sample(range(64), 12)}  # request → steps after joining
    spec = {"speculative_algorithm": algo, "speculative_synthetic_accept_rate": 0.6} if algo else {}
    # 24 target pages either way (a draft pool halves the budget); the longest request needs 17
    llm = LLM.from_model(m, page_size=4, kv_cache_memory="96KiB" if algo else "48KiB", max_running_requests=16, **spec)
    eng = llm.engine
    free0 = eng.kv.allocator.num_free
    reqs, step = {}, 0
    while step < 40 or eng.has_unfinished():
        for i, (at, p, n) in enumerate(plan):
            if at == step:
                reqs[i] = eng.add_request(p, SamplingParams(temperature=0, max_tokens=n), request_id=f"r{i}")
            if i in aborts and at + aborts[i] == step:
                eng.abort(f"r{i}")
        eng.step()
        step += 1
        assert step < 3000
    cold = LLM.from_model(m, disable_prefix_cache=True)
    for i, r in reqs.items():
        if r.finish_reason == "abort":
            continue
        assert r.finish_reason == "length"
        assert r.output_ids == cold.generate([plan[i][1]], SamplingParams(temperature=0, max_tokens=plan[i][2]))[0].token_ids
    assert sum(r.finish_reason == "abort" for r in reqs.values()) >= 6
    s = eng.prefix.stats
    assert s.hits > 20 and s.evictions > 0 and sum(r.num_preemptions for r in reqs.values()) > 0
    assert eng.kv.allocator.num_free == free0
    assert_clean(eng)


def test_hybrid_targets_and_the_flags_turn_it_off() -> None:
    assert LLM.from_model(tiny_hybrid()).engine.prefix is None  # recurrent state is not kept at page boundaries
    assert LLM.from_model(tiny_model("llama")).engine.prefix is not None  # on by default
    for flag in (["--disable-prefix-cache"], ["--disable-radix-cache"], ["--disable-prefix-cache", "true"]):
        args = build_parser().parse_args(["serve", "m", *flag])
        assert config_from_args(args, "m").disable_prefix_cache is True
    args = build_parser().parse_args(["serve", "m", "--disable-prefix-cache", "false"])
    assert config_from_args(args, "m").disable_prefix_cache is False


@pytest.mark.slow
def test_smollm2_default_engine_multi_turn() -> None:
    """The default engine (SmolLM2 GGUF, w4a8, AUTO drafting): two chats over a ~1k-token shared system prompt
    and a second turn give their cold answers and logprobs bit for bit; the hits are what the pages allow."""
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    on, off = LLM("smollm2-135m"), LLM("smollm2-135m", disable_prefix_cache=True)
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words about topic {i}." for i in range(80))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is a prime number?", "Name three rivers in Europe.")]
    hot, cold = on.chat(chats[:1], sp) + on.chat(chats[1:], sp), off.chat(chats[:1], sp) + off.chat(chats[1:], sp)
    turn2 = chats[0] + [{"role": "assistant", "content": hot[0].text}, {"role": "user", "content": "And 7?"}]
    hot.append(on.chat([turn2], sp)[0])
    cold.append(off.chat([turn2], sp)[0])
    assert_same(hot, cold)
    n_sys = len(on.engine.tokenizer.encode(on.engine.tokenizer.apply_chat_template(chats[0][:1], False),
                                           add_special_tokens=False))
    assert n_sys > 900 and hot[1].meta_info["cached_tokens"] >= n_sys // 16 * 16 - 16
    assert hot[2].meta_info["cached_tokens"] > hot[0].meta_info["prompt_tokens"] - 16
    assert_clean(on.engine)
