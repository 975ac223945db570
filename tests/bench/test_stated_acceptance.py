"""`bench real --synthetic-acceptance`: drafts become plain decoding's tokens at the stated rate, so acceptance is
what was stated (all at 1, none at 0, in between at 0.5) while the text stays plain decoding's."""
from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.real import stated_acceptance
from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [20, 21, 22, 23, 24, 25]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_drafts_are_accepted_at_the_stated_rate(tmp_path: Path, rate: float) -> None:
    cfg, dcfg = tiny_config("llama"), tiny_config("llama", layers=1)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=1), tmp_path / "t")
    draft = save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=2), tmp_path / "d")  # its own drafts: mostly wrong
    plain = [o.outputs[0].token_ids for o in LLM(target).generate(PROMPTS, GREEDY)]
    llm = LLM(target, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=4, speculative_window="fixed")
    stated_acceptance(llm.engine, {tuple(p): o for p, o in zip(PROMPTS, plain)}, rate)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    s = llm.engine.stats
    share = s.num_accepted_tokens / s.num_draft_tokens
    # a chain of 4 is kept up to its first miss: at 0.5, (0.5 + 0.25 + 0.125 + 0.0625) / 4 ≈ 0.23 of the drafts
    assert {0.0: share == 0, 0.5: 0.1 < share < 0.45, 1.0: share > 0.9}[rate], share
