"""Logprobs of the plain engine: chosen-token and top-n logprobs equal a full-recompute log-softmax
reference, greedy and sampled (with penalties), with chunked prefill; none are returned unless asked.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from tests.engine_helpers import PROMPTS, llama, make_llm, output_rows  # noqa: F401, F811


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
