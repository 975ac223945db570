"""Stop conditions cut an accepted run: stop token ids, the model's EOS (and ignore_eos), max_tokens and
stop strings (also across token boundaries) end the output inside a run of accepted drafts; nothing
after the cut is emitted or counted in the speculation counters.
"""
from __future__ import annotations

import re

import pytest

from specserve.core import SamplingParams
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, check_stats, drive, make_llm
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)
from tests.tiny import reference_greedy, tiny_model


class FakeTokenizer:
    """Minimal tokenizer: token i is the text '<i>'."""

    eos_token_ids: tuple[int, ...] = ()
    vocab_size = V

    def id_to_piece(self, i: int) -> str:
        return f"<{int(i)}>"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(self.id_to_piece(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(x) for x in re.findall(r"<(\d+)>", text)]


def _fresh_positions(ref: list[int], lo: int, hi: int) -> list[int]:
    return [j for j in range(lo, hi) if ref[j] not in ref[:j]]


def _full_window_accounting(r, K: int) -> None:  # noqa: ANN001
    """SYNTHETIC at rate 1.0 with full windows: every verify but the last emits K drafts + bonus; the
    last emits e tokens of which min(K, e) are drafts."""
    vc = r.spec_verify_ct
    e = len(r.output_ids) - 1 - (vc - 1) * (K + 1)
    assert 1 <= e <= K + 1
    assert r.spec_draft_tokens == vc * K
    assert r.spec_accepted_tokens == (vc - 1) * K + min(K, e)
    assert r.spec_accepted_per_pos == [vc - 1 + (i < min(K, e)) for i in range(K)]


PROMPT = [1, 2, 3, 4, 5]
K_CUT = 8


@pytest.fixture(scope="module")
def cut_model():
    model = tiny_model("llama", seed=0)
    return model, reference_greedy(model, PROMPT, 40)


def test_stop_token_ids_cut_accepted_run(cut_model, verify_mode: str) -> None:  # noqa: ANN001
    model, ref = cut_model
    js = _fresh_positions(ref, 1, 31)
    assert len(js) >= 5
    plan = [(0, PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref[j]])) for j in js]
    llm = make_llm(model, SYN, K_CUT, rate=1.0)
    spec = drive(llm, plan)
    inside = 0
    for j, r in zip(js, spec):
        assert r.output_ids == ref[: j + 1] and r.finish_reason == "stop"
        _full_window_accounting(r, K_CUT)
        inside += (j % (K_CUT + 1)) != 0  # token j is not a bonus: the rest of its run was dropped
    assert inside >= 3
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)
    # the same under NGRAM, against plain decoding
    nspec = drive(make_llm(model, NGRAM, K_CUT), plan)
    assert [r.output_ids for r in nspec] == [ref[: j + 1] for j in js]


def test_eos_cuts_accepted_run_and_ignore_eos(cut_model) -> None:  # noqa: ANN001
    model, ref = cut_model
    js = [j for j in _fresh_positions(ref, 1, 31) if j % (K_CUT + 1) != 0][:3]
    for j in js:
        eos_model = tiny_model("llama", seed=0, eos_token_ids=(ref[j],))
        llm = make_llm(eos_model, SYN, K_CUT, rate=1.0)
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]
        assert out.token_ids == ref[: j + 1] and out.finish_reason == "stop"
        assert out.meta_info["completion_tokens"] == j + 1
        r_acc = out.meta_info["spec_accepted_tokens"]
        assert r_acc <= j  # drafts after the EOS were accepted by the rule but are not counted
        assert llm.engine.stats.num_accepted_tokens == r_acc
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
        assert out.token_ids == ref and out.finish_reason == "length"
        assert_no_leak(llm.engine)


@pytest.mark.parametrize("K", [1, 4, 8])
def test_max_tokens_never_overshoots(cut_model, K: int) -> None:  # noqa: ANN001
    model, ref = cut_model
    plan = [(0, PROMPT, SamplingParams(temperature=0, max_tokens=m)) for m in range(1, 22)]
    llm = make_llm(model, SYN, K, rate=1.0)
    spec = drive(llm, plan)
    for (_, _, sp), r in zip(plan, spec):
        assert r.output_ids == ref[: sp.max_tokens] and r.finish_reason == "length"
        assert r.spec_accepted_tokens == r.spec_draft_tokens  # rate 1: every window shrank to fit
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


def test_stop_strings_cut_accepted_run(cut_model, verify_mode: str) -> None:  # noqa: ANN001
    model, ref = cut_model
    tok = FakeTokenizer()
    cases = []
    for j in range(2, 30, 3):  # a stop string spanning tokens j-1 and j ("3><45" ...)
        s = tok.id_to_piece(ref[j - 1])[-2:] + tok.id_to_piece(ref[j])[:2]
        m = next(m for m in range(1, 41) if s in tok.decode(ref[:m]))
        cases.append((s, m))
    cases.append(("<" + str(ref[12]) + ">", 1 + ref.index(ref[12])))  # exactly one token's text
    cases.append(("never-there", None))
    plain = make_llm(model, tokenizer=tok)
    llm = make_llm(model, SYN, K_CUT, rate=1.0, tokenizer=tok)
    for s, m in cases:
        sp = SamplingParams(temperature=0, max_tokens=40, stop=[s, "zzz"])
        for engine_llm in (plain, llm):
            out = engine_llm.generate([PROMPT], sp)[0]
            if m is None:
                assert out.token_ids == ref and out.finish_reason == "length" and out.text == tok.decode(ref)
                continue
            text = tok.decode(ref[:m])
            assert out.token_ids == ref[:m] and out.finish_reason == "stop", (s, m)
            assert out.text == text[: text.index(s)] and s not in out.text
            assert out.meta_info["completion_tokens"] == m
            if engine_llm is llm and m <= 31:
                r_acc, vc = out.meta_info["spec_accepted_tokens"], out.meta_info["spec_verify_ct"]
                e = m - 1 - (vc - 1) * (K_CUT + 1)
                assert 1 <= e <= K_CUT + 1 and r_acc == (vc - 1) * K_CUT + min(K_CUT, e)
    assert_no_leak(llm.engine)
    assert llm.engine.emitter.detok == {} and llm.engine.emitter.text == {}
