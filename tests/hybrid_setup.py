"""Tiny random Qwen3.5 (Gated DeltaNet + gated attention) models, built with transformers (the oracle)
and loaded into specserve; weights re-drawn large enough that greedy choices are well separated."""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch

from specserve.cache.kv_pool import KVPool
from specserve.cache.state_pool import StatePool
from specserve.runtime.runner import ModelRunner
from specserve.models.config import ModelConfig
from specserve.models.forward_batch import RowStates
from specserve.models.qwen3_5 import Qwen35Model

L, F = "linear_attention", "full_attention"
PATTERNS = {"LFLF": (L, F, L, F), "LLLF": (L, L, L, F), "FLL": (F, L, L)}


@lru_cache(maxsize=None)
def hf_model(pattern: str = "LFLF", seed: int = 0):  # noqa: ANN201
    """A transformers Qwen3_5ForCausalLM in fp64 with random weights (cached: treat as read-only)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    types = list(PATTERNS[pattern])
    cfg = Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=len(types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=types, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    m = Qwen3_5ForCausalLM(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "A_log" not in name:  # keep the decay rates the reference initialises
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if "norm" in name else 0.3))
    return m


def spec_config(pattern: str = "LFLF", seed: int = 0) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_model(pattern, seed).config.to_dict(), name=f"tiny-qwen3_5-{pattern}")


def tiny_hybrid(pattern: str = "LFLF", seed: int = 0, dtype: torch.dtype = torch.float64) -> Qwen35Model:
    m = Qwen35Model(spec_config(pattern, seed), dtype)
    m.load_weights(hf_model(pattern, seed).state_dict())
    return m


def save_hybrid_dir(path: Path, pattern: str = "LFLF", seed: int = 0) -> str:
    """An HF checkpoint dir (config.json, safetensors) plus a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    m = hf_model(pattern, seed)
    m.save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(m.config.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    return str(path)


def hf_greedy(pattern: str, seed: int, prompt: list[int], n: int, dtype: torch.dtype) -> list[int]:
    m = hf_model(pattern, seed)
    if dtype != torch.float64:
        m = copy.deepcopy(m).to(dtype)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def scratch_states(model: Qwen35Model, ids: list[int]) -> RowStates:
    """Recurrent state after `ids`, from one from-scratch forward in fresh pools (the commit oracle)."""
    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pool = StatePool(model.cfg, 1, model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    sb = pool.batch([pool.alloc()])
    ModelRunner(model, kv, pool).forward([pt], [0], [ids], [[]], states=sb)
    return sb.split([len(ids)])[0]
