"""Target architectures, loading and tokenization."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaModel
from .registry import model_class


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(name: str, quantization: str | None = None) -> torch.dtype:
    """--dtype / --speculative-draft-dtype → torch dtype (auto: bf16 under int4, else float32)."""
    if name == "auto":
        return torch.bfloat16 if quantization == "int4" else torch.float32
    return _DTYPES[name]


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


__all__ = ["LlamaModel", "ModelConfig", "build_model", "model_class", "resolve_dtype"]
