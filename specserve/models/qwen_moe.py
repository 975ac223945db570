"""Qwen2-MoE and Qwen3-MoE (models/moe.py): softmax → top-k routing, the weights renormalised when
`norm_topk_prob` (Qwen3-MoE's releases: yes; Qwen2-MoE's: no). Qwen2-MoE: q/k/v biases and one shared expert per
layer, scaled by sigmoid(x · shared_expert_gate); Qwen3-MoE: q/k RMS-normed per head, as qwen3."""
from __future__ import annotations

from typing import Any, Callable

from .config import ModelConfig
from .moe import GGUF_NAMES, MoEModel, moe_config_from_gguf, moe_config_from_hf

MODEL = MoEModel
GGUF_NAMES = GGUF_NAMES


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{arch} with use_sliding_window is not supported")
    if arch == "qwen2_moe":
        return moe_config_from_hf(cfg, arch, name, attention_bias=cfg.get("qkv_bias", True),
                                  shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    return moe_config_from_hf(cfg, arch, name, qk_norm=True)


def config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], tensor: Callable[[str], Any]) -> ModelConfig:
    """llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's (the converter writes no flag)."""
    return moe_config_from_gguf(cfg, get, norm_topk_prob=cfg.architecture == "qwen3_moe")
