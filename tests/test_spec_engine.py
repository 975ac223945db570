"""Speculative-decoding invariants (NGRAM and SYNTHETIC drafters) on tiny fp64 models:

1. greedy speculative output == plain output, token for token (any K, drafter, verify mode, batch);
2. after every commit the target KV at [0, committed_len) equals a from-scratch forward;
3. EOS / stop ids / stop strings / max_tokens cut an accepted run: nothing after is emitted or counted;
4. logprobs under speculation equal plain logprobs, bonus token included;
5. NaN in one request's verify logits fails that request alone;
6. SYNTHETIC acceptance behaves as configured; engine-wide counters equal per-request sums.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

import specserve.engine.engine as engine_mod
from specserve.cache.kv_pool import KVPool
from specserve.core import SamplingParams, Status
from specserve.engine.llm import LLM
from specserve.engine.runner import ModelRunner
from tests.tiny import ref_logits, reference_greedy, tiny_model

V = 97
SYN = "SYNTHETIC"
NGRAM = "NGRAM"


# ---------------------------------------------------------------- helpers
def make_llm(model, algo: str | None = None, K: int = 4, rate: float = 0.7, **opts) -> LLM:  # noqa: ANN001
    opts.setdefault("kv_cache_memory", "512KiB")
    if algo:
        opts.update(speculative_algorithm=algo, speculative_num_draft_tokens=K)
        if algo == SYN:
            opts["speculative_synthetic_accept_rate"] = rate
    return LLM.from_model(model, **opts)


def drive(llm: LLM, plan: list[tuple[int, list[int], SamplingParams]], on_step=None, max_steps: int = 3000):  # noqa: ANN001, ANN201
    """plan: (engine step at which the request joins, prompt, params). Returns requests in plan order."""
    eng = llm.engine
    order = sorted(range(len(plan)), key=lambda i: plan[i][0])
    reqs: list = [None] * len(plan)
    step = 0
    while order or eng.has_unfinished():
        while order and plan[order[0]][0] <= step:
            i = order.pop(0)
            reqs[i] = eng.add_request(plan[i][1], plan[i][2], request_id=f"p{i}")
        eng.step()
        step += 1
        if on_step:
            on_step(eng, step)
        assert step < max_steps, "engine made no progress"
    return reqs


def assert_no_leak(eng) -> None:  # noqa: ANN001
    assert not eng.has_unfinished() and eng.requests == {}
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_pages
    d = eng.drafter
    if d is not None and hasattr(d, "kv"):
        assert d.state == {}
        assert d.kv.allocator.num_free == d.kv.allocator.num_pages


def fresh_kv(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """K/V of ids from one from-scratch forward, per layer [len(ids), kv_heads, head_dim]."""
    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    ModelRunner(model, kv).forward([pt], [0], [ids], [[]])
    slots = torch.tensor(kv.slots(pt, 0, len(ids)))
    return [k[slots] for k in kv.k], [v[slots] for v in kv.v]




def check_stats(eng, reqs) -> None:  # noqa: ANN001
    """Engine-wide counters equal the per-request sums; per-request counters are self-consistent."""
    s = eng.stats
    assert s.num_drafts == sum(r.spec_verify_ct for r in reqs)
    assert s.num_draft_tokens == sum(r.spec_draft_tokens for r in reqs)
    assert s.num_accepted_tokens == sum(r.spec_accepted_tokens for r in reqs)
    width = max([len(s.accepted_tokens_per_pos)] + [len(r.spec_accepted_per_pos) for r in reqs])
    per_pos = [0] * width
    for r in reqs:
        for i, c in enumerate(r.spec_accepted_per_pos):
            per_pos[i] += c
    assert per_pos == s.accepted_tokens_per_pos + [0] * (width - len(s.accepted_tokens_per_pos))
    assert sum(s.accepted_tokens_per_pos) == s.num_accepted_tokens
    for r in reqs:
        assert sum(r.spec_accepted_per_pos) == r.spec_accepted_tokens <= r.spec_draft_tokens
        assert all(a >= b for a, b in zip(r.spec_accepted_per_pos, r.spec_accepted_per_pos[1:]))
        assert all(c <= r.spec_verify_ct for c in r.spec_accepted_per_pos)
        assert r.spec_draft_tokens <= r.spec_verify_ct * eng.num_draft_tokens
        # every emitted token is the prefill's first token, a verify's bonus/correction, an accepted
        # draft or a plain-decode token: accepted drafts never exceed what was emitted
        if r.finish_reason != "error":
            assert r.spec_accepted_tokens + r.spec_verify_ct <= max(len(r.output_ids) - 1, 0) + (r.spec_verify_ct > 0)


def rand_plan(rng: random.Random, n: int, max_join: int = 6) -> list[tuple[int, list[int], SamplingParams]]:
    plan = []
    for i in range(n):
        L = rng.choice([1, 2, 5, 9, 14, 23, 31])
        if rng.random() < 0.5:  # repetitive prompt: gives NGRAM something to match
            unit = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
            prompt = (unit * L)[:L]
        else:
            prompt = [rng.randrange(V) for _ in range(L)]
        kw: dict = dict(temperature=0, max_tokens=rng.randint(8, 36))
        if i % 4 == 3:
            kw.update(repetition_penalty=1.3)
        elif i % 5 == 4:
            kw.update(presence_penalty=0.6, frequency_penalty=0.4)
        plan.append((rng.randint(0, max_join), prompt, SamplingParams(**kw)))
    return plan


@pytest.fixture(params=["compact", "padded"])
def verify_mode(request, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("SPECSERVE_RAGGED_VERIFY_MODE", request.param)
    return request.param


# ---------------------------------------------------------------- 1. greedy equality
GRID_K = [1, 2, 3, 4, 5, 6, 8, 11, 13, 16]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_spec_equals_plain(seed: int, verify_mode: str) -> None:
    arch = ("llama", "qwen2", "qwen3")[seed % 3]
    model = tiny_model(arch, seed=seed)
    K = GRID_K[seed]
    algo = SYN if seed % 2 == 0 else NGRAM
    rate = (0.0, 0.5, 0.9, 1.0)[(seed // 2) % 4]
    page_size = (1, 4, 16)[seed % 3]
    max_prefill = (7, 64, 2048)[(seed // 3) % 3]
    rng = random.Random(100 + seed)
    plan = rand_plan(rng, 6)
    # one sampled neighbour: its randomness must not disturb the greedy requests
    plan.append((1, [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=20, seed=seed)))
    opts = dict(page_size=page_size, max_prefill_tokens=max_prefill)
    plain = drive(make_llm(model, **opts), plan)
    llm = make_llm(model, algo, K, rate, **opts)
    assert llm.engine.verify_mode == verify_mode
    spec = drive(llm, plan)
    for (_, prompt, sp), a, b in zip(plan, plain, spec):
        if sp.greedy:
            assert b.output_ids == a.output_ids, (b.request_id, algo, K, rate)
            assert b.finish_reason == a.finish_reason
    if seed == 0:  # plain itself against the full-recompute oracle
        for (_, prompt, sp), a in zip(plan, plain):
            if sp.greedy and not sp.needs_penalties:
                assert a.output_ids == reference_greedy(model, prompt, sp.max_tokens)
    assert llm.engine.stats.num_drafts > 0
    if algo == SYN and rate == 1.0:
        greedy = [r for r, (_, _, sp) in zip(spec, plan) if sp.greedy and not sp.needs_penalties]
        assert all(r.spec_accepted_tokens == r.spec_draft_tokens for r in greedy)
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("algo", [SYN, NGRAM])
def test_greedy_spec_equals_plain_every_k(algo: str) -> None:
    model = tiny_model("llama", seed=21)
    rng = random.Random(algo)
    plan = rand_plan(rng, 3, max_join=3)
    plain = [r.output_ids for r in drive(make_llm(model, page_size=4), plan)]
    for K in range(1, 17):
        llm = make_llm(model, algo, K, rate=0.8, page_size=4)
        spec = drive(llm, plan)
        assert [r.output_ids for r in spec] == plain, K
        check_stats(llm.engine, spec)
        assert_no_leak(llm.engine)


@pytest.mark.parametrize("algo,K", [(SYN, 4), (SYN, 16), (NGRAM, 8)])
def test_greedy_spec_equals_plain_under_preemption(algo: str, K: int, verify_mode: str) -> None:
    """A tiny pool: requests are preempted and recomputed, drafts lose their windows, the SYNTHETIC
    draft pool runs out; the output never changes."""
    model = tiny_model("qwen2", seed=5)
    rng = random.Random(K)
    plan = [(rng.randint(0, 4), [rng.randrange(V) for _ in range(rng.randint(2, 9))],
             SamplingParams(temperature=0, max_tokens=rng.randint(10, 24))) for _ in range(7)]
    plain = drive(make_llm(model, page_size=4), plan)
    mem = "48KiB" if algo == SYN else "24KiB"  # SYNTHETIC gives half the budget to its draft pool
    llm = make_llm(model, algo, K, rate=0.9, kv_cache_memory=mem, page_size=4, max_prefill_tokens=8)
    spec = drive(llm, plan)
    assert sum(r.num_preemptions for r in spec) > 0
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


def test_padded_verify_near_context_end() -> None:
    """Padding a short window up to a neighbour's width must not run past the model's positions."""
    model = tiny_model("llama", seed=0, max_position_embeddings=40)
    for mode in ("compact", "padded"):
        for ps in (4, 16):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPECSERVE_RAGGED_VERIFY_MODE", mode)
                plan = [(0, [1], SamplingParams(temperature=0, max_tokens=36)),
                        (0, list(range(1, 24)), SamplingParams(temperature=0, max_tokens=100)),
                        (0, list(range(1, 33)), SamplingParams(temperature=0, max_tokens=100))]
                plain = drive(make_llm(model, page_size=ps), plan)
                llm = make_llm(model, SYN, 8, rate=1.0, page_size=ps)
                spec = drive(llm, plan)
                assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
                assert [r.seq_len for r in spec[1:]] == [40, 40]
                assert_no_leak(llm.engine)


# ---------------------------------------------------------------- 2. KV after commit
def _check_kv(model, eng) -> int:  # noqa: ANN001
    checked = 0
    for r in list(eng.requests.values()):
        c = r.committed_len
        if r.status is not Status.RUNNING or c == 0:
            continue
        assert c <= r.seq_len - (0 if r.in_prefill else 1)
        fk, fv = fresh_kv(model, r.all_ids[:c])
        slots = torch.tensor(eng.kv.slots(r.page_table, 0, c))
        for l in range(model.cfg.num_layers):
            torch.testing.assert_close(eng.kv.k[l][slots], fk[l], atol=1e-9, rtol=0)
            torch.testing.assert_close(eng.kv.v[l][slots], fv[l], atol=1e-9, rtol=0)
        st = getattr(eng.drafter, "state", {}).get(r.request_id)
        if st is not None and st.done:  # SYNTHETIC drafts with the target's own weights
            d = st.done
            assert d <= r.seq_len - 1 or r.in_prefill
            dslots = torch.tensor(eng.drafter.kv.slots(st.page_table, 0, d))
            for l in range(model.cfg.num_layers):
                torch.testing.assert_close(eng.drafter.kv.k[l][dslots], fk[l][:d] if d <= c else fresh_kv(
                    model, r.all_ids[:d])[0][l], atol=1e-9, rtol=0)
        checked += 1
    return checked


@pytest.mark.parametrize("algo,K,page_size", [(SYN, 16, 4), (SYN, 5, 16), (NGRAM, 16, 4), (NGRAM, 3, 1)])
def test_kv_after_commit_equals_recompute(algo: str, K: int, page_size: int, verify_mode: str) -> None:
    model = tiny_model("qwen3", seed=8)
    rng = random.Random(K * 7 + page_size)
    plan = []
    for i in range(5):
        L = rng.randint(1, 20)
        unit = [rng.randrange(V) for _ in range(3)]
        plan.append((i, (unit * L)[:L], SamplingParams(temperature=0, max_tokens=(6, 40, 15, 40, 25)[i])))
    llm = make_llm(model, algo, K, rate=0.7, page_size=page_size, max_prefill_tokens=9)
    counts = []
    spec = drive(llm, plan, on_step=lambda eng, step: counts.append(_check_kv(model, eng)))
    assert sum(counts) > 20
    finish_steps = sorted(r.finish_time for r in spec)
    assert finish_steps[0] < finish_steps[-1]  # some finished while others continued
    assert llm.engine.stats.num_accepted_tokens > 0
    assert_no_leak(llm.engine)


# ---------------------------------------------------------------- 3. cuts inside accepted runs
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


# ---------------------------------------------------------------- 4. logprobs
@pytest.mark.parametrize("algo,K", [(SYN, 4), (SYN, 9), (NGRAM, 3)])
def test_logprobs_spec_equal_plain(algo: str, K: int, verify_mode: str) -> None:
    model = tiny_model("qwen2", dtype=torch.float32, seed=2)
    with torch.no_grad():  # logits of a few units, as real LMs: fp32 batch-shape noise stays ~3e-6
        model.lm_head.mul_(0.3)
    prompts = [[1, 2, 3, 1, 2, 3], [40, 41], [7] * 11, [60, 70, 80, 90]]
    sp = SamplingParams(temperature=0, max_tokens=24, logprobs=5)
    plain = make_llm(model, page_size=4).generate(prompts, sp)
    llm = make_llm(model, algo, K, rate=0.8, page_size=4)
    spec = llm.generate(prompts, sp)
    assert llm.engine.stats.num_accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(b.token_ids) == 24
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.token_id == la.token_id
            assert abs(lb.logprob - la.logprob) <= 1e-5
            assert [i for i, _ in lb.top] == [i for i, _ in la.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) <= 1e-5


def test_sampled_logprobs_under_spec_match_reference() -> None:
    model = tiny_model("llama", seed=4)
    llm = make_llm(model, SYN, 6, rate=0.9)
    prompts = [[3, 3, 3, 3], [9, 8, 7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, top_k=5, max_tokens=20, logprobs=2, seed=11))
    assert llm.engine.stats.num_accepted_tokens > 0
    for o, p in zip(outs, prompts):
        rows = ref_logits(model, p + o.token_ids[:-1])[len(p) - 1 :]
        lps = torch.log_softmax(rows, dim=-1)
        for lp, t, row, lrow in zip(o.logprobs, o.token_ids, rows, lps):
            assert abs(lp.logprob - float(lrow[t])) < 1e-9
            assert int((row > row[t]).sum()) < 5  # top_k support holds under speculation
    again = make_llm(model, SYN, 6, rate=0.9).generate(prompts, SamplingParams(
        temperature=0.7, top_k=5, max_tokens=20, logprobs=2, seed=11))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: reproducible


# ---------------------------------------------------------------- 5. NaN isolation
@pytest.mark.parametrize("algo", [SYN, NGRAM, None])
def test_nan_in_verify_fails_only_that_request(algo: str | None, verify_mode: str, monkeypatch) -> None:  # noqa: ANN001
    model = tiny_model("qwen2", seed=6)
    rng = random.Random(3)
    plan = [(i % 3, [rng.randrange(V) for _ in range(rng.randint(2, 12))], SamplingParams(temperature=0, max_tokens=20))
            for i in range(5)]
    plain = drive(make_llm(model, page_size=4), plan)
    victim = "p2"
    real_verify = engine_mod.verify
    hits = []

    def nan_verify(runner, reqs, proposal, mode="compact", aux=()):  # noqa: ANN001, ANN202
        logits, feats = real_verify(runner, reqs, proposal, mode, aux)
        for i, r in enumerate(reqs):
            if r.request_id == victim and len(r.output_ids) >= 4:
                logits[i] = logits[i].clone()
                logits[i][-1, 3] = float("nan")  # the bonus row only: the drafts' rows look fine
                hits.append(len(r.output_ids))
        return logits, feats

    monkeypatch.setattr(engine_mod, "verify", nan_verify)
    llm = make_llm(model, algo, 6, rate=0.9, page_size=4)
    spec = drive(llm, plan)
    assert hits == [hits[0]]  # failed at the first poisoned verify, never verified again
    for (_, prompt, _), a, b in zip(plan, plain, spec):
        if b.request_id == victim:
            assert b.finish_reason == "error" and "NaN" in b.error
            assert b.output_ids == a.output_ids[: len(b.output_ids)] and len(b.output_ids) == hits[0]
        else:
            assert b.output_ids == a.output_ids and b.finish_reason == "length" and b.error is None
    if algo:
        check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)


def test_nan_in_prefill_fails_only_that_request(monkeypatch) -> None:  # noqa: ANN001
    model = tiny_model("llama", seed=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14]]
    plain = make_llm(model).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    llm = make_llm(model, SYN, 4, rate=0.9, max_prefill_tokens=4)
    eng = llm.engine
    real_forward = eng.runner.forward
    victim_pt: list = []

    def nan_forward(page_tables, starts, tokens, offsets, *a, **k):  # noqa: ANN001, ANN202
        logits, cap = real_forward(page_tables, starts, tokens, offsets, *a, **k)
        for i, pt in enumerate(page_tables):
            if victim_pt and pt is victim_pt[0] and len(logits[i]):
                logits[i] = torch.full_like(logits[i], float("nan"))
        return logits, cap

    monkeypatch.setattr(eng.runner, "forward", nan_forward)
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12)) for p in prompts]
    victim_pt.append(reqs[1].page_table)
    while eng.has_unfinished():
        eng.step()
    assert reqs[1].finish_reason == "error" and "NaN" in reqs[1].error and reqs[1].output_ids == []
    for i in (0, 2):
        assert reqs[i].output_ids == plain[i].token_ids
    outs = [llm._completion(0, r) for r in reqs]
    assert outs[1].error and outs[1].finish_reason == "error"
    assert_no_leak(eng)


# ---------------------------------------------------------------- 6. SYNTHETIC acceptance, stats
@pytest.mark.parametrize("K", [3, 8])
def test_synthetic_acceptance_extremes(K: int) -> None:
    model = tiny_model("llama", seed=9)
    prompts = [[1, 2, 3], [50, 51, 52, 53, 54], [7]]
    rounds = 3
    mt = 1 + rounds * (K + 1)
    llm = make_llm(model, SYN, K, rate=1.0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=mt))
    for o, p in zip(outs, prompts):
        mi = o.meta_info
        assert "SYNTHETIC" in mi["speculative_algorithm"] and "test" in mi["speculative_algorithm"]
        assert mi["spec_verify_ct"] == rounds and mi["spec_accept_length"] == K + 1
        assert mi["spec_draft_tokens"] == mi["spec_accepted_tokens"] == rounds * K
        assert mi["spec_accepted_per_pos"] == [rounds] * K
        assert o.token_ids == reference_greedy(model, p, mt)
    assert llm.engine.stats.acceptance_length == K + 1
    # rate 0: every draft is wrong → one token per verify; the last step has no room for a draft
    llm0 = make_llm(model, SYN, K, rate=0.0)
    outs0 = llm0.generate(prompts, SamplingParams(temperature=0, max_tokens=mt))
    for o, ref in zip(outs0, outs):
        mi = o.meta_info
        assert o.token_ids == ref.token_ids
        assert mi["spec_accept_length"] == 1.0 and mi["spec_accepted_tokens"] == 0
        assert mi["spec_verify_ct"] == mt - 2 and mi["spec_accepted_per_pos"] == [0] * K
    assert llm0.engine.stats.acceptance_length == 1.0
    assert LLM.from_model(model).generate([[1]], SamplingParams(max_tokens=2))[0].meta_info.get(
        "spec_verify_ct") is None


def test_synthetic_acceptance_rate_half() -> None:
    model = tiny_model("llama", seed=9)
    K, rate = 4, 0.5
    llm = make_llm(model, SYN, K, rate=rate)
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(5)] for _ in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60))
    expected = 1 + sum(rate ** i for i in range(1, K + 1))  # 1.9375 before end effects
    s = llm.engine.stats
    assert s.num_drafts > 100
    assert abs(s.acceptance_length - expected) < 0.3, s.acceptance_length
    assert s.accepted_tokens_per_pos[0] / s.num_drafts == pytest.approx(rate, abs=0.12)


def test_engine_stats_equal_request_sums() -> None:
    model = tiny_model("qwen3", seed=12)
    rng = random.Random(12)
    for algo in (NGRAM, SYN):
        llm = make_llm(model, algo, 5, rate=0.6, page_size=4, kv_cache_memory="64KiB")
        eng = llm.engine
        reqs = []
        for i in range(8):
            L = rng.randint(2, 10)
            unit = [rng.randrange(V) for _ in range(2)]
            kw = dict(temperature=0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=i)
            reqs.append(eng.add_request((unit * L)[:L], SamplingParams(max_tokens=rng.randint(5, 30), **kw)))
            eng.step()
        eng.step()
        eng.abort(reqs[0].request_id)
        while eng.has_unfinished():
            eng.step()
        assert eng.stats.num_drafts > 0
        check_stats(eng, reqs)
        assert eng.stats.acceptance_length == pytest.approx(
            1 + sum(r.spec_accepted_tokens for r in reqs) / sum(r.spec_verify_ct for r in reqs))
        assert_no_leak(eng)
