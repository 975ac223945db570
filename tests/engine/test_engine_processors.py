"""logit_bias and min_tokens: processors on the target's logits at every position, so plain decoding and every
verify row of a speculative window see the same distribution. Greedy tokens equal an independent oracle (reference
logits, biased and masked by hand) with and without speculation; the sampled joint under a draft model is the
exact biased, masked one."""
from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from tests.dist import engine_vs_exact_joint, exact_joint, joint_fit
from tests.spec_helpers import NGRAM, SYN, make_llm
from tests.tiny import ref_logits, reference_greedy, save_tiny_hf_dir, tiny_config, tiny_model, tiny_state_dict

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9, 9, 9, 9, 9, 4, 2]]


def _oracle(model, prompt: list[int], n: int, bias: dict[int, float], min_tokens: int = 0,  # noqa: ANN001
            stop: tuple[int, ...] = ()) -> list[int]:
    ids, out = list(prompt), []
    for j in range(n):
        row = ref_logits(model, ids)[-1].clone()
        for t, b in bias.items():
            row[t] += b
        if j < min_tokens:
            row[list(stop)] = float("-inf")
        t = int(row.argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_model("llama", seed=4)


@pytest.mark.parametrize("algo", [None, SYN, NGRAM])
def test_logit_bias_greedy_equals_the_biased_oracle(model, algo: str | None) -> None:  # noqa: ANN001
    plain = [reference_greedy(model, p, 20) for p in PROMPTS]
    bias = {plain[0][0]: -100.0, 11: 4.0, 12: 2.5}  # ban one greedy choice, push two others
    llm = make_llm(model, algo, 4, 0.9, page_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, logit_bias=bias))
    for o, p, base in zip(outs, PROMPTS, plain):
        assert o.token_ids == _oracle(model, p, 20, bias)
    assert [o.token_ids for o in outs] != plain  # the bias changed the text
    if algo is not None:
        assert llm.engine.stats.num_drafts > 0


@pytest.mark.parametrize("algo", [None, SYN, NGRAM])
def test_min_tokens_holds_back_stop_tokens(model, algo: str | None) -> None:  # noqa: ANN001
    prompt = PROMPTS[0]
    stop = (reference_greedy(model, prompt, 3)[1],)  # plain greedy stops at its 2nd token
    llm = make_llm(model, algo, 4, 0.9, page_size=4)
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop))[0]
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop, min_tokens=9))[0]
    assert held.token_ids == _oracle(model, prompt, 20, {}, 9, stop) and len(held.token_ids) >= 9
    assert stop[0] not in held.token_ids[:9]


def test_min_tokens_holds_back_eos_unless_ignored() -> None:
    m = tiny_model("llama", seed=4, eos_token_ids=(reference_greedy(tiny_model("llama", seed=4), PROMPTS[1], 2)[0],))
    eos = m.cfg.eos_token_ids
    llm = LLM.from_model(m)
    sp = dict(temperature=0, max_tokens=10)
    assert llm.generate([PROMPTS[1]], SamplingParams(**sp))[0].token_ids == [eos[0]]  # EOS first: it stops
    out = llm.generate([PROMPTS[1]], SamplingParams(**sp, min_tokens=5))[0].token_ids
    assert len(out) >= 5 and eos[0] not in out[:5] and out == _oracle(m, PROMPTS[1], 10, {}, 5, eos)


def test_sampled_joint_with_logit_bias_and_min_tokens_is_exact(tmp_path: Path) -> None:
    """A draft model's sampled drafts under logit_bias and min_tokens (token 2 held back for all L positions)
    reproduce the exact joint of the biased, masked target; the negative check: the same outputs fail against
    the law without the bias."""
    V, L, N = 3, 4, 2500
    cfg = tiny_config("llama", vocab=V)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    draft = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=12), tmp_path / "d")
    llm = LLM(target, dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=3, max_running_requests=256)
    base = SamplingParams(temperature=1.5, max_tokens=L, logit_bias={0: 1.2}, min_tokens=L, stop_token_ids=(2,),
                          ignore_eos=True)
    fit = engine_vs_exact_joint(llm, [1, 2, 1], L, base, N, stop_ids=(2,))
    assert fit.ok, fit
    assert all(2 not in o.token_ids for o in fit.outs)
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0
    unbiased = SamplingParams(**{**base.__dict__, "logit_bias": ()})  # the law without the bias: the test sees it
    counts: dict = {}
    for o in fit.outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert not joint_fit(counts, exact_joint(llm.engine.model, [1, 2, 1], L, unbiased, stop_ids=(2,)), N).ok


def test_min_tokens_with_a_grammar_is_refused_by_name(model) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="min_tokens: not supported with structured output"):
        SamplingParams(max_tokens=8, min_tokens=2, regex="a+").validate()
