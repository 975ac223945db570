"""Structured output under speculation, greedy: grammar + speculation == grammar + plain decoding,
token for token, for every drafter (SYNTHETIC, NGRAM, STANDALONE, EAGLE-3 chains and trees, MTP,
DFlash, DSpark), compact and padded verify, K 1…7, requests joining mid-run, forced-token drafts on
and off — and plain decoding under a grammar equals a full-recompute masked-greedy oracle."""
from __future__ import annotations

import json
import random

import pytest
import torch

from specserve.core import SamplingParams
from specserve.grammar.backend import GrammarCompiler, GrammarSpec
from tests.drafter_setup import _spec_llm, _target
from tests.grammar_setup import EOS, tiny_tokenizer
from tests.spec_helpers import NGRAM, SYN, assert_no_leak, check_stats, drive, make_llm
from tests.spec_helpers import verify_mode  # noqa: F401  (fixture)
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_model, tiny_state_dict

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tag", "xs", "sub"],
          "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "cd", "xyz"]},
                         "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                         "sub": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
GRAMMARS = {"json": {"json_schema": json.dumps(SCHEMA)},
            "object": {"response_format": {"type": "json_object"}},
            "regex": {"regex": r"(ab|cd)+-[0-9]{2,5}(x|yz)*"},
            "ebnf": {"ebnf": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+ | "#" [0-9]'}}
TOK = tiny_tokenizer()


def plan_for(seed: int, n: int = 5, max_join: int = 4) -> list[tuple[int, list[int], SamplingParams]]:
    """Grammar requests of every kind joining at different steps, plus an unconstrained greedy and a
    sampled neighbour (neither may disturb the grammar requests, nor they them)."""
    rng = random.Random(seed)
    kinds = list(GRAMMARS)
    plan = [(rng.randint(0, max_join), [rng.randrange(EOS) for _ in range(rng.randint(2, 8))],
             SamplingParams(temperature=0, max_tokens=rng.randint(20, 48), **GRAMMARS[kinds[i % len(kinds)]]))
            for i in range(n)]
    plan.append((1, [3, 4, 5], SamplingParams(temperature=0, max_tokens=20)))
    plan.append((2, [6, 7], SamplingParams(temperature=1.0, max_tokens=16, seed=seed, regex="[a-z]+")))
    return plan


def outputs(reqs: list) -> list[tuple[list[int], str | None, str | None]]:  # noqa: ANN001
    return [(r.output_ids, r.finish_reason, r.error) for r in reqs]


def greedy_only(plan: list, outs: list) -> list:  # noqa: ANN001
    return [o for (_, _, sp), o in zip(plan, outs) if sp.greedy]


def masked_greedy_oracle(model, prompt: list[int], params: SamplingParams) -> list[int]:  # noqa: ANN001
    """Full recompute each token; argmax over the grammar's allowed set; stop at EOS, at the
    grammar's end or at max_tokens."""
    m = GrammarCompiler("llguidance", TOK, model.cfg.vocab_size, [EOS]).matcher(GrammarSpec.from_params(params))
    out: list[int] = []
    while len(out) < params.max_tokens:
        logits = _last_logits(model, prompt + out)
        t = int(logits.masked_fill(~m.allowed(), float("-inf")).argmax())
        out.append(t)
        if t == EOS:
            break
        assert m.accept(t)
        if m.is_terminated():
            break
    return out


def _last_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [[len(ids) - 1]])
    return logits[0][0]


def plain(model, plan: list, **opts) -> list:  # noqa: ANN001, ANN003
    """The reference: plain decoding, one token per step (no forced drafts)."""
    return drive(make_llm(model, tokenizer=TOK, grammar_forced_drafts=0, **opts), plan)


def test_plain_grammar_equals_masked_oracle() -> None:
    model = tiny_model("llama", seed=3)
    plan = plan_for(0, n=8)
    reqs = plain(model, plan)
    for (_, prompt, sp), r in zip(plan, reqs):
        if sp.greedy and sp.has_grammar:
            assert r.output_ids == masked_greedy_oracle(model, prompt, sp), r.request_id
    ended = [r for (_, _, sp), r in zip(plan, reqs) if sp.has_grammar and r.finish_reason == "stop"]
    assert ended, "no grammar request completed: the test would not see termination"
    for (_, _, sp), r in zip(plan, reqs):
        if sp.regex is not None and r.finish_reason == "stop":
            import re
            text = TOK.decode(r.output_ids)
            assert re.fullmatch(sp.regex, text), text
        if sp.json_schema is not None and r.finish_reason == "stop":
            obj = json.loads(TOK.decode(r.output_ids))
            assert set(obj) == set(SCHEMA["required"]) and obj["tag"] in ("ab", "cd", "xyz")


@pytest.mark.parametrize("seed", range(4))
def test_grammar_spec_equals_plain_synthetic_ngram(seed: int, verify_mode: str) -> None:  # noqa: F811
    model = tiny_model(("llama", "qwen2")[seed % 2], seed=seed)
    plan = plan_for(seed)
    ref = greedy_only(plan, outputs(plain(model, plan, page_size=4)))
    for algo in (SYN, NGRAM):
        for K in (1, 3, 5, 7) if seed % 2 == 0 else (2, 4, 6):
            for forced in (0, 8):
                llm = make_llm(model, algo, K, rate=0.8, tokenizer=TOK, page_size=4, grammar_forced_drafts=forced)
                reqs = drive(llm, plan)
                assert greedy_only(plan, outputs(reqs)) == ref, (algo, K, forced)
                check_stats(llm.engine, reqs)
                assert_no_leak(llm.engine)


def test_forced_drafts_without_a_drafter() -> None:
    """Plain decoding with forced-token drafts: same tokens, fewer steps (jump-forward is verified)."""
    model = tiny_model("llama", seed=7)
    plan = [(0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=40, **GRAMMARS["json"]))]
    ref = plain(model, plan)
    llm = make_llm(model, tokenizer=TOK, grammar_forced_drafts=8)
    reqs = drive(llm, plan)
    assert outputs(reqs) == outputs(ref)
    assert llm.engine.stats.num_drafts > 0 and llm.engine.stats.num_accepted_tokens > 0
    assert reqs[0].spec_decode_steps < len(reqs[0].output_ids) - 1


def test_forced_drafts_are_not_the_drafters_trials() -> None:
    """Tokens the grammar forces are verified like drafts but always accepted: they are credited to a source of
    their own ("grammar"), so the acceptance the `cost` policy plans a drafter's windows on is the drafter's."""
    model = tiny_model("llama", seed=7)
    plan = [(0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, regex="forced and nothing else, ever"))]
    llm = make_llm(model, NGRAM, 4, tokenizer=TOK, grammar_forced_drafts=8, speculative_window="cost")
    reqs = drive(llm, plan)
    assert "".join(TOK.decode([t]) for t in reqs[0].output_ids).startswith("forced and nothing else")
    trials = llm.engine.policy.trials.pooled
    assert llm.engine.stats.num_accepted_tokens > 0 and trials["grammar"][0] > 0
    assert set(trials) == {"grammar"}, trials  # the prompt lookup drafted nothing here


@pytest.mark.parametrize("algo,opts", [("eagle3", {}), ("eagle3", {"speculative_eagle_topk": 2}),
                                       ("mtp", {}), ("dflash", {}), ("dspark", {}),
                                       ("dspark", {"speculative_lattice_topk": 3}),
                                       ("dspark", {"speculative_algorithm": "HYBRID"})])
def test_grammar_spec_equals_plain_learned(trained: dict, algo: str, opts: dict, verify_mode: str) -> None:  # noqa: F811
    plan = plan_for(11)
    ref = greedy_only(plan, outputs(plain(_target(), plan)))
    for forced in (0, 8):
        llm = _spec_llm(trained, algo, tokenizer=TOK, grammar_forced_drafts=forced, **opts)
        reqs = drive(llm, plan)
        assert greedy_only(plan, outputs(reqs)) == ref, (algo, opts, forced)
        check_stats(llm.engine, reqs)
        assert_no_leak(llm.engine)


def test_grammar_spec_equals_plain_standalone(tmp_path) -> None:  # noqa: ANN001
    dcfg = tiny_config("qwen2", layers=1)
    draft = save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=2), tmp_path / "draft")
    TOK.backend.save(f"{draft}/tokenizer.json")  # the draft shares the target's tokenizer
    model = tiny_model("llama", seed=1)
    plan = plan_for(5)
    ref = greedy_only(plan, outputs(plain(model, plan)))
    for K in (1, 4, 7):
        llm = make_llm(model, "STANDALONE", K, tokenizer=TOK, speculative_draft_model_path=draft)
        reqs = drive(llm, plan)
        assert greedy_only(plan, outputs(reqs)) == ref, K
        assert_no_leak(llm.engine)


def test_xgrammar_backend_same_tokens() -> None:
    """--grammar-backend xgrammar: the same greedy outputs as llguidance, plain and speculative."""
    model = tiny_model("llama", seed=9)
    plan = plan_for(2)
    ref = greedy_only(plan, outputs(plain(model, plan)))
    for algo in (None, NGRAM):
        llm = make_llm(model, algo, 4, tokenizer=TOK, grammar_backend="xgrammar")
        assert greedy_only(plan, outputs(drive(llm, plan))) == ref, algo


def _assert_follows_grammar(sp: SamplingParams, r) -> None:  # noqa: ANN001
    """Every emitted token is one the grammar allowed; a request that stopped ended the grammar (or EOS)."""
    m = GrammarCompiler("llguidance", TOK, 97, [EOS]).matcher(GrammarSpec.from_params(sp))  # the tiny models' vocab
    for t in r.output_ids:
        if t == EOS:
            break
        assert m.accept(t), (r.request_id, TOK.decode(r.output_ids))
    if r.finish_reason == "stop":
        assert m.is_terminated() or r.output_ids[-1] == EOS, (r.request_id, TOK.decode(r.output_ids))


def test_grammar_spec_equals_plain_hybrid_target() -> None:
    """A hybrid (recurrent) target under a grammar: plain decoding equals the masked-greedy oracle, and
    speculation (SYNTHETIC: a hybrid draft model with its own state slots; NGRAM with forced drafts)
    equals plain decoding. Rejected drafts roll back the recurrent state and the grammar matcher together."""
    from tests.hybrid_setup import tiny_hybrid

    model = tiny_hybrid("LFLF", 1)  # recurrent and attention layers
    plan = plan_for(1, n=4)
    ref_reqs = plain(model, plan, page_size=4)
    for (_, prompt, sp), r in zip(plan, ref_reqs):
        if sp.has_grammar:
            _assert_follows_grammar(sp, r)
            if sp.greedy:
                assert r.output_ids == masked_greedy_oracle(model, prompt, sp), r.request_id
    ref = greedy_only(plan, outputs(ref_reqs))
    for algo, forced in ((SYN, 0), (NGRAM, 8)):
        llm = make_llm(model, algo, 4, rate=0.8, tokenizer=TOK, page_size=4, grammar_forced_drafts=forced)
        reqs = drive(llm, plan)
        assert greedy_only(plan, outputs(reqs)) == ref, (algo, forced)
        for (_, _, sp), r in zip(plan, reqs):
            if sp.has_grammar:
                _assert_follows_grammar(sp, r)
        assert llm.engine.stats.num_accepted_tokens > 0, (algo, forced)
        check_stats(llm.engine, reqs)
        assert_no_leak(llm.engine)
