"""Learned drafters (EAGLE-3, MTP, DFlash, DSpark) and their trainer, on tiny targets:

1. the trainer (data → features → train → artifact → evaluation) lowers the loss and writes an
   artifact that round-trips; a drafter for another target or algorithm is refused with a reason;
2. greedy speculative output == plain output for every drafter (fp64 target, joins, K / block sizes);
3. draft-side state follows the target: after every step, the draft K/V the drafter keeps equal
   K/V recomputed from a from-scratch target forward (nothing built from rejected drafts survives);
4. sampled drafts with the drafter's real q reproduce the exact target distribution (sample, block).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.core import SamplingParams
from specserve.drafters.artifact import load_drafter
from specserve.engine.llm import LLM
from specserve.models.llama import LlamaModel
from specserve.train.data import FeatureCapture
from specserve.cost.curve import CostModel
from specserve.cost.gate import DraftGate
from tests.engine_helpers import fixed_curves
from tests.dist import engine_vs_exact_joint
from tests.spec_helpers import drive
from tests.tiny import reference_greedy, save_tiny_hf_dir, tiny_config, tiny_state_dict

from tests.drafter_setup import ALGOS, CFG, _spec_llm, _target  # noqa: F401  (the `trained` fixture: conftest.py)
from tests.drafter_setup import DIST_LEN, DIST_N, DIST_PARAMS, random_drafter_llm


@pytest.mark.parametrize("algo", ALGOS)
def test_trainer_lowers_loss_and_artifact_round_trips(trained: dict, algo: str) -> None:
    log = [json.loads(x) for x in (trained["work"] / f"{algo}-train-log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 40 and log[-1]["loss"] < 0.8 * log[0]["loss"], [r["loss"] for r in log]
    art: Path = trained["artifacts"][algo]
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["algorithm"] == algo and cfg["target"] == "target" and cfg["target_num_layers"] == 4
    ev = cfg["training"]["heldout_eval"]
    # τ counts the bonus: τ = 1 + Σ per-position acceptance, and a trained drafter gets drafts accepted
    # (τ > 1). Fails if the evaluation silently decodes without the drafter (τ = 1, no positions) or
    # records τ and its per-position rates from different runs or formulas.
    assert cfg["training"]["steps"] == 40 and ev["accept_length"] > 1.0
    assert ev["accept_length"] == pytest.approx(1 + sum(ev["per_position"]), abs=0.005)
    assert all(a >= b for a, b in zip(ev["per_position"], ev["per_position"][1:]))
    assert "train-drafter" in cfg["training"]["command"]
    card = (art / "README.md").read_text()
    assert "held-out" in card and "Reproduce" in card
    net = load_drafter(art, _target(), torch.float32)
    saved = load_file(str(art / "model.safetensors"))
    assert set(saved) == set(net.state_dict())  # the target's tensors are not part of the artifact
    for k, v in net.state_dict().items():
        assert torch.equal(v.to(saved[k].dtype), saved[k]), k
    assert not any(k.startswith("target") for k in saved)


def test_mismatched_drafter_is_refused(trained: dict, tmp_path: Path) -> None:
    other = LlamaModel(tiny_config(layers=3, vocab=101), torch.float64)
    other.load_weights(tiny_state_dict(other.cfg, 1))
    with pytest.raises(ValueError, match="vocabulary size: drafter was trained for 97, target has 101"):
        load_drafter(trained["artifacts"]["dspark"], other)
    with pytest.raises(ValueError, match="is a DSPARK drafter, not EAGLE3"):
        LLM.from_model(_target(), speculative_algorithm="EAGLE3",
                       speculative_draft_model_path=str(trained["artifacts"]["dspark"]))
    with pytest.raises(ValueError, match="not a drafter artifact"):
        LLM.from_model(_target(), speculative_algorithm="DSPARK", speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="none ships"):
        LLM.from_model(_target(), speculative_algorithm="DFLASH")
    with pytest.raises(ValueError, match="block size"):
        LLM.from_model(_target(), speculative_algorithm="DSPARK", speculative_block_size=12,
                       speculative_draft_model_path=str(trained["artifacts"]["dspark"]))


@pytest.mark.parametrize("algo,opts", [
    ("eagle3", {}), ("eagle3", {"speculative_num_draft_tokens": 1}), ("eagle3", {"speculative_num_draft_tokens": 7}),
    ("mtp", {}), ("dflash", {}), ("dflash", {"speculative_block_size": 3}),
    ("dspark", {}), ("dspark", {"speculative_num_draft_tokens": 2}), ("dspark", {"page_size": 4}),
])
def test_greedy_equals_plain(trained: dict, algo: str, opts: dict) -> None:
    rng = random.Random(7)
    plan = [(i % 4, [rng.randrange(97) for _ in range(rng.randint(1, 30))], SamplingParams(temperature=0, max_tokens=30))
            for i in range(6)]
    llm = _spec_llm(trained, algo, **opts)
    reqs = drive(llm, plan)
    model = llm.engine.model
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(model, prompt, 30)
    assert sum(r.spec_accepted_tokens for r in reqs) > 0  # the trained drafter does get tokens accepted
    assert llm.engine.drafter.state == {} and llm.engine.drafter.kv.allocator.num_free == llm.engine.drafter.kv.allocator.num_pages


@pytest.mark.parametrize("algo,opts", [(a, {}) for a in ALGOS] + [
    ("eagle3", {"speculative_eagle_topk": 3, "speculative_num_steps": 3}), ("mtp", {"speculative_eagle_topk": 2})])
def test_draft_state_matches_recomputed(trained: dict, algo: str, opts: dict) -> None:
    """After each step, every draft K/V row below `done` equals one recomputed from scratch
    (trees: the rows of the accepted path, whichever branch it took)."""
    llm = _spec_llm(trained, algo, **opts)
    dr, net = llm.engine.drafter, llm.engine.drafter.net
    cap = FeatureCapture(llm.engine.model, net.cfg.aux_layer_ids, 256)
    checked = []

    def check(eng, step: int) -> None:  # noqa: ANN001
        for r in eng.requests.values():
            st = dr.state.get(r.request_id)
            if st is None or st.done < 2:
                continue
            ids = torch.tensor(r.all_ids[: st.done])
            feats = cap(ids).to(dr.dtype)
            with torch.no_grad():
                if net.cfg.is_block:
                    k_exp, _ = net.context_kv(net.context(feats), torch.arange(st.done))[-1]
                else:
                    h = net.fuse(torch.cat([torch.zeros_like(feats[:1]), feats[:-1]]))
                    _, k_exp, _ = net.layer.project(net.inputs(ids, h)[0], *net.rope(torch.arange(st.done)))
            slots = torch.tensor(dr.kv.slots(st.page_table, 0, st.done))
            torch.testing.assert_close(dr.kv.k[-1][slots], k_exp, rtol=1e-9, atol=1e-9)
            checked.append(step)

    rng = random.Random(3)
    plan = [(i, [rng.randrange(97) for _ in range(rng.randint(2, 12))], SamplingParams(temperature=0, max_tokens=24))
            for i in range(3)]
    drive(llm, plan, on_step=check)
    assert len(checked) > 10


@pytest.mark.parametrize("algo,rule,opts", [
    ("eagle3", "sample", {}), ("mtp", "sample", {}), ("dflash", "block", {}), ("dspark", "sample", {}),
    ("dspark", "block", {}),
    ("eagle3", "auto", {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 5}),
    # window policies: ragged windows chosen from draft confidence / acceptance so far / cost curves
    ("dspark", "sample", {"speculative_window": "confidence"}), ("dflash", "block", {"speculative_window": "cost"}),
    ("eagle3", "sample", {"speculative_window": "cost"}),
    ("eagle3", "auto", {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_window": "confidence"}),
])
def test_sampled_drafts_match_target_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algo: str,
                                                  rule: str, opts: dict) -> None:
    """Sampled drafts with the drafter's real q through the whole engine reproduce the exact joint
    (trees: deterministic top-k children walked by sample-and-match; window policies: any prefix)."""
    if opts.get("speculative_window") == "cost":  # a fixed machine-independent curve, and an open gate
        fixed_curves(monkeypatch, CostModel([(1, 1.0), (64, 1.0 + 1e-6)]))  # verify tokens (nearly) free: every
        # draft is worth verifying
        monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    llm = random_drafter_llm(tmp_path, algo, rule, **opts)
    fit = engine_vs_exact_joint(llm, [1, 2], DIST_LEN, DIST_PARAMS, DIST_N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0
    assert llm.engine.drafter.supplies_q


def test_auto_without_a_shipped_drafter_looks_up_the_prompt() -> None:
    """Nothing ships for this target: AUTO is NGRAM's prompt lookup (no corpus table) under `cost` windows."""
    llm = LLM.from_model(_target(), speculative_algorithm="AUTO", kv_cache_memory="512KiB")
    assert llm.config.speculative_algorithm == "NGRAM" and llm.config.speculative_window == "cost"
    assert llm.engine.drafter.table is None
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out[0].token_ids == reference_greedy(llm.engine.model, prompt, 12)


TREE = {"speculative_eagle_topk": 3, "speculative_num_steps": 3}


@pytest.mark.parametrize("algo,policy,opts", [
    ("dspark", "confidence", {}), ("dspark", "cost", {}), ("dflash", "confidence", {}), ("eagle3", "confidence", {}),
    ("eagle3", "confidence", TREE), ("eagle3", "cost", TREE)])
def test_window_policies_stay_lossless_and_never_stall(trained: dict, algo: str, policy: str, opts: dict) -> None:
    """Windows cut after drafting (ragged, sometimes 0) keep greedy equality, and a request whose
    windows were 0 for a while drafts again afterwards (no stale draft state)."""
    rng = random.Random(11)
    plan = [(i % 3, [rng.randrange(97) for _ in range(rng.randint(1, 20))], SamplingParams(temperature=0, max_tokens=40))
            for i in range(5)]
    if policy == "confidence":
        opts = {**opts, "speculative_confidence_threshold": 0.3}
    llm = _spec_llm(trained, algo, speculative_window=policy, **opts)
    dr, stopped = llm.engine.drafter, []
    propose = dr.propose

    def checked(reqs, plan):  # noqa: ANN001, ANN202
        prop = propose(reqs, plan)
        for toks, c, w in zip(prop.tokens, prop.confidence or [None] * len(reqs), plan.windows):
            if toks and not opts:  # chains/blocks stop drafting once the cumulative confidence is too low
                cum = torch.cumprod(c.double(), 0).tolist()
                assert all(x >= dr.stop_below for x in cum[:-1])
                stopped.append(len(toks) < w)
        return prop

    dr.propose = checked
    reqs = drive(llm, plan)
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(llm.engine.model, prompt, 40)
    assert opts or any(stopped)
    counts = llm.engine.stats.window_counts
    assert counts[0] > 0 and sum(counts[1:]) > 0, counts
    if policy == "confidence":  # (the cost policy may rightly find a tiny model's drafts not worth verifying)
        assert sum(r.spec_accepted_tokens for r in reqs) > 0


@pytest.mark.parametrize("algo,opts", [("dspark", {}), ("eagle3", TREE)])
def test_cost_policy_skips_drafting_when_a_drafting_request_costs_too_much(trained: dict, algo: str, opts: dict,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Block drafters and trees plan before drafting: when the calibrated cost of a drafting request
    outweighs any expected gain, nobody drafts (plain decoding); when it is free, they do. (The empirical
    gate is held open: its warm-up would otherwise explore, i.e. draft, on the first steps.)"""
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    rng = random.Random(2)
    plan = [(0, [rng.randrange(97) for _ in range(rng.randint(4, 12))], SamplingParams(temperature=0, max_tokens=12))
            for _ in range(3)]
    for per_request, drafts in ((10.0, False), (0.0, True)):
        llm = _spec_llm(trained, algo, speculative_window="cost", **opts)
        eng = llm.engine
        eng.policy.draft_cost.per_request, eng.policy.draft_cost.decay = {"draft": per_request}, 1.0  # decay 1: keep it
        calls = []
        propose = eng.drafter.propose
        eng.drafter.propose = lambda reqs, plan: calls.append(plan.windows) or propose(reqs, plan)  # noqa: B023
        reqs = drive(llm, plan)
        for (_, prompt, _), r in zip(plan, reqs):
            assert r.output_ids == reference_greedy(eng.model, prompt, 12)
        assert bool(calls) == drafts, calls


@pytest.mark.parametrize("algo", ["EAGLE3", "AUTO", "STANDALONE"])
def test_a_public_eagle3_checkpoint_is_refused_by_name(tmp_path, algo: str) -> None:  # noqa: ANN001
    """A public EAGLE-3 directory (its own config.json + model.safetensors) is not one of our artifacts: every
    path that could take it names what it is and how to make a drafter (it was a bare TypeError)."""
    from safetensors.torch import save_file

    pub = tmp_path / "eagle3"
    pub.mkdir()
    (pub / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 97,
        "draft_vocab_size": 64}))
    save_file({"fc.weight": torch.zeros(32, 96), "d2t": torch.zeros(64, dtype=torch.long)}, str(pub / "model.safetensors"))
    target = save_tiny_hf_dir(CFG, tiny_state_dict(CFG), tmp_path / "t")
    with pytest.raises(ValueError, match="EAGLE-3.*LlamaForCausalLMEagle3|LlamaForCausalLMEagle3.*EAGLE-3"):
        LLM(target, speculative_algorithm=algo, speculative_draft_model_path=str(pub))
