"""Target architectures, loading and tokenization."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaModel
from .registry import model_class


def build_model(name_or_path: str, dtype: torch.dtype, quantization: str | None = None
                ) -> tuple[LlamaModel, "Tokenizer"]:  # noqa: F821
    """Load a checkpoint (HF dir, .gguf, or alias) into our model class; returns (model, tokenizer)."""
    from .loader import load_checkpoint

    from .quant import quantize_model

    blocks: dict | None = {} if quantization else None
    cfg, state_dict, tokenizer = load_checkpoint(name_or_path, dtype, blocks)
    model = model_class(cfg.architecture)(cfg, dtype)
    model.load_weights(state_dict)
    del state_dict
    if quantization:
        quantize_model(model, quantization, blocks)
    return model, tokenizer


__all__ = ["LlamaModel", "ModelConfig", "build_model", "model_class"]
