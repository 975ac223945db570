"""Speculative settings have one source (speculative/resolve.py:spec_settings): K's default per drafter shape, the
block size in both spellings (ours counts the anchor, SGLang's --speculative-dspark-block-size does not), and
a clear error where HYBRID's learned drafter has no block to shape."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import EngineConfig
from specserve.speculative.resolve import check_config
from specserve.drafters.artifact import build_net, save_drafter
from specserve.drafters.nets import DrafterConfig
from specserve.engine.llm import LLM
from specserve.speculative.resolve import spec_settings
from tests.drafter_setup import CFG, _target


def _artifact(tmp: Path, algo: str, block: int | None = None) -> Path:
    torch.manual_seed(0)
    net = build_net(DrafterConfig.for_target(algo, CFG, block_size=block))
    save_drafter(net, tmp / algo, "", torch.float64)
    return tmp / algo


@pytest.mark.parametrize("opts,trained_block,k,steps,topk,block", [
    (dict(speculative_algorithm="NGRAM"), None, 4, 0, 1, None),
    (dict(speculative_algorithm="EAGLE3"), None, 4, 0, 1, None),
    (dict(speculative_algorithm="EAGLE3", speculative_num_steps=3), None, 3, 3, 1, None),
    (dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=2), None, 8, 4, 2, None),
    (dict(speculative_algorithm="DSPARK"), 8, 7, 0, 1, 8),
    (dict(speculative_algorithm="DSPARK", speculative_block_size=5), 8, 4, 0, 1, 5),
    (dict(speculative_algorithm="DSPARK", speculative_dspark_block_size=5), 8, 5, 0, 1, 6),
    (dict(speculative_algorithm="DFLASH", speculative_num_draft_tokens=2), 8, 2, 0, 1, 8),
])
def test_settings_defaults(opts: dict, trained_block: int | None, k: int, steps: int, topk: int,
                           block: int | None) -> None:
    trained = None if trained_block is None else DrafterConfig.for_target("dspark", CFG, block_size=trained_block)
    s = spec_settings(EngineConfig(**opts), trained)
    assert (s.num_draft_tokens, s.num_steps, s.topk, s.block_size) == (k, steps, topk, block)


def test_sglang_block_size_spelling_counts_drafts(tmp_path: Path) -> None:
    """SGLang's --speculative-dspark-block-size N drafts N tokens per block: our block of N + 1 rows."""
    art = str(_artifact(tmp_path, "dspark", 4))

    def llm(**kw) -> LLM:  # noqa: ANN003
        return LLM.from_model(_target(), speculative_algorithm="DSPARK", speculative_draft_model_path=art,
                              kv_cache_memory="512KiB", **kw)

    ours, sglang = llm(speculative_block_size=3).engine, llm(speculative_dspark_block_size=2).engine
    assert ours.num_draft_tokens == sglang.num_draft_tokens == 2
    assert ours.drafter.net.cfg.block_size == sglang.drafter.net.cfg.block_size == 3
    with pytest.raises(ValueError, match="--speculative-dspark-block-size 4: .* trained with block size 4 .* in \\[1, 3\\]"):
        llm(speculative_dspark_block_size=4)
    with pytest.raises(ValueError, match="--speculative-block-size 5: .* trained with block size 4 .* in \\[2, 4\\]"):
        llm(speculative_block_size=5)
    with pytest.raises(ValueError, match="give one of them"):
        check_config(EngineConfig(speculative_algorithm="DSPARK", speculative_block_size=3, speculative_dspark_block_size=2))
    with pytest.raises(ValueError, match="--speculative-dspark-block-size does not apply to --speculative-algorithm NGRAM"):
        check_config(EngineConfig(speculative_algorithm="NGRAM", speculative_dspark_block_size=2))


@pytest.mark.parametrize("flag", ["speculative_block_size", "speculative_lattice_topk"])
def test_hybrid_over_a_chain_drafter_refuses_block_flags_by_name(tmp_path: Path, flag: str) -> None:
    """HYBRID takes block flags for its usual DSpark; over an EAGLE-3 artifact they used to fail with
    "use a value in [2, 0]" (or be ignored): now an error names the flag and the artifact's kind."""
    art = str(_artifact(tmp_path, "eagle3"))
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} applies to block drafters .* EAGLE3 drafter"):
        LLM.from_model(_target(), speculative_algorithm="HYBRID", speculative_draft_model_path=art,
                       kv_cache_memory="512KiB", **{flag: 3})
    llm = LLM.from_model(_target(), speculative_algorithm="HYBRID", speculative_draft_model_path=art,
                         kv_cache_memory="512KiB")
    assert llm.engine.num_draft_tokens == 4 and llm.engine.drafter.label == "HYBRID(NGRAM+EAGLE3)"
