"""Gemma 2 and Gemma 3 (text): the llama decoder with
  - RMSNorms that scale by (1 + w) (`norm_offset`; a GGUF stores 1 + w already), and four of them per layer:
    the attention and MLP outputs are normed before their residual add (`sandwich_norms`);
  - embeddings × sqrt(hidden); a GeLU (tanh) gated MLP; q·k scaled by query_pre_attn_scalar ** -0.5;
  - local (sliding-window) and global layers interleaved: Gemma 2 alternates, Gemma 3 has five local to one global,
    its local layers on their own RoPE base (`rope_local_theta`, unscaled);
  - Gemma 2: score and logit soft-caps (cap · tanh(x / cap)); Gemma 3: q/k RMS-normed per head.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from .config import ModelConfig, checked_layer_types, decoder_from_hf
from .llama import NORMS, LlamaModel

_LAYERS = ("sliding_attention", "full_attention")


class GemmaModel(LlamaModel):
    NORMS = {**NORMS, "attn_out_norm": "post_attention_layernorm", "post_norm": "pre_feedforward_layernorm",
             "mlp_out_norm": "post_feedforward_layernorm"}


MODEL = GemmaModel
GGUF_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}


def _pattern(n: int, every: int) -> tuple[str, ...]:
    """Every `every`-th layer global, the rest local (Gemma 2: 2, Gemma 3: 6), as both references lay them out."""
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n))


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    cfg = cfg.get("text_config") or cfg
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention (an embedding model) is not supported")
    n = cfg["num_hidden_layers"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported {arch} hidden_activation {act!r}; supported: gelu_pytorch_tanh")
    every = 2 if arch == "gemma2" else cfg.get("sliding_window_pattern", 6)
    types = checked_layer_types(cfg.get("layer_types") or _pattern(n, every), n, _LAYERS)
    rope = cfg.get("rope_parameters") or {}
    glob = rope.get("full_attention", rope)  # gemma3 keys its RoPE per layer type
    local = rope.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling") or (glob if glob.get("rope_type", "default") != "default" else None)
    return decoder_from_hf(
        cfg, arch, name, layer_types=types, sliding_window=cfg.get("sliding_window"),
        rope_theta=glob.get("rope_theta", cfg.get("rope_theta", 10000.0)), rope_scaling=scaling,
        rope_local_theta=(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
                          if arch == "gemma3" else None),
        attention_scale=cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"),
        hidden_act="gelu_tanh", sandwich_norms=True, norm_offset=1.0, embed_scale=cfg["hidden_size"] ** 0.5,
        qk_norm=arch == "gemma3", tie_word_embeddings=cfg.get("tie_word_embeddings", True))


def config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], tensor: Callable[[str], Any]) -> ModelConfig:
    """llama.cpp's reading of a gemma2/gemma3 GGUF: the window and its pattern (2 / 6, or an explicit per-layer
    list), the local RoPE base (10000 unless the file says), soft-caps, and the 27B's query scale."""
    gemma2 = cfg.architecture == "gemma2"
    window = get("attention.sliding_window", 4096 if gemma2 else None)
    pattern = get("attention.sliding_window_pattern", 2 if gemma2 else 6)
    if not window:
        types: tuple[str, ...] = ()
    elif isinstance(pattern, list):
        types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    else:
        types = _pattern(cfg.num_layers, int(pattern))
    big = cfg.num_layers == (46 if gemma2 else 62)  # the 27B: scaled by hidden / heads, not head_dim
    return replace(
        cfg, layer_types=types, sliding_window=int(window) if window else None,
        rope_local_theta=None if gemma2 else float(get("rope.freq_base_swa", 10000.0)),
        attention_scale=(cfg.hidden_size / cfg.num_heads if big else cfg.head_dim) ** -0.5,
        attn_softcap=get("attn_logit_softcapping", None) if gemma2 else None,
        final_softcap=get("final_logit_softcapping", None) or None,
        hidden_act="gelu_tanh", sandwich_norms=True, norm_offset=1.0, embed_scale=cfg.hidden_size ** 0.5,
        qk_norm=not gemma2)
