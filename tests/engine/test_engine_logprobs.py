"""Logprobs of the plain engine: chosen-token and top-n logprobs equal a full-recompute log-softmax
reference, greedy and sampled (with penalties), with chunked prefill; none are returned unless asked. Prompt
logprobs equal one full forward's log-softmax over the prompt, chunked, past a warm prefix cache, under
preemption and with speculation on, and leave the output unchanged.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from tests.engine_helpers import PROMPTS, assert_no_leak, greedy_ref, llama, make_llm, output_rows  # noqa: F401, F811
from tests.tiny import ref_logits


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


# ---- prompt logprobs ------------------------------------------------------------------------------
def assert_prompt_logprobs(model, prompt: list[int], got: list, top_n: int) -> None:  # noqa: ANN001
    """Against one full forward of the prompt: position i ≥ 1 is row i − 1's raw log-softmax at prompt[i]."""
    assert len(got) == len(prompt) and got[0] is None
    lps = torch.log_softmax(ref_logits(model, prompt).double(), dim=-1)
    for lp, t, row in zip(got[1:], prompt[1:], lps):
        assert lp.token_id == t and abs(lp.logprob - float(row[t])) < 1e-9
        assert lp.rank == int((row >= row[t]).sum())
        ref_top = torch.topk(row, top_n)
        assert [i for i, _ in lp.top] == ref_top.indices.tolist()
        assert max((abs(v - r) for (_, v), r in zip(lp.top, ref_top.values.tolist())), default=0) < 1e-9


LONG = [[(7 * i + 3 * j) % 97 for j in range(n)] for i, n in enumerate([1, 2, 9, 13, 17])]


@pytest.mark.parametrize("top_n", [0, 3])
def test_prompt_logprobs_match_reference_across_prefill_chunks(llama, top_n: int) -> None:  # noqa: ANN001
    """Prompts of 1 to 17 tokens prefilled in chunks of 4, batched: each chunk's rows give its positions; the
    output is the one without prompt logprobs."""
    llm = make_llm(llama, page_size=4, max_prefill_tokens=4)
    sp = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=top_n)
    outs = llm.generate(LONG, sp)
    plain = llm.generate(LONG, SamplingParams(temperature=0, max_tokens=6))
    for o, p, q in zip(outs, LONG, plain):
        assert_prompt_logprobs(llama, p, o.prompt_logprobs, top_n)
        assert o.token_ids == q.token_ids and q.prompt_logprobs is None and o.logprobs is None
    assert_no_leak(llm.engine)


def test_prompt_logprobs_never_read_the_prefix_cache(llama) -> None:  # noqa: ANN001
    """A cached prompt is computed again (the cache holds KV, not logits), is not counted as a lookup, and its
    pages still serve the requests after it; preempted mid-prefill, a request recomputes only its KV."""
    llm = make_llm(llama, page_size=4, max_prefill_tokens=8)
    p = LONG[-1]
    llm.generate([p], SamplingParams(temperature=0, max_tokens=4))  # p's pages cached
    queries = llm.engine.prefix.stats.queries
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    hot = llm.generate([p], sp)[0]
    assert hot.meta_info["cached_tokens"] == 0 and llm.engine.prefix.stats.queries == queries
    assert_prompt_logprobs(llama, p, hot.prompt_logprobs, 2)
    after = llm.generate([p + [1]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert after.meta_info["cached_tokens"] == 16
    # a pool too small for all: requests preempted mid-prefill or mid-decode come back with the same answer
    small = make_llm(llama, page_size=4, kv_cache_memory="12KiB", max_prefill_tokens=8, max_running_requests=8)
    prompts = [[(5 * i + 11 * j) % 97 for j in range(14)] for i in range(6)]
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1))
    assert sum(o.meta_info["num_preemptions"] for o in outs) > 0
    for o, q in zip(outs, prompts):
        assert_prompt_logprobs(llama, q, o.prompt_logprobs, 1)
        assert o.token_ids == greedy_ref(llama, q, len(o.token_ids))


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_prompt_logprobs_under_speculation(tmp_path, algo: str) -> None:  # noqa: ANN001
    """With a drafter on, the greedy output is the plain engine's and the prompt logprobs are the reference's."""
    from specserve.engine.llm import LLM
    from tests.tiny import target_and_draft_dirs

    dirs = target_and_draft_dirs(tmp_path)
    extra = {"speculative_draft_model_path": dirs["small"]} if algo == "STANDALONE" else {}
    opts = dict(dtype="float64", page_size=4, max_prefill_tokens=4, kv_cache_memory="256KiB")
    spec = LLM(dirs["target"], speculative_algorithm=algo, speculative_num_draft_tokens=3, **opts, **extra)
    prompts = [p + p[-6:] for p in LONG[2:]]  # a repeat, so prompt lookup drafts too
    outs = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=2))
    plain = LLM(dirs["target"], **opts).generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.stats.num_drafts > 0
    for o, p in zip(outs, prompts):
        assert_prompt_logprobs(spec.engine.model, p, o.prompt_logprobs, 2)
