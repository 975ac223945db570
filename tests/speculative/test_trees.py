"""EAGLE-2 dynamic trees (--speculative-eagle-topk > 1) for EAGLE-3 and MTP:

1. tree pieces: ancestor masks, depths, KV compaction of the accepted path, and the tree walk,
   which on a chain draws exactly what the chain rule `onehot` draws (same generator, same tokens);
2. proposals are well-formed trees: parents before children, distinct siblings, best-first scores;
3. greedy output == plain output (compact and padded verify, small pages, joins mid-run), and the
   accepted paths really leave the top-1 chain sometimes;
4. bad flag combinations are refused naming the flag.
(Distribution, draft-state and window-policy tests for trees sit with the other drafters' in
tests/drafters/test_drafters.py.)
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.speculative.resolve import check_config
from specserve.core import SamplingParams
from specserve.speculative.rules import accept_onehot, walk_tree
from specserve.speculative.commit import KeepPath, compact_path
from specserve.speculative.tree import ancestor_mask, chain_parents, depths
from tests.drafter_setup import _spec_llm
from tests.spec_helpers import drive
from tests.tiny import reference_greedy, tiny_config


def test_ancestor_mask_and_depths() -> None:
    parents = [-1, -1, 0, 0, 2, 1]  # root → {0, 1}; 0 → {2, 3}; 2 → {4}; 1 → {5}
    assert depths(parents) == [1, 1, 2, 2, 3, 2]
    m = ancestor_mask(parents)
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}, 6: {0, 2, 6}}
    for row, cols in expect.items():
        assert set(torch.nonzero(m[row]).flatten().tolist()) == cols, row
    assert torch.equal(ancestor_mask(chain_parents(4)), torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_compact_path_moves_accepted_rows_after_the_root() -> None:
    kv = KVPool(tiny_config(layers=2), 4, 4, torch.float64)
    pt: list[int] = []
    kv.ensure(pt, 12)
    pt.reverse()  # non-contiguous pages
    for cache in kv.k + kv.v:
        for pos in range(12):
            cache[kv.slots(pt, pos, pos + 1)[0]] = pos
    compact_path(kv, pt, root_pos=3, path=[1, 4, 6])  # nodes at positions 5, 8, 10 → 4, 5, 6
    for cache in kv.k + kv.v:
        got = [int(cache[kv.slots(pt, p, p + 1)[0]].flatten()[0]) for p in range(8)]
        assert got == [0, 1, 2, 3, 5, 8, 10, 7]


def test_walk_tree_on_a_chain_draws_what_onehot_draws() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        k, V = 3, 5
        p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 2, dim=-1)
        draft = torch.randint(V, (k,), generator=g).tolist()
        a = accept_onehot(p, draft, torch.Generator().manual_seed(trial))
        path, y = walk_tree(lambda row, hist: p[row], draft, chain_parents(k), False, torch.Generator().manual_seed(trial))
        assert (len(path), y) == a and path == list(range(len(path)))


def test_walk_tree_greedy_follows_the_matching_branch() -> None:
    V = 6
    rows = torch.full((5, V), -5.0, dtype=torch.float64)
    argmax = [2, 3, 4, 5, 1]  # target argmax at the root, node 0, node 1, node 2, node 3
    for r, a in enumerate(argmax):
        rows[r, a] = 5.0
    tokens, parents = [1, 2, 4, 0], [-1, -1, 1, 1]  # root → {1, 2}; node 1 (token 2) → {4, 0}
    path, y = walk_tree(lambda row, hist: rows[row], tokens, parents, True, None)
    assert path == [1, 2] and y == argmax[3]  # root→2 (node 1), →4 (node 2), then the correction


TREES = [{"speculative_eagle_topk": 3, "speculative_num_steps": 4},
         {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 5, "page_size": 4},
         {"speculative_eagle_topk": 4, "speculative_num_steps": 2, "speculative_num_draft_tokens": 12}]


@pytest.mark.parametrize("algo,opts,mode", [("eagle3", TREES[0], "compact"), ("eagle3", TREES[1], "padded"),
                                            ("eagle3", TREES[2], "compact"), ("mtp", TREES[0], "compact")])
def test_tree_greedy_equals_plain(trained: dict, algo: str, opts: dict, mode: str) -> None:
    rng = random.Random(7)
    plan = [(i % 4, [rng.randrange(97) for _ in range(rng.randint(1, 30))], SamplingParams(temperature=0, max_tokens=30))
            for i in range(6)]
    llm = _spec_llm(trained, algo, speculative_verify_packing=mode, **opts)
    eng = llm.engine
    seen: dict[str, int] = {"trees": 0, "off_chain": 0}
    keep = next(s for s in eng.commit_stage.steps if isinstance(s, KeepPath))
    propose, keep_path = eng.drafter.propose, keep.apply

    def checked_propose(reqs, plan):  # noqa: ANN001, ANN202
        prop = propose(reqs, plan)
        for toks, par, conf, w in zip(prop.tokens, prop.parents or [None] * len(reqs), prop.confidence or [None] * len(reqs),
                                      plan.windows):
            if not toks:
                continue
            assert par is not None and len(par) == len(toks) <= w
            assert all(-1 <= p < i for i, p in enumerate(par))  # topological
            kids: dict[int, list[int]] = {}
            for i, p in enumerate(par):
                kids.setdefault(p, []).append(toks[i])
            assert all(len(v) == len(set(v)) for v in kids.values())  # distinct siblings
            score = []
            for i, c in enumerate(conf.tolist()):
                score.append(c * (score[par[i]] if par[i] >= 0 else 1.0))
            assert all(a >= b - 1e-12 for a, b in zip(score, score[1:]))  # best-first
            seen["trees"] += 1
        return prop

    def counting_keep(items):  # noqa: ANN001, ANN202
        for c in items:
            if c.result.path and c.result.path != list(range(len(c.result.path))):
                seen["off_chain"] += 1
        return keep_path(items)

    eng.drafter.propose, keep.apply = checked_propose, counting_keep
    reqs = drive(llm, plan)
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(eng.model, prompt, 30)
    assert seen["trees"] > 10 and seen["off_chain"] > 0, seen
    assert sum(r.spec_accepted_tokens for r in reqs) > 0
    assert eng.drafter.state == {} and eng.drafter.kv.allocator.num_free == eng.drafter.kv.allocator.num_pages


@pytest.mark.parametrize("opts,msg", [
    ({"speculative_algorithm": "DSPARK", "speculative_eagle_topk": 2},
     "--speculative-eagle-topk does not apply to --speculative-algorithm DSPARK"),
    ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 2, "speculative_accept": "block"}, "--speculative-accept block"),
    ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 2, "speculative_num_steps": 2,
      "speculative_num_draft_tokens": 7}, r"--speculative-num-draft-tokens must be in \[1, 6\]"),
    ({"speculative_eagle_topk": 0}, "--speculative-eagle-topk"),
    ({"speculative_num_steps": 0}, "--speculative-num-steps"),
])
def test_bad_tree_flags_are_refused(opts: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        check_config(EngineConfig(**opts))
