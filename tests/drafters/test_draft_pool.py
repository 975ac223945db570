"""The draft KV pool is sized from the draft's own geometry and dtype, out of the shared budget:
both pools hold the same number of tokens, and the bytes add up to --kv-cache-memory."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.drafters import base, standalone
from specserve.cache.budget import KVBudget
from specserve.engine.llm import LLM
from specserve.models import LlamaModel
from tests.tiny import tiny_config, tiny_model, tiny_state_dict


def test_budget_split_is_proportional_to_bytes_per_token() -> None:
    t = tiny_config(layers=2, num_kv_heads=2, head_dim=8)  # 2·2·2·8 = 64 values/token → 512 B in float64
    d = tiny_config(layers=3, num_heads=2, num_kv_heads=1, head_dim=16)  # 3·2·1·16 = 96 values → 384 B in float32
    b = KVBudget(70_000, t, torch.float64, page_size=4)
    pages = b.reserve(d, torch.float32)
    draft_bytes = 70_000 * 384 // (512 + 384)
    assert pages == draft_bytes // (384 * 4) and b.remaining == 70_000 - draft_bytes


def test_draft_pool_uses_the_draft_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_model(vocab=97, seed=1)  # float64, 2 layers, 2 KV heads of 8
    dcfg = tiny_config(vocab=97, layers=3, num_heads=2, num_kv_heads=1, head_dim=16, name="draft")
    draft = LlamaModel(dcfg, torch.float32)
    draft.load_weights({k: v.float() for k, v in tiny_state_dict(dcfg, seed=2).items()})
    entry = base.registry()["STANDALONE"]
    monkeypatch.setitem(base._REGISTRY, "STANDALONE", dataclasses.replace(
        entry, factory=lambda ctx: standalone.StandaloneDrafter(standalone.build_draft_runner(ctx, draft))))
    budget, ps = 256 * 1024, 4
    llm = LLM.from_model(target, speculative_algorithm="STANDALONE", speculative_draft_model_path="(in memory)",
                         kv_cache_memory=f"{budget}B", page_size=ps, speculative_num_draft_tokens=3)
    eng = llm.engine
    dkv, tkv = eng.drafter.kv, eng.kv
    t_tok, d_tok = 2 * 2 * 2 * 8 * 8, 3 * 2 * 1 * 16 * 4  # bytes per token: layers·(k,v)·heads·dim·dtype
    d_bytes = budget * d_tok // (t_tok + d_tok)
    assert len(dkv.k) == 3 and dkv.k[0].dtype == torch.float32 and dkv.k[0].shape[1:] == (1, 16)
    assert len(tkv.k) == 2 and tkv.k[0].dtype == torch.float64 and tkv.k[0].shape[1:] == (2, 8)
    assert dkv.allocator.num_pages == d_bytes // (d_tok * ps)
    assert tkv.allocator.num_pages == (budget - d_bytes) // (t_tok * ps)
    used = sum(x.numel() * x.element_size() for x in dkv.k + dkv.v + tkv.k + tkv.v)
    assert budget - (d_tok + t_tok) * ps < used <= budget  # within one page pair of the budget
    assert abs(dkv.num_slots - tkv.num_slots) <= ps  # both pools hold the same number of tokens
    out = llm.generate([[1, 2, 3]], None)
    assert out[0].error is None
