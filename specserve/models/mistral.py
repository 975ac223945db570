"""Mistral: the llama decoder with sliding-window attention in every layer (`sliding_window`; null in the
later releases, which attend to the whole context). A GGUF of it says `llama` and loads as llama, as llama.cpp
runs it: without the window."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, decoder_from_hf
from .llama import LlamaModel

MODEL = LlamaModel


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    return decoder_from_hf(cfg, arch, name, sliding_window=window,
                           layer_types=("sliding_attention",) * cfg["num_hidden_layers"] if window else ())
