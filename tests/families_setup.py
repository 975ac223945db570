"""Tiny random models of every decoder family, built with transformers (the oracle) and saved as HF directories.

Each family switches on what makes it itself: Mistral a sliding window shorter than the prompts, Phi-3 its fused
checkpoint tensors and LongRoPE, Gemma 2 alternating local/global layers with both soft-caps, Gemma 3 five local
to one global layer on two RoPE bases with q/k norms. Weights are re-drawn large enough that greedy choices are
well separated.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import torch

VOCAB = 128
WINDOW = 5
FAMILIES = ("mistral", "phi3", "gemma2", "gemma3")
PROMPTS = [[1, 5, 7, 9, 11, 13, 15, 17], [3], [8, 8, 8, 2, 8, 8, 8, 2, 8, 8, 8, 2, 8, 8],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


def _config(family: str):  # noqa: ANN202
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    if family == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False, **common)
    if family == "phi3":
        short = [1.0 + 0.25 * i for i in range(4)]
        return tf.Phi3Config(
            num_hidden_layers=2, tie_word_embeddings=False, sliding_window=None, original_max_position_embeddings=64,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                             "long_factor": [2 * f for f in short], "original_max_position_embeddings": 64},
            **common)
    if family == "gemma2":
        return tf.Gemma2Config(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=8,
                               attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **common)
    return tf.Gemma3TextConfig(  # the default layout: five local layers, then one global
        num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}},
        **common)


@lru_cache(maxsize=None)
def hf_model(family: str, seed: int = 0):  # noqa: ANN201
    """A transformers causal LM of `family` in fp64 with random weights (cached: treat as read-only)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(family)
    cfg._attn_implementation = "eager"  # soft-capping needs the eager path
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = 0.1 if "norm" in name else 0.3
            if "embed" in name and family.startswith("gemma"):  # × sqrt(hidden) on the way in: keep the residual
                scale /= cfg.hidden_size ** 0.5                 # from drowning the layers (greedy would echo)
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return m


def save_family_dir(path: Path, family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """An HF checkpoint dir (config.json, safetensors) plus a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    m = copy.deepcopy(hf_model(family, seed)).to(dtype)
    m.save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return str(path)


def hf_greedy(family: str, prompt: list[int], n: int, dtype: torch.dtype = torch.float64, seed: int = 0,
              window: bool = True) -> list[int]:
    """transformers' greedy tokens; `window=False`: Mistral without its window (as its GGUF runs)."""
    m = hf_model(family, seed)
    if dtype != torch.float64 or not window:
        m = copy.deepcopy(m).to(dtype)
    if not window:
        m.config.sliding_window = None
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
