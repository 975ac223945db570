"""Structured output, unit level: request validation, both backends, look-ahead that never moves the
matcher, and one regression test per bug class SGLang/vLLM shipped with speculation on (named after it)."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.core import Proposal, SamplingParams
from specserve.grammar.backend import GrammarCompiler, GrammarError, GrammarSpec
from specserve.grammar.ops import mask_after, masks_along, valid_prefix
from specserve.speculative.grammar import EMPTY_MASK, cut_to_grammar, forced_drafts
from tests.grammar_setup import EOS, tiny_tokenizer
from tests.spec_helpers import NGRAM, SYN, drive, make_llm
from tests.tiny import tiny_model

TOK = tiny_tokenizer()
ids = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
SCHEMA = json.dumps({"type": "object", "properties": {"k": {"enum": ["yes", "no"]}}, "required": ["k"],
                     "additionalProperties": False})


def matcher(backend: str = "llguidance", **grammar):  # noqa: ANN003, ANN201
    spec = GrammarSpec.from_params(SamplingParams(**grammar))
    return GrammarCompiler(backend, TOK, 97, [EOS]).matcher(spec)


# ---- validation: one grammar per request, reasons in the message ----
@pytest.mark.parametrize("kw,field", [
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"json_schema": "{oops"}, "json_schema"),
    ({"regex": ""}, "regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
])
def test_params_refuse_bad_grammar_fields(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate(97)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("kw,why", [({"regex": "a(b"}, "regex"), ({"ebnf": "root ::= ("}, "ebnf"),
                                    ({"json_schema": '{"type": "nope"}'}, "json_schema")])
def test_compile_errors_name_the_field(backend: str, kw: dict, why: str) -> None:
    with pytest.raises(GrammarError, match=why):
        matcher(backend, **kw)


def test_engine_refuses_bad_grammar_at_add_request() -> None:
    llm = make_llm(tiny_model(), tokenizer=TOK)
    with pytest.raises(ValueError, match="regex"):
        llm.engine.add_request([1, 2], SamplingParams(regex="(", max_tokens=4))
    assert llm.engine.requests == {}


def test_grammar_without_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        make_llm(tiny_model()).engine.add_request([1], SamplingParams(regex="a", max_tokens=2))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_backends_agree_on_masks_and_termination(backend: str) -> None:
    m, ref = matcher(backend, json_schema=SCHEMA), matcher("llguidance", json_schema=SCHEMA)
    text = ids('{"k": "yes"}')
    for i, t in enumerate(text):
        assert torch.equal(m.allowed(), ref.allowed()), i
        assert m.accept(t) and ref.accept(t)
    assert m.is_terminated() and ref.is_terminated()


# ---- look-ahead never moves the matcher ("rollback corrupting state") ----
def test_rollback_corrupting_state_lookahead_restores_matcher() -> None:
    m = matcher(json_schema=SCHEMA)
    assert m.accept(ids("{")[0])
    before, forced = m.allowed().clone(), m.forced_tokens()
    good, bad = ids(' "k": "no"}'), ids(' "x"')
    assert valid_prefix(m, good) == len(good) and valid_prefix(m, bad) == 2  # space and quote
    assert len(masks_along(m, good)) == len(good) + 1
    assert mask_after(m, good) is None  # terminated within them
    with pytest.raises(ValueError):
        mask_after(m, bad)
    assert torch.equal(m.allowed(), before) and m.forced_tokens() == forced and not m.is_terminated()


def test_stale_terminated_flag_is_never_cached() -> None:
    """Looking ahead past the grammar's end and back must not leave the matcher 'terminated'."""
    m = matcher(regex="ab")
    assert masks_along(m, ids("ab"))[-1] is None
    assert not m.is_terminated() and m.allowed()[ids("a")[0]]


# ---- the draft stage ----
def _req(**grammar):  # noqa: ANN003, ANN202
    from specserve.core import Request

    return Request("r", [1], SamplingParams(max_tokens=20, **grammar), grammar=matcher(**grammar))


def test_drafts_after_grammar_end_are_cut() -> None:
    """("drafts fed to a matcher that had already accepted EOS"): nothing past the end is verified."""
    r = _req(regex="ab")
    out = cut_to_grammar([r], Proposal([ids("abab")]))
    assert out.tokens == [ids("ab")]


def test_tree_keeps_only_valid_nodes() -> None:
    r = _req(regex="a(b|c)d")
    a, b, c, d, x = ids("abcdx")
    p = Proposal([[a, x, b, c, d, x, d]], parents=[[-1, -1, 0, 0, 2, 2, 3]], confidence=[torch.arange(7.0)])
    out = cut_to_grammar([r], p)
    assert out.tokens == [[a, b, c, d, d]] and out.parents == [[-1, 0, 0, 1, 2]]
    assert out.confidence[0].tolist() == [0.0, 2.0, 3.0, 4.0, 6.0]


def test_forced_drafts_decided_before_drafting() -> None:
    r = _req(regex="abc(d|e)")
    assert forced_drafts([r], [0], lambda _: 8) == {"r": ids("abc")}
    assert forced_drafts([r], [5], lambda _: 8) == {}  # the drafter's planned window is longer: it drafts
    assert forced_drafts([r], [2], lambda _: 2) == {"r": ids("ab")}


def test_masks_computed_for_drafts_later_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """("masks computed for drafts that were later cut"): masks are built in ACCEPT, for exactly the
    drafts verified (after the window cut and the grammar cut)."""
    import specserve.speculative.grammar as g

    seen: list[list[int]] = []
    real = g.masks_along
    monkeypatch.setattr(g, "masks_along", lambda m, toks: seen.append(list(toks)) or real(m, toks))
    llm = make_llm(tiny_model(seed=2), SYN, 6, rate=1.0, tokenizer=TOK)
    r = llm.engine.add_request([1, 2], SamplingParams(temperature=0, max_tokens=24, regex="(ab|cd)+"))
    while llm.engine.has_unfinished():
        verified_before = r.spec_draft_tokens
        llm.engine.step()
        if seen and r.spec_draft_tokens > verified_before:
            assert len(seen[-1]) == r.spec_draft_tokens - verified_before
    assert seen


# ---- accept and commit ----
def test_empty_mask_fails_the_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """("an empty mask turning into NaN and a 500"): a clear error for that request; neighbours finish."""
    llm = make_llm(tiny_model(), NGRAM, 3, tokenizer=TOK)
    bad = llm.engine.add_request([1, 2], SamplingParams(temperature=0.7, max_tokens=8, regex="[a-z]+", seed=1))
    good = llm.engine.add_request([3, 4], SamplingParams(temperature=0, max_tokens=8, regex="[a-z]+"))
    monkeypatch.setattr(bad.grammar, "allowed", lambda: torch.zeros(97, dtype=torch.bool))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert bad.finish_reason == "error" and bad.error == EMPTY_MASK and "NaN" not in bad.error
    assert good.finish_reason == "length" and good.error is None


def test_nan_check_runs_before_masking(monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.speculative.accept import accept_request

    r = _req(regex="[a-z]+")
    raw = torch.zeros(1, 97)
    assert accept_request(r, raw, [], None, "auto").error is None  # −inf from the mask is not NaN
    raw[0, 5] = float("nan")
    assert "NaN" in accept_request(r, raw, [], None, "auto").error


def test_grammar_finish_checked_after_the_stop_string_scan() -> None:
    """("a grammar finish checked before the stop-string scan"): a stop string ending at the grammar's
    last token cuts the text as a stop string does; a stop string inside stops before the grammar ends."""
    model = tiny_model(seed=4)
    plan = [(0, [1, 2], SamplingParams(temperature=0, max_tokens=30, regex="xyz", stop=["yz"])),
            (0, [1, 2], SamplingParams(temperature=0, max_tokens=30, regex="xyzw", stop=["y"]))]
    for algo in (None, NGRAM):
        a, b = drive(make_llm(model, algo, tokenizer=TOK), plan)
        assert (a.output_ids, a.finish_reason, a.stop_text) == (ids("xyz"), "stop", "x")
        assert (b.output_ids, b.finish_reason, b.stop_text) == (ids("xy"), "stop", "x")


def test_grammar_end_finishes_without_eos_and_ignores_nothing() -> None:
    """The request ends at the grammar's last token ("stop"), with ignore_eos too; never past it."""
    model = tiny_model(seed=6)
    for ignore in (False, True):
        for algo in (None, SYN):
            (r,) = drive(make_llm(model, algo, 5, rate=1.0, tokenizer=TOK),
                         [(0, [1], SamplingParams(temperature=0, max_tokens=40, regex="(ab){3}", ignore_eos=ignore))])
            assert (r.output_ids, r.finish_reason) == (ids("ababab"), "stop")


@pytest.mark.parametrize("packing", ["compact", "padded"])
def test_verify_path_without_the_mask(monkeypatch: pytest.MonkeyPatch, packing: str) -> None:
    """("a verify path without the mask"): every path that judges target rows — the first token after
    prefill, compact and padded verify windows, lookups — emits only grammar-valid tokens, checked by a
    fresh matcher replaying the output."""
    monkeypatch.setenv("SPECSERVE_SPECULATIVE_VERIFY_PACKING", packing)
    model = tiny_model(seed=8)
    plan = [(i, [1 + i, 2, 3], SamplingParams(temperature=t, max_tokens=30, seed=i, regex=r"[0-9]{3}(-[a-f]+)+"))
            for i, t in enumerate((0.0, 0.0, 0.8, 1.5))]
    for algo in (None, SYN, NGRAM):
        for r in drive(make_llm(model, algo, 5, rate=1.0, tokenizer=TOK), plan):
            m = matcher(regex=r"[0-9]{3}(-[a-f]+)+")
            assert r.error is None and all(m.accept(t) for t in r.output_ids), (algo, TOK.decode(r.output_ids))
