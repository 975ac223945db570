"""Lattice reranking of block drafts (--speculative-lattice-topk, specserve/drafters/lattice.py):

1. the Viterbi DP equals brute-force enumeration of every path (tiny vocabulary, beam = V), and a
   loop-by-loop reference of the pruned beam (top-k children per state, merged per token) for k < V;
2. greedy speculative output == plain output with DFLASH / DSPARK and lattice topk 2 / 4 (and with
   confidence windows); DFlash at any topk and DSpark at topk 1 draft exactly the per-offset argmax;
3. at temperature > 0 the deterministic lattice drafts (verified one-hot) keep the exact target law;
4. the flag is validated and `--speculative-accept block` (which needs q) is refused with it.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from specserve.config import EngineConfig
from specserve.core import SamplingParams
from specserve.drafters.artifact import build_net, save_drafter
from specserve.drafters.lattice import best_paths
from specserve.drafters.nets import DrafterConfig
from specserve.engine.llm import LLM
from tests.dist import engine_vs_exact_joint
from tests.drafter_setup import _spec_llm  # the `trained` fixture (tiny trained drafters): conftest.py
from tests.spec_helpers import drive
from tests.tiny import reference_greedy, save_tiny_hf_dir, tiny_config, tiny_state_dict


def _lattice(n: int, L: int, V: int, markov: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, L, V, generator=g, dtype=torch.float64) * 2
    T = torch.randn(n, V, V, generator=g, dtype=torch.float64) * 2 if markov else None  # T[b, prev] = term
    return base, T


def _trans(T: torch.Tensor | None):  # noqa: ANN202
    if T is None:
        return None
    return lambda s: T[torch.arange(len(T))[:, None], s]  # [N, k] states → [N, k, V]


def _path_score(base: torch.Tensor, T: torch.Tensor | None, b: int, path: list[int]) -> float:
    s = 0.0
    for j, x in enumerate(path):
        row = base[b, j] + (T[b, path[j - 1]] if T is not None and j > 0 else 0)
        s += float(torch.log_softmax(row, dim=-1)[x])
    return s


def _beam_reference(base: torch.Tensor, T: torch.Tensor | None, b: int, k: int, length: int) -> tuple[list[int], float]:
    """The pruned DP as described, with Python loops: top-k children of each state, merged per token
    keeping the best predecessor, top-k tokens survive."""
    lp0 = torch.log_softmax(base[b, 0], dim=-1)
    beam = {int(t): (float(lp0[t]), [int(t)]) for t in lp0.topk(k).indices}
    for j in range(1, length):
        merged: dict[int, tuple[float, list[int]]] = {}
        for s, (sc, path) in beam.items():
            lp = torch.log_softmax(base[b, j] + (T[b, s] if T is not None else 0), dim=-1)
            for t in lp.topk(k).indices.tolist():
                cand = (sc + float(lp[t]), path + [t])
                if t not in merged or cand[0] > merged[t][0]:
                    merged[t] = cand
        beam = dict(sorted(merged.items(), key=lambda kv: -kv[1][0])[:k])
    score, path = max(beam.values(), key=lambda v: v[0])
    return path, score


@pytest.mark.parametrize("markov", [True, False])
def test_dp_equals_brute_force(markov: bool) -> None:
    n, L, V = 6, 4, 5
    for seed in range(5):
        base, T = _lattice(n, L, V, markov, seed)
        lengths = torch.tensor([L, L, 3, 2, 1, L])
        paths, scores = best_paths(base, _trans(T), V, lengths)  # beam = V: exact Viterbi
        for b in range(n):
            w = int(lengths[b])
            best = max(itertools.product(range(V), repeat=w), key=lambda p: _path_score(base, T, b, list(p)))
            assert paths[b, :w].tolist() == list(best), (seed, b)
            assert scores[b].item() == pytest.approx(_path_score(base, T, b, list(best)), abs=1e-9)
            if not markov:  # no transition: the best path is the per-offset argmax
                assert list(best) == base[b, :w].argmax(-1).tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pruned_dp_equals_beam_reference(k: int) -> None:
    n, L, V = 5, 5, 7
    for seed in range(4):
        base, T = _lattice(n, L, V, True, 100 + seed)
        lengths = torch.tensor([5, 4, 3, 1, 5])
        paths, scores = best_paths(base, _trans(T), k, lengths)
        for b in range(n):
            w = int(lengths[b])
            ref_path, ref_score = _beam_reference(base, T, b, k, w)
            assert paths[b, :w].tolist() == ref_path, (seed, b)
            assert scores[b].item() == pytest.approx(ref_score, abs=1e-9)
            assert scores[b].item() == pytest.approx(_path_score(base, T, b, ref_path), abs=1e-9)


def _recorded_proposals(llm: LLM, plan: list, with_reqs: bool = False):  # noqa: ANN201
    """Drive `plan` through `llm`, recording every proposal its drafter makes."""
    dr, seen = llm.engine.drafter, []
    propose = dr.propose

    def spy(reqs, plan):  # noqa: ANN001, ANN202
        p = propose(reqs, plan)
        seen.append(p)
        return p

    dr.propose = spy
    reqs = drive(llm, plan)
    return (seen, reqs) if with_reqs else seen


@pytest.mark.parametrize("algo,topk", [("dflash", 2), ("dflash", 4), ("dspark", 2), ("dspark", 4)])
def test_greedy_equals_plain_with_lattice(trained: dict, algo: str, topk: int) -> None:
    rng = random.Random(7)
    plan = [(i % 4, [rng.randrange(97) for _ in range(rng.randint(1, 30))], SamplingParams(temperature=0, max_tokens=30))
            for i in range(6)]
    llm = _spec_llm(trained, algo, speculative_lattice_topk=topk)
    assert llm.engine.drafter.lattice_topk == topk and not llm.engine.drafter.supplies_q
    reqs = drive(llm, plan)
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(llm.engine.model, prompt, 30)
    assert sum(r.spec_accepted_tokens for r in reqs) > 0
    assert llm.engine.drafter.state == {} and llm.engine.drafter.kv.allocator.num_free == llm.engine.drafter.kv.allocator.num_pages


def test_lattice_with_confidence_windows_and_short_block(trained: dict) -> None:
    """Ragged windows (block 3, confidence cuts) keep greedy equality; proposals carry no q."""
    rng = random.Random(5)
    plan = [(i % 3, [rng.randrange(97) for _ in range(rng.randint(1, 20))], SamplingParams(temperature=0, max_tokens=25))
            for i in range(4)]
    llm = _spec_llm(trained, "dspark", speculative_lattice_topk=3, speculative_block_size=3,
                    speculative_window="confidence", speculative_confidence_threshold=0.3)
    seen, reqs = _recorded_proposals(llm, plan, with_reqs=True)
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(llm.engine.model, prompt, 25)
    assert any(t for p in seen for t in p.tokens)
    for p in seen:
        assert p.q is None
        for t, c in zip(p.tokens, p.confidence or [None] * len(p.tokens)):
            assert (c is None and not t) or len(c) == len(t)


@pytest.mark.parametrize("algo,topk", [("dflash", 4), ("dspark", 1)])
def test_lattice_reduces_to_offset_by_offset_argmax(trained: dict, algo: str, topk: int) -> None:
    """DFlash (no transition) at any topk, and DSpark with a beam of 1, draft exactly what the
    offset-by-offset argmax drafts at temperature 0 (tokens and confidence)."""
    rng = random.Random(13)
    plan = [(i % 3, [rng.randrange(97) for _ in range(rng.randint(1, 20))], SamplingParams(temperature=0, max_tokens=20))
            for i in range(4)]
    # fixed windows: DSPARK's default confidence window lets offset-by-offset drafting stop early
    ref = _recorded_proposals(_spec_llm(trained, algo, speculative_window="fixed"), plan)
    got = _recorded_proposals(_spec_llm(trained, algo, speculative_lattice_topk=topk, speculative_window="fixed"), plan)
    assert len(ref) == len(got) and any(t for p in got for t in p.tokens)
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        for ca, cb in zip(a.confidence or [None] * len(a.tokens), b.confidence or [None] * len(b.tokens)):
            assert (ca is None) == (cb is None)
            if ca is not None:
                torch.testing.assert_close(ca, cb)


@pytest.mark.parametrize("algo", ["dflash", "dspark"])
def test_lattice_drafts_keep_target_distribution(tmp_path: Path, algo: str) -> None:
    """Deterministic lattice drafts at T > 0 (onehot rule) reproduce the exact joint."""
    V, L, N = 3, 5, 2000
    cfg = tiny_config("llama", vocab=V, layers=2)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    dcfg = DrafterConfig.for_target(algo, cfg, block_size=4, markov_rank=8 if algo == "dspark" else None)
    torch.manual_seed(5)
    net = build_net(dcfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # a random drafter
    save_drafter(net, tmp_path / "d", "", torch.float64)
    llm = LLM(target, dtype="float64", speculative_algorithm=algo.upper(), speculative_draft_model_path=str(tmp_path / "d"),
              speculative_num_draft_tokens=3, speculative_lattice_topk=2, max_running_requests=256)
    assert not llm.engine.drafter.supplies_q
    base = SamplingParams(temperature=6.0, max_tokens=L, top_p=0.95)
    fit = engine_vs_exact_joint(llm, [1, 2], L, base, N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0


def test_flag_is_validated(trained: dict) -> None:
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="--speculative-lattice-topk"):
            EngineConfig(speculative_lattice_topk=bad)
    assert EngineConfig(speculative_lattice_topk=64).speculative_lattice_topk == 64
    with pytest.raises(ValueError, match="--speculative-lattice-topk"):
        _spec_llm(trained, "dspark", speculative_lattice_topk=4, speculative_accept="block")
