"""Mixtral (models/moe.py): the llama decoder with 8 experts, top-2: a softmax over the top-k logits, which is
softmax → top-k → renormalise. Its checkpoint names experts w1 (gate), w3 (up), w2 (down) under
`block_sparse_moe`. A GGUF of it says `llama` with an `expert_count` (loading/gguf.py reads it as mixtral) and has
llama's q/k rows interleaved. An optional sliding window, as mistral."""
from __future__ import annotations

from typing import Any, Callable

from .config import ModelConfig
from .moe import MoEModel, moe_config_from_gguf, moe_config_from_hf

_MOE = "block_sparse_moe"
GGUF_NAMES = {"ffn_gate_inp": f"{_MOE}.gate", "ffn_gate_exps": f"{_MOE}.experts.w1",
              "ffn_up_exps": f"{_MOE}.experts.w3", "ffn_down_exps": f"{_MOE}.experts.w2"}


class MixtralModel(MoEModel):
    ROUTER = f"{_MOE}.gate"
    EXPERTS = {"experts_gate_up": (f"{_MOE}.experts.{{e}}.w1", f"{_MOE}.experts.{{e}}.w3"),
               "experts_down": (f"{_MOE}.experts.{{e}}.w2",)}


MODEL = MixtralModel


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    return moe_config_from_hf(cfg, arch, name, norm_topk_prob=True, sliding_window=window,
                              layer_types=("sliding_attention",) * cfg["num_hidden_layers"] if window else ())


def config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], tensor: Callable[[str], Any]) -> ModelConfig:
    return moe_config_from_gguf(cfg, get, norm_topk_prob=True)
