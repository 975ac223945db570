"""Speculation on hybrid (recurrent) targets: greedy output equals plain decoding token for token in fp64
for NGRAM, SYNTHETIC (a hybrid draft model with its own state slots) and a test drafter that forces the
accepted prefix to every length with ragged windows, K 1…7, joins mid-run, preemption, both verify
packings; after every step each running request's state slot equals a from-scratch recompute over its
committed tokens; a NaN in one request's recurrent state fails that request alone.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from specserve.core import DraftPlan, Proposal, Request, SamplingParams
from specserve.drafters import base as drafter_base
from specserve.drafters.base import Capabilities, Drafter, DrafterEntry
from tests.hybrid_setup import scratch_states, tiny_hybrid
from tests.poison_helpers import HiddenPoison
from tests.spec_helpers import NGRAM, SYN, V, assert_no_leak, check_stats, drive, make_llm, rand_plan
from tests.spec_helpers import verify_mode  # noqa: F401, F811  (fixture)

PREFIX = "PREFIX_TEST"


class PrefixDrafter(Drafter):
    """Drafts the plain run's own continuation with one wrong token at offset m (none when m = w): the
    turn counter walks every (window w ∈ 1…K, accepted m ∈ 0…w) pair, and neighbours in a batch get
    different windows (ragged). `forced` records the accepted lengths it forced. tree=True: the same chain
    hangs off the root beside a wrong first sibling (node 0), so the accepted path is nodes 1, 2, … and the
    commit must move the path's K/V and pick the state of a row that is not the m-th."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], K: int, tree: bool = False) -> None:
        self.answers, self.K, self.tree = answers, K, tree
        self.turn = itertools.count()
        self.forced: set[int] = set()

    def propose(self, reqs: list[Request], plan: DraftPlan) -> Proposal:
        out, parents = [], []
        for r, w in zip(reqs, plan.windows):
            t = next(self.turn)
            w = min(w, 1 + t % self.K)
            side = self.tree and w >= 2  # one node goes to the wrong sibling
            m = (t // self.K) % (w - side + 1)
            truth = self.answers[tuple(r.prompt_ids)][len(r.output_ids):][: w - side]
            d = list(truth)
            if m < len(d):
                d[m] = (d[m] + 1) % V
            self.forced.add(min(m, len(d)))
            if side and truth:
                out.append([(truth[0] + 2) % V] + d)
                parents.append([-1] + [i - 1 for i in range(len(d))])
            else:
                out.append(d)
                parents.append(list(range(-1, len(d) - 1)))
        return Proposal(tokens=out, parents=parents if self.tree else None)


def _prefix_llm(model, answers: dict, K: int, monkeypatch, tree: bool = False, **opts):  # noqa: ANN001, ANN202
    entry = DrafterEntry(PREFIX, lambda ctx: PrefixDrafter(answers, K, tree), Capabilities())
    monkeypatch.setitem(drafter_base.registry(), PREFIX, entry)
    return make_llm(model, PREFIX, K, **opts)


def _check_states(eng, step: int) -> None:  # noqa: ANN001
    """The commit oracle: every decoding request's slot holds the state after its committed tokens."""
    for r in eng.scheduler.running:
        if r.committed_len and not r.in_prefill:
            want = scratch_states(eng.model, r.all_ids[: r.committed_len])
            got = eng.states.read(r.state_slot)
            for g, w in zip(got.conv + got.rec, want.conv + want.rec):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-11, msg=f"{r.request_id} step {step}")


def _plain(model, plan, **opts):  # noqa: ANN001, ANN202
    reqs = drive(make_llm(model, **opts), plan)
    return reqs, {tuple(p): r.output_ids for (_, p, _), r in zip(plan, reqs)}


@pytest.mark.parametrize("pattern,seed,tree", [("LFLF", 0, False), ("LLLF", 1, False), ("FLL", 2, False),
                                               ("LFLF", 3, True)])
def test_spec_equals_plain_every_prefix_length(pattern: str, seed: int, tree: bool, verify_mode: str,
                                               monkeypatch) -> None:  # noqa: ANN001
    model = tiny_hybrid(pattern, seed)
    plan = rand_plan(random.Random(seed), 6, max_join=5)
    plan = [(j, p, SamplingParams(temperature=0, max_tokens=sp.max_tokens + 30)) for j, p, sp in plan]
    plain, answers = _plain(model, plan, page_size=4, max_prefill_tokens=9)
    for K in ((2, 7) if tree else (1, 3, 7)):
        llm = _prefix_llm(model, answers, K, monkeypatch, tree, page_size=4, max_prefill_tokens=9)
        spec = drive(llm, plan, on_step=_check_states)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain], K
        assert llm.engine.drafter.forced == set(range(K + 1 - tree))  # every accepted length, the full chain too
        check_stats(llm.engine, spec)
        assert_no_leak(llm.engine)
        assert llm.engine.states.num_free == llm.engine.states.num_slots


@pytest.mark.parametrize("algo,K", [(SYN, 2), (SYN, 5), (NGRAM, 4), (NGRAM, 7)])
def test_spec_equals_plain_synthetic_ngram(algo: str, K: int, verify_mode: str) -> None:
    model = tiny_hybrid("LFLF", 3)
    plan = rand_plan(random.Random(K), 6)
    plan = [(j, p, SamplingParams(temperature=0, max_tokens=sp.max_tokens)) for j, p, sp in plan]
    plain, _ = _plain(model, plan, page_size=4)
    llm = make_llm(model, algo, K, rate=0.7, page_size=4, max_prefill_tokens=7)
    spec = drive(llm, plan, on_step=_check_states)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert llm.engine.stats.num_accepted_tokens > 0
    check_stats(llm.engine, spec)
    assert_no_leak(llm.engine)
    if algo == SYN:  # the hybrid draft model's own state slots came back too
        assert llm.engine.drafter.runner.states.num_free == llm.engine.drafter.runner.states.num_slots


@pytest.mark.parametrize("algo", [SYN, NGRAM])
def test_spec_equals_plain_under_preemption(algo: str) -> None:
    model = tiny_hybrid("LFLF", 4)
    rng = random.Random(7)
    plan = [(rng.randint(0, 4), [rng.randrange(V) for _ in range(rng.randint(2, 9))],
             SamplingParams(temperature=0, max_tokens=rng.randint(10, 24))) for _ in range(6)]
    plain, _ = _plain(model, plan, page_size=4)
    # 3 state slots, then ~53 tokens of target KV for 3 requests of up to 33 (SYNTHETIC: its own slots and KV too)
    mem = "96KiB" if algo == SYN else "48KiB"
    llm = make_llm(model, algo, 4, rate=0.9, kv_cache_memory=mem, page_size=4, max_prefill_tokens=8,
                   max_running_requests=3)
    spec = drive(llm, plan, on_step=_check_states)
    assert sum(r.num_preemptions for r in spec) > 0
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert_no_leak(llm.engine)
    assert llm.engine.states.num_free == llm.engine.states.num_slots


@pytest.mark.parametrize("algo", [NGRAM, None])
def test_nan_in_recurrent_state_fails_only_that_request(algo: str | None) -> None:
    """NaN rows out of a recurrent layer poison that request's conv window and delta-rule state; the
    request fails naming NaN, its neighbours (and a later request given its zeroed slot) are unchanged."""
    model = tiny_hybrid("LFLF", 5)
    rng = random.Random(5)
    plan = [(i % 3, [rng.randrange(V) for _ in range(rng.randint(3, 10))], SamplingParams(temperature=0, max_tokens=16))
            for i in range(4)]
    plan.append((12, [9, 8, 7, 6], SamplingParams(temperature=0, max_tokens=16)))  # joins after the failure
    plain, _ = _plain(model, plan, page_size=4, max_running_requests=4)
    llm = make_llm(model, algo, 4, page_size=4, max_running_requests=4)
    eng = llm.engine
    poison = HiddenPoison(eng, 0, float("nan"))  # layer 0 is recurrent

    def arm(eng, step: int) -> None:  # noqa: ANN001
        if step == 3 and "p1" in eng.requests:
            poison(eng, eng.requests["p1"])

    spec = drive(llm, plan, on_step=arm)
    assert poison.hits
    for a, b in zip(plain, spec):
        if b.request_id == "p1":
            assert b.finish_reason == "error" and "NaN" in b.error
        else:
            assert b.output_ids == a.output_ids and b.error is None, b.request_id
    assert_no_leak(eng)


@pytest.fixture(scope="module")
def hybrid_drafters(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DSPARK and EAGLE3 trained briefly (features from the hybrid target's own prefill) on its own answers."""
    import json

    from specserve.cli import build_parser
    from specserve.engine.llm import LLM
    from specserve.train.trainer import run as train
    from tests.hybrid_setup import save_hybrid_dir

    tmp = tmp_path_factory.mktemp("hybrid_drafters")
    target = save_hybrid_dir(tmp / "target", "LFLF", 0)
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 10))] for _ in range(24)]
    outs = LLM(target, dtype="float64").generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    work = tmp / "work"
    work.mkdir()
    (work / "responses.jsonl").write_text("".join(
        json.dumps({"index": i, "prompt_ids": p, "response_ids": o.outputs[0].token_ids}) + "\n"
        for i, (p, o) in enumerate(zip(prompts, outs))))
    for algo in ("dspark", "eagle3"):
        train(build_parser().parse_args([
            "train-drafter", "--data", "regen", "--target", target, "--algorithm", algo, "--out", str(tmp / algo),
            "--work-dir", str(work), "--num-prompts", "24", "--steps", "10", "--batch-tokens", "256", "--lr", "3e-3",
            "--eval-prompts", "2", "--eval-tokens", "12", "--draft-vocab-size", "64", "--checkpoint-every", "20"]))
    return {"target": target, "dir": tmp}


@pytest.mark.parametrize("algo,opts", [("DSPARK", {}), ("EAGLE3", {}),
                                       ("EAGLE3", dict(speculative_eagle_topk=2, speculative_num_steps=3,
                                                       speculative_num_draft_tokens=6))])
def test_learned_drafters_on_hybrid_target(hybrid_drafters: dict, algo: str, opts: dict) -> None:
    """Learned drafters keep their own (attention) draft KV, which follows the commit by truncation; the
    target's recurrent state follows it through CommitState (EAGLE-2 trees included)."""
    from specserve.engine.llm import LLM

    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(hybrid_drafters["target"], dtype="float64").generate(prompts, sp)
    llm = LLM(hybrid_drafters["target"], dtype="float64", speculative_algorithm=algo,
              speculative_draft_model_path=str(hybrid_drafters["dir"] / algo.lower()), **opts)
    spec = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats.num_drafts > 0
    assert llm.engine.states.num_free == llm.engine.states.num_slots
