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


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype → the target KV pool's dtype: auto = the model's; bfloat16 under a float32 model halves
    the bytes attention streams per context token (values rounded to nearest even once, when written)."""
    if name == "auto" or _DTYPES[name] == dtype:
        return dtype
    if _DTYPES[name] == torch.bfloat16 and dtype == torch.float32:
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {name}: the KV pool takes the model's dtype ({str(dtype).removeprefix('torch.')}), "
                     "or bfloat16 under a float32 model")


def default_quantization(name_or_path: str, dtype: str, quantization: str | None) -> str | None:
    """--quantization as given ("none" = unquantized); unset with --dtype auto, a GGUF that stores its
    projections in 4-bit blocks (Q4_*) is served in w4a8, one in 8-bit blocks (Q8_0) in w8a8: the file's
    blocks kept exactly, our integer kernel (the fast CPU mode). Anything else, or an explicit --dtype,
    runs unquantized (exact float)."""
    if quantization is not None:
        return None if quantization == "none" else quantization
    if dtype != "auto":
        return None
    from .loader import resolve_model_path

    path = resolve_model_path(name_or_path)
    if path.suffix != ".gguf":
        return None
    from .gguf_file import GGUFFile

    kinds = {t.tensor_type.name for t in GGUFFile(path).tensors if t.name.endswith("ffn_down.weight")}
    return "w4a8" if any(k.startswith("Q4") for k in kinds) else "w8a8" if "Q8_0" in kinds else None


def build_model(name_or_path: str, dtype: torch.dtype, quantization: str | None = None, reserve_bytes: int = 0,
                head_rows: torch.Tensor | None = None) -> tuple[LlamaModel, "Tokenizer"]:  # noqa: F821
    """Load a checkpoint (HF dir, .gguf, or alias) into our model class; returns (model, tokenizer).
    A quantized GGUF streams from the memory-mapped file straight into packed weights (gguf_stream.py),
    after a check that it and `reserve_bytes` (the KV pools to come) fit in available memory.
    `head_rows`: sorted vocab ids the LM head keeps (a draft model's reduced vocabulary)."""
    from .loader import load_checkpoint, resolve_model_path
    from .quant import check_quantizable, quantize_model

    path = resolve_model_path(name_or_path)
    if quantization and path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf_stream import load_quantized_gguf

        return load_quantized_gguf(path, quantization, dtype, reserve_bytes, head_rows)

    blocks: dict | None = {} if quantization else None
    cfg, state_dict, tokenizer = load_checkpoint(name_or_path, dtype, blocks)
    if quantization:
        check_quantizable(cfg, quantization)
    model = model_class(cfg.architecture)(cfg, dtype)
    model.load_weights(state_dict)
    del state_dict
    if quantization:
        quantize_model(model, quantization, blocks, head_rows=head_rows)
    elif head_rows is not None:
        if not isinstance(model, LlamaModel):
            raise ValueError(f"a reduced draft vocabulary is not supported for {cfg.architecture} draft models")
        model.restrict_head(head_rows)
    return model, tokenizer


__all__ = ["LlamaModel", "ModelConfig", "build_model", "default_quantization", "model_class", "resolve_dtype"]
