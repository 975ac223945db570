"""Phi-3 / Phi-3.5 / Phi-4-mini: the llama decoder with q|k|v and gate|up stored fused (split into llama's names
when read, so packing and tensor parallelism see llama's tensors), an optional sliding window, and LongRoPE.

LongRoPE: the short factors apply while a sequence stays within the original context, which is what this
engine serves (the context is capped there); cos and sin carry the attention factor, as in HF.
"""
from __future__ import annotations

from typing import Any, Callable

from .config import ModelConfig, decoder_from_hf
from .llama import LlamaModel

MODEL = LlamaModel
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
GGUF_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _longrope(rs: dict[str, Any], max_pos: int, orig: int) -> tuple[dict[str, Any], int]:
    """(rope_scaling, the served context) for LongRoPE: the short factors, within the original context."""
    out = {"rope_type": "longrope", "short_factor": list(rs["short_factor"]), "long_factor": list(rs["long_factor"]),
           "original_max_position_embeddings": orig, "factor": rs.get("factor") or max_pos / orig}
    if rs.get("attention_factor") is not None:
        out["attention_factor"] = rs["attention_factor"]
    return out, min(max_pos, orig)


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"phi3 with partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type"))
    max_pos = cfg.get("max_position_embeddings", 4096)
    extra: dict[str, Any] = {"rope_scaling": None}
    if kind in ("longrope", "su"):
        orig = rs.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        extra["rope_scaling"], extra["max_position_embeddings"] = _longrope(rs, max_pos, orig)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported phi3 rope scaling {kind!r}; supported: default, longrope")
    window = cfg.get("sliding_window")
    if window:
        extra.update(sliding_window=window, layer_types=("sliding_attention",) * cfg["num_hidden_layers"])
    return decoder_from_hf(cfg, arch, name, **extra)


def config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], tensor: Callable[[str], Any]) -> ModelConfig:
    """llama.cpp runs Phi-3 GGUFs without their sliding window, and so does this; LongRoPE from the file's
    `rope_factors_short/long` tensors."""
    from dataclasses import replace

    short, long = tensor("rope_factors_short.weight"), tensor("rope_factors_long.weight")
    if short is None:
        return cfg
    orig = int(get("rope.scaling.original_context_length", cfg.max_position_embeddings))
    rs = {"short_factor": short.tolist(), "long_factor": long.tolist() if long is not None else short.tolist(),
          "attention_factor": get("rope.scaling.attn_factor", None)}
    scaling, ctx = _longrope(rs, cfg.max_position_embeddings, orig)
    return replace(cfg, rope_scaling=scaling, max_position_embeddings=ctx)
