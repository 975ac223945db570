"""OLMoE (models/moe.py): softmax → top-k routing (`norm_topk_prob`, false in its release), and q and k
RMS-normed over the whole projection before the heads are split (`qk_norm_whole`), not per head as qwen3."""
from __future__ import annotations

from typing import Any, Callable

from .config import ModelConfig
from .moe import GGUF_NAMES, MoEModel, moe_config_from_gguf, moe_config_from_hf

MODEL = MoEModel
GGUF_NAMES = GGUF_NAMES


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"olmoe with clip_qkv {cfg['clip_qkv']} is not supported")
    return moe_config_from_hf(cfg, arch, name, qk_norm=True, qk_norm_whole=True)


def config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], tensor: Callable[[str], Any]) -> ModelConfig:
    """llama.cpp does not renormalise OLMoE's top-k weights."""
    return moe_config_from_gguf(cfg, get, norm_topk_prob=False, qk_norm_whole=True)
