"""Model families, the blocks they compose, their config and registry, dtype names."""
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


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype → the target KV pool's dtype: auto = the model's; bfloat16 under a float32 model halves
    the bytes attention streams per context token (values rounded to nearest even once, when written)."""
    if name == "auto" or _DTYPES[name] == dtype:
        return dtype
    if _DTYPES[name] == torch.bfloat16 and dtype == torch.float32:
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {name}: the KV pool takes the model's dtype ({str(dtype).removeprefix('torch.')}), "
                     "or bfloat16 under a float32 model")






__all__ = ["LlamaModel", "ModelConfig", "model_class", "resolve_dtype", "resolve_kv_dtype"]
