"""Tiny random mixture-of-experts models of the four MoE families, built with transformers (the oracle) and saved
as HF directories (tests/families_setup.py's recipe: word-level tokenizer, weights re-drawn large enough that
greedy choices are well separated).

Each family switches on what makes it itself: Qwen3-MoE renormalised top-k weights and per-head q/k norms,
Qwen2-MoE q/k/v biases and a gated shared expert, Mixtral its `block_sparse_moe` names, OLMoE q/k norms over the
whole projection. Every expert matrix has a 32-wide input, so the integer kernels take them.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import torch

from tests.families_setup import VOCAB

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
EXPERTS, TOP_K = 8, 2


def moe_config(family: str, vocab: int = VOCAB):  # noqa: ANN201
    import transformers as tf

    experts = EXPERTS
    common = dict(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, num_hidden_layers=2, num_experts_per_tok=TOP_K, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=32, intermediate_size=64, head_dim=8,
                                 norm_topk_prob=True, **common)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=32, intermediate_size=64,
                                 shared_expert_intermediate_size=64, norm_topk_prob=False, **common)
    if family == "mixtral":
        return tf.MixtralConfig(num_local_experts=experts, intermediate_size=32, sliding_window=None, **common)
    return tf.OlmoeConfig(num_experts=experts, intermediate_size=32, norm_topk_prob=False, **common)


@lru_cache(maxsize=None)
def moe_model(family: str, seed: int = 0, vocab: int = VOCAB):  # noqa: ANN201
    """A transformers MoE causal LM of `family` in fp32 with random weights (cached: treat as read-only)."""
    from transformers import AutoModelForCausalLM

    cfg = moe_config(family, vocab)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if "norm" in name else 0.3))
    return m


def save_moe_dir(path: Path, family: str, seed: int = 0, vocab: int = VOCAB,
                 dtype: torch.dtype = torch.float32) -> str:
    """An HF checkpoint dir (config.json, safetensors) plus a word-level tokenizer (tests/tiny.py's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    copy.deepcopy(moe_model(family, seed, vocab)).to(dtype).save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return str(path)


def moe_greedy(family: str, prompt: list[int], n: int, seed: int = 0) -> list[int]:
    """transformers' greedy tokens (fp32)."""
    with torch.no_grad():
        out = moe_model(family, seed).generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                               do_sample=False)
    return out[0, len(prompt):].tolist()
