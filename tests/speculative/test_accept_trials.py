"""The cost policy's per-request state (cost/:AcceptTrials): acceptance per draft source lives in the
policy, keyed by request id, and is freed when the request ends."""
from __future__ import annotations

from specserve import LLM, SamplingParams

from tests.tiny import tiny_model


def test_acceptance_per_request_lives_in_the_policy_and_is_freed_at_finish() -> None:
    """Each running request's acceptance per draft source is the window policy's state, keyed by request id,
    recorded at commit and freed when the request ends; the pool over all requests stays (the prior of the
    estimates of requests to come)."""
    llm = LLM.from_model(tiny_model("llama"), speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    eng, running = llm.engine, []
    step = eng.step

    def spy() -> list:
        out = step()
        running.append(set(eng.policy.trials.per_request) - set(eng.requests))  # held for finished requests
        running.append(set(eng.policy.trials.per_request))
        return out

    eng.step = spy
    outs = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2], [7] * 12], SamplingParams(temperature=0, max_tokens=20))
    assert not any(running[0::2]) and any(running[1::2])  # recorded while running, never kept past the finish
    pooled = eng.policy.trials.pooled
    assert eng.policy.trials.per_request == {}
    assert sum(a for a, _ in pooled.values()) == sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0
