"""Windowed draft attention (--speculative-draft-attention-window W) for the learned drafters:
the drafter reads only the last W committed positions, so draft K/V behind the window may hold
anything (here: NaN) without changing a single proposal, pages behind it are freed, and greedy
output still equals plain decoding."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.config import EngineConfig
from specserve.speculative.resolve import check_config
from specserve.core import SamplingParams
from tests.drafter_setup import _spec_llm
from tests.spec_helpers import drive
from tests.tiny import reference_greedy


@pytest.mark.parametrize("algo,opts", [("eagle3", {}), ("mtp", {}), ("dflash", {}), ("dspark", {}),
                                       ("eagle3", {"speculative_eagle_topk": 3, "speculative_num_steps": 3})])
def test_draft_window_reads_only_the_window(trained: dict, algo: str, opts: dict) -> None:
    W = 6
    llm = _spec_llm(trained, algo, speculative_draft_attention_window=W, page_size=4, **opts)
    dr = llm.engine.drafter
    seen = {"poisoned": 0, "freed": 0}

    def poison(eng, step: int) -> None:  # noqa: ANN001
        for st in dr.state.values():
            seen["freed"] += sum(1 for p in st.page_table if p < 0)
            behind = [p for p in range(max(0, st.done - W)) if st.page_table[p // dr.kv.page_size] >= 0]
            if behind:
                slots = torch.tensor(dr.kv.slots(st.page_table, behind[0], behind[-1] + 1))
                for cache in dr.kv.k + dr.kv.v:
                    cache[slots] = float("nan")
                seen["poisoned"] += 1

    rng = random.Random(5)
    plan = [(i % 3, [rng.randrange(97) for _ in range(rng.randint(8, 30))], SamplingParams(temperature=0, max_tokens=40))
            for i in range(5)]
    reqs = drive(llm, plan, on_step=poison)
    for (_, prompt, _), r in zip(plan, reqs):
        assert r.output_ids == reference_greedy(llm.engine.model, prompt, 40)
    assert seen["poisoned"] > 0 and seen["freed"] > 0, seen
    assert dr.state == {} and dr.kv.allocator.num_free == dr.kv.allocator.num_pages
    # the same run without poison drafts exactly the same: nothing behind the window was read
    clean = drive(_spec_llm(trained, algo, speculative_draft_attention_window=W, page_size=4, **opts), plan)
    assert [r.spec_accepted_per_pos for r in reqs] == [r.spec_accepted_per_pos for r in clean]
    assert sum(r.spec_accepted_tokens for r in reqs) > 0


def test_draft_window_flag_is_validated() -> None:
    with pytest.raises(ValueError, match="--speculative-draft-attention-window must be >= 1"):
        check_config(EngineConfig(speculative_algorithm="DSPARK", speculative_draft_attention_window=0))
    with pytest.raises(ValueError, match="--speculative-draft-attention-window does not apply to --speculative-algorithm NGRAM"):
        check_config(EngineConfig(speculative_algorithm="NGRAM", speculative_draft_attention_window=64))
