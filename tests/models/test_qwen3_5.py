"""Qwen3.5 hybrid targets (Gated DeltaNet + gated attention): specserve's greedy output equals transformers
`generate` on tiny random models of several layer patterns in fp32 and fp64 (continuous batching, chunked
prefill, loaded from an HF directory), tree verify rows carry the state of their own root path, and the
state pool / scheduler / budget keep their contracts.
"""
from __future__ import annotations

import json

import pytest
import torch

from specserve.cache.kv_pool import KVPool
from specserve.cache.state_pool import OutOfStateSlots, StatePool
from specserve.core import Proposal, Request, SamplingParams
from specserve.engine.llm import LLM
from specserve.runtime.runner import ModelRunner
from specserve.engine.scheduler import Scheduler
from specserve.models.config import ModelConfig
from specserve.speculative.verify import verify
from tests.hybrid_setup import PATTERNS, hf_greedy, hf_model, save_hybrid_dir, scratch_states, spec_config, tiny_hybrid

PROMPTS = [[1, 5, 7, 9, 11, 13], [3], [8, 8, 8, 2, 8, 8, 8, 2, 8, 8, 8, 2, 8, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_equals_transformers(pattern: str, dtype: str, tmp_path) -> None:  # noqa: ANN001
    path = save_hybrid_dir(tmp_path / "m", pattern)
    llm = LLM(path, dtype=dtype, kv_cache_memory="1MiB", max_prefill_tokens=5, page_size=4)  # chunked prefill
    assert llm.engine.states is not None and llm.engine.model.cfg.layer_types == PATTERNS[pattern]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(pattern, 0, p, 20, getattr(torch, dtype)), (pattern, p)


def test_logits_match_transformers_fp64() -> None:
    ids = list(range(1, 30, 2))
    m = tiny_hybrid("LLLF")
    kv = KVPool(m.cfg, 2, 16, torch.float64)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    ours = ModelRunner(m, kv).forward([pt], [0], [ids], [list(range(len(ids)))])[0][0]
    with torch.no_grad():
        ref = hf_model("LLLF")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)  # the reference runs its recurrence in fp32


def test_config_from_hf_and_errors(tmp_path) -> None:  # noqa: ANN001
    cfg = spec_config("FLL")
    assert cfg.architecture == "qwen3_5" and cfg.is_hybrid
    assert cfg.attention_layers == (0,) and cfg.recurrent_layers == (1, 2) and cfg.partial_rotary_factor == 0.25
    assert cfg.kv_bytes_per_token == 1 * 2 * 2 * 8  # only the attention layer keeps K/V
    raw = hf_model("FLL").config.to_dict()
    # the multimodal checkpoint nests the language model's config
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": raw}
    assert ModelConfig.from_hf_dict(nested).layer_types == cfg.layer_types
    for bad, msg in ((["linear_attention"] * 3, "at least one full_attention"), (["full_attention", "mamba", "x"], "layer_types")):
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_hf_dict({**raw, "layer_types": bad})
    path = save_hybrid_dir(tmp_path / "m", "FLL")
    with pytest.raises(ValueError, match="--quantization"):
        LLM(path, quantization="int4")
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        LLM(path, kv_cache_memory="4KiB", max_running_requests=64)
    cfg_file = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg_file["architectures"] == ["Qwen3_5ForCausalLM"]


def test_tree_verify_rows_follow_their_root_path() -> None:
    """Each verify row of a tree carries the state after its own root path (not after the rows
    packed before it), and its logits are those of that path."""
    m = tiny_hybrid("LFLF")
    prompt = [4, 9, 2, 33, 7]
    kv, pool = KVPool(m.cfg, 8, 4, torch.float64), StatePool(m.cfg, 2, torch.float64)
    runner = ModelRunner(m, kv, pool)
    reqs = []
    for i in range(2):  # two requests in one forward: a tree beside a chain
        r = Request(f"r{i}", prompt[: 4 + i], SamplingParams(temperature=0))
        r.state_slot = pool.alloc()
        kv.ensure(r.page_table, 16)
        sb = pool.batch([r.state_slot])
        runner.forward([r.page_table], [0], [r.prompt_ids[:-1]], [[]], states=sb)
        pool.write(r.state_slot, sb.split([len(r.prompt_ids) - 1])[0], 0)
        r.committed_len = len(r.prompt_ids) - 1
        r.output_ids = [r.prompt_ids[-1]]  # the last token: row 0 of the window
        r.prompt_ids = r.prompt_ids[:-1]
        reqs.append(r)
    tree = [50, 51, 60, 52, 61]
    parents = [-1, 0, -1, 1, 2]  # 50 ← root, 51 ← 50, 60 ← root, 52 ← 51, 61 ← 60
    prop = Proposal(tokens=[tree, [70, 71]], parents=[parents, None])
    logits, _, states = verify(runner, reqs, prop)
    base = reqs[0].all_ids
    for node, tok in enumerate(tree):
        path, p = [], node
        while p >= 0:
            path.append(tree[p])
            p = parents[p]
        ids = base + path[::-1]
        ref = scratch_states(m, ids)
        for got, want in zip(states[0].conv + states[0].rec, ref.conv + ref.rec):
            torch.testing.assert_close(got[node + 1], want[0], rtol=0, atol=1e-12)
        full = ModelRunner(m, KVPool(m.cfg, 4, 16, torch.float64)).forward([[0, 1]], [0], [ids], [[len(ids) - 1]])[0][0]
        torch.testing.assert_close(logits[0][node + 1], full[0], rtol=0, atol=1e-10)
    chain = reqs[1].all_ids + [70, 71]
    ref = scratch_states(m, chain)
    torch.testing.assert_close(states[1].rec[0][2], ref.rec[0][0], rtol=0, atol=1e-12)
    assert pool.num_free == 0 and all(c.abs().sum() > 0 for c in pool.rec)  # verify wrote no slot beyond prefill


def test_state_pool_zeroes_and_scheduler_needs_a_slot() -> None:
    cfg = spec_config("LFLF")
    pool = StatePool(cfg, 1, torch.float64)
    s = pool.alloc()
    pool.rec[0][s].fill_(float("nan"))
    with pytest.raises(OutOfStateSlots):
        pool.alloc()
    pool.free(s)
    s2 = pool.alloc()
    assert s2 == s and not torch.isnan(pool.rec[0][s2]).any() and pool.rec[0][s2].abs().sum() == 0
    pool.free(s2)
    kv = KVPool(cfg, 64, 4, torch.float64)
    sched = Scheduler(kv, 64, max_running_requests=4, lookahead=lambda r: 0, states=pool)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [r for r, _ in batch.prefills] == [reqs[0]] and reqs[0].state_slot == s  # one slot: one admitted
    sched.finish(reqs[0])
    assert reqs[0].state_slot is None and pool.num_free == 1
    batch = sched.schedule()
    assert [r for r, _ in batch.prefills] == [reqs[1]]
    assert sched.abort("r1") is reqs[1] and pool.num_free == 1
