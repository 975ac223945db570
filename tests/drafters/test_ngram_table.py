"""The corpus n-gram table and NGRAM drafting from it: the table equals counting by hand, survives a save and
load, refuses a table of another vocabulary by flag name; NGRAM + table equals plain greedy decoding
(fixed, confidence and cost windows, a batch joining mid-run), and replay_tau (the builder's held-out τ)
equals the engine's acceptance exactly. Sampling with table drafts: tests/speculative/test_accept_engine.py."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from specserve.core import SamplingParams
from specserve.drafters.ngram_table import BINS, NgramTable, _keys_np, context_keys
from specserve.train.ngram_build import calibration, replay_tau, table_draft, table_trials
from tests.spec_helpers import assert_no_leak, drive, make_llm
from tests.tiny import reference_greedy, tiny_model

V = 97


def reference(streams: list[tuple[list[int], list[bool]]], max_n: int, min_count: int) -> dict[tuple, tuple[int, float]]:
    """context tuple → (most frequent next token, smallest id on ties; its share), by counting."""
    counts: dict[tuple, Counter] = {}
    for ids, use in streams:
        for p in range(len(ids) - 1):
            if use[p + 1]:
                for n in range(1, min(max_n, p + 1) + 1):
                    counts.setdefault(tuple(ids[p - n + 1 : p + 1]), Counter())[ids[p + 1]] += 1
    out = {}
    for ctx, c in counts.items():
        total = sum(c.values())
        if total >= min_count:
            best = min(c, key=lambda t: (-c[t], t))
            out[ctx] = (best, c[best] / total)
    return out


def random_streams(seed: int, vocab: int = 7, n: int = 12) -> list[tuple[list[int], list[bool]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(vocab) for _ in range(5)]
        ids = [rng.randrange(vocab) if rng.random() < 0.3 else motif[i % 5] for i in range(rng.randrange(20, 60))]
        out.append((ids, [rng.random() < 0.8 for _ in ids]))
    return out


def test_keys_match_vectorised() -> None:
    ids = np.array([5, 1, 9, 9, 3, 0, 7], np.int64)
    for n in range(1, 5):
        k = _keys_np(ids, n)
        for p in range(n - 1, len(ids)):
            assert int(k[p]) == context_keys(list(ids[: p + 1]), n)[n - 1]


@pytest.mark.parametrize("min_count", [1, 2])
def test_table_equals_counting(min_count: int) -> None:
    streams = random_streams(0)
    table, (n_of) = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=7, max_n=3,
                                     min_count=min_count)
    ref = reference(streams, 3, min_count)
    assert len(table.keys) == len(ref) == len(n_of[0])
    rng = random.Random(1)
    contexts = [list(c) for c in ref] + [[rng.randrange(7) for _ in range(rng.randrange(1, 6))] for _ in range(200)]
    for ctx in contexts:
        want = next(((ref[tuple(ctx[-n:])], n) for n in range(min(3, len(ctx)), 0, -1) if tuple(ctx[-n:]) in ref), None)
        got = table.lookup(ctx)
        if want is None:
            assert got is None, ctx
        else:
            (tok, share), n = want
            assert got is not None and got[0] == tok and got[2] == n and abs(got[1] - round(share * 255) / 255) < 1e-6


def test_draft_chains_and_stops() -> None:
    streams = [([1, 2, 3, 4, 5, 6] * 4, [True] * 24)]
    table, _ = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=8, max_n=2, min_count=2)
    toks, conf = table.draft([9, 1, 2], 6)
    assert toks == [3, 4, 5, 6, 1, 2] and all(c == 1.0 for c in conf)
    assert table.draft([9, 1, 2], 2)[0] == [3, 4]
    assert table.draft([7], 3) == ([], [])  # no entry for the context


def test_short_lookup_extended_from_table() -> None:
    """A prompt-lookup continuation shorter than the window goes on from the table; its own tokens carry NaN
    confidence, which the policies read as the lookup source's acceptance estimate."""
    from specserve.core import DraftPlan, Request
    from specserve.drafters.lookups import Lookups, RequestLookups
    from specserve.drafters.ngram import NgramDrafter
    from specserve.cost.acceptance import AcceptTrials
    from specserve.cost.acceptance import accept_curves

    streams = [([1, 2, 3, 4, 5, 6] * 4, [True] * 24)]
    table, _ = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=8, max_n=2, min_count=2)
    drafter = NgramDrafter(Lookups(RequestLookups(2, 4)), table)
    r = Request("r", [1, 2, 7, 1, 2], SamplingParams(temperature=0.0))  # [1, 2] recurs: lookup gives [7, 1, 2]
    source = drafter.draft_source(r)
    assert source == "lookup"
    p = drafter.propose([r], DraftPlan([source], [6]))
    assert p.tokens == [[7, 1, 2, 3, 4, 5]]  # ... then the table chain from [.., 1, 2]: 3 4 5
    c = p.confidence[0]
    assert bool(c[:3].isnan().all()) and c[3:].tolist() == [1.0, 1.0, 1.0]
    trials = AcceptTrials(per_request={r.request_id: {"lookup": [3, 4]}})  # (3 + 4·0.5) / (4 + 4) = 0.625, no pool
    curve = accept_curves([r], DraftPlan([source], [6]), p, trials)[0]
    assert curve == pytest.approx([0.625, 0.625**2, 0.625**3] + [0.625**3] * 3)
    full = drafter.propose([r], DraftPlan([source], [2]))
    assert full.tokens == [[7, 1]] and full.confidence == [None]  # a full-length lookup draft is left as it is


def test_save_load_and_errors(tmp_path) -> None:  # noqa: ANN001
    streams = random_streams(2)
    table, (n_of,) = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=7, max_n=3,
                                      min_count=2, target="tiny-llama")
    table.calibrate(n_of, [[(b + 0.5) / BINS for b in range(BINS)] for _ in range(3)])
    table.save(tmp_path / "t")
    back = NgramTable.load(tmp_path / "t")
    assert back.meta == table.meta
    for a, b in ((back.keys, table.keys), (back.tokens, table.tokens), (back.conf, table.conf)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="--speculative-ngram-table: .* not an n-gram table"):
        NgramTable.load(tmp_path)
    meta = (tmp_path / "t" / "table.json").read_text()
    (tmp_path / "t" / "table.json").write_text(meta.replace('"vocab_size": 7', '"vocab_size": 3'))
    with pytest.raises(ValueError, match="inconsistent with its table.json .* vocabulary of 3"):
        NgramTable.load(tmp_path / "t")  # token ids up to 6 in a 3-token vocabulary: refused, not a crash later
    (tmp_path / "t" / "table.json").write_text(meta)
    cfg = tiny_model(vocab=V).cfg
    with pytest.raises(ValueError, match="--speculative-ngram-table: .*vocabulary of 7 tokens, the target has 97"):
        NgramTable.load(tmp_path / "t", cfg)


def test_calibration_is_monotone_probability() -> None:
    streams = random_streams(3)
    table, _ = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=7, max_n=3, min_count=2)
    held = [(s[0][:5], s[0][5:40]) for s in random_streams(4)]
    cal = calibration(table, held)
    assert len(cal) == 3 and all(len(r) == BINS for r in cal)
    for row in cal:
        assert all(0.0 <= x <= 1.0 for x in row) and row == sorted(row)


def test_table_trials_count_the_served_table_drafts() -> None:
    """Calibration counts table drafts where the replayed speculative loop (NGRAM's rule) tests them: the same
    totals as replaying table_draft and attributing each tested position to the lookup or the table."""
    from specserve.drafters.lookups import ngram_lookup

    streams = random_streams(3)
    table, _ = NgramTable.build([(np.array(i), np.array(u)) for i, u in streams], vocab_size=7, max_n=3, min_count=2)
    held = [(s[0][:5], s[0][5:50]) for s in random_streams(4)]
    acc = tested = 0
    for p, g in held:
        i = 0
        while i < len(g):
            ctx, lim = p + g[:i], min(4, len(g) - i - 1)
            d = ngram_lookup(ctx, 2, 4, lim)
            full = table_draft(table, 2)(ctx, lim)
            a = 0
            while a < len(full) and full[a] == g[i + a]:
                a += 1
            if a >= len(d):  # table positions tested: up to the first rejection
                tested += min(a + 1, len(full)) - len(d)
                acc += a - len(d)
            i += a + 1
    hits, seen = table_trials(table, held)
    assert (hits.sum(), seen.sum()) == (acc, tested) and tested > 20


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=V, seed=3)


@pytest.fixture(scope="module")
def greedy_table(model, tmp_path_factory):  # noqa: ANN001
    """A table of the tiny model's own greedy continuations, so its drafts are often (not always) right."""
    rng = random.Random(5)
    streams = []
    for _ in range(12):
        prompt = [rng.randrange(V) for _ in range(6)]
        g = reference_greedy(model, prompt, 40)
        streams.append((np.array(prompt + g), np.array([False] * len(prompt) + [True] * len(g))))
    table, (n_of,) = NgramTable.build(streams, vocab_size=V, max_n=3, min_count=1, target=model.cfg.name)
    table.calibrate(n_of, [[0.3 + 0.07 * b for b in range(BINS)]] * 3)
    path = tmp_path_factory.mktemp("table") / "tiny-ngram"
    table.save(path)
    return path


@pytest.mark.parametrize("window", ["fixed", "confidence", "cost"])
def test_ngram_table_greedy_equals_plain(model, greedy_table, window: str) -> None:  # noqa: ANN001
    rng = random.Random(7)
    plan = [(rng.randrange(6), [rng.randrange(V) for _ in range(rng.randrange(3, 9))],
             SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 40))) for _ in range(6)]
    llm = make_llm(model, "NGRAM", K=5, speculative_ngram_table=str(greedy_table), speculative_window=window,
                   speculative_ngram_min_match=3)
    assert llm.engine.drafter.table is not None and llm.engine.drafter.sources == ("lookup", "suffix", "table")
    reqs = drive(llm, plan)
    for r, (_, prompt, sp) in zip(reqs, plan):
        assert r.output_ids == reference_greedy(model, prompt, sp.max_tokens)
    assert llm.engine.stats.num_accepted_tokens > 0 and llm.engine.stats.num_drafts > 0
    assert_no_leak(llm.engine)


def test_replay_tau_equals_engine(model, greedy_table) -> None:  # noqa: ANN001
    """The builder's held-out τ (replay on the greedy output) is the engine's acceptance, exactly."""
    table = NgramTable.load(greedy_table)
    llm = make_llm(model, "NGRAM", K=4, speculative_ngram_table=str(greedy_table), speculative_ngram_min_match=2)
    rng = random.Random(11)
    for _ in range(4):
        prompt = [rng.randrange(V) for _ in range(7)]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
        first, g = out.token_ids[0], out.token_ids[1:]  # the first token comes from prefill
        n, rounds, drafted = replay_tau(prompt + [first], g, table_draft(table, 2), 4)
        m = out.meta_info
        assert (n - rounds, drafted) == (m["spec_accepted_tokens"], m["spec_draft_tokens"]), (n, rounds, drafted, m)
        assert drafted > 0


def test_flag_none_and_other_algorithms(model, greedy_table) -> None:  # noqa: ANN001
    from specserve.config import EngineConfig
    from specserve.speculative.resolve import check_config

    assert make_llm(model, "NGRAM", speculative_ngram_table="none").engine.drafter.table is None
    with pytest.raises(ValueError, match="--speculative-ngram-table does not apply to --speculative-algorithm SYNTHETIC"):
        check_config(EngineConfig(speculative_algorithm="SYNTHETIC", speculative_ngram_table=str(greedy_table)))
    with pytest.raises(ValueError, match="--speculative-ngram-table: .* not an n-gram table"):
        make_llm(model, "NGRAM", speculative_ngram_table=str(greedy_table.parent))


class _ChatTok:
    """A stand-in tokenizer for regenerate: one token id per character of the user's text."""

    def apply_chat_template(self, msgs, add_generation_prompt: bool = True) -> str:  # noqa: ANN001
        return msgs[-1]["content"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % V for c in text]


def test_regenerate_caches_chunks_and_resumes(model, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Regenerated answers are the target's greedy ones, cached per chunk: a rerun (or a larger
    --regen-prompts) reads finished chunks instead of generating, and a chunk that does not match is refused."""
    import argparse

    from specserve.train import ngram_build

    monkeypatch.setattr(ngram_build, "REGEN_CHUNK", 3)
    rng = random.Random(3)
    train = [[{"role": "user", "content": "".join(chr(65 + rng.randrange(26)) for _ in range(rng.randrange(3, 8)))},
              {"role": "assistant", "content": "x"}] for _ in range(7)]
    tok = _ChatTok()
    a = argparse.Namespace(regen_prompts=4, regen_tokens=6, max_prompt_tokens=6, regen_cache=str(tmp_path), seed=0)
    llm = make_llm(model)
    out = ngram_build.regenerate(llm, tok, train, a)
    prompts = [tok.encode(c[0]["content"]) for c in train[:6]]  # 4 prompts round up to 2 chunks of 3
    kept = [p for p in prompts if len(p) <= 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-0000.npz", "chunk-0001.npz"]
    assert len(out) == len(kept)
    for (ids, mask), p in zip(out, kept):
        assert list(ids) == p + reference_greedy(model, p, 6) and list(mask) == [False] * len(p) + [True] * 6

    class NoGenerate:  # a rerun must not generate: every chunk is cached
        def generate(self, *args, **kw):  # noqa: ANN002, ANN003, ANN202
            raise AssertionError("generated a cached chunk")

    again = ngram_build.regenerate(NoGenerate(), tok, train, a)
    assert [(list(i), list(m)) for i, m in again] == [(list(i), list(m)) for i, m in out]
    a.max_prompt_tokens = 7  # other prompts kept: the cached chunks no longer match
    with pytest.raises(ValueError, match="delete it"):
        ngram_build.regenerate(NoGenerate(), tok, train, a)

