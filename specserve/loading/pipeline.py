"""Load a model: resolve → open → config → tokenizer (`open_checkpoint`) → weights → pack.

A quantized GGUF streams from the memory-mapped file straight into packed weights (gguf_stream.py); anything
else reads its weights in a float dtype, then packs them where a quantization mode is asked for."""
from __future__ import annotations

import torch

from ..formats.gguf_blocks import NATIVE
from ..formats.quant import check_quantizable, quantize_model
from ..memory import check_memory
from ..models.llama import LlamaModel
from ..models.registry import model_class
from ..tokenizer.tokenizer import Tokenizer
from .checkpoint import Checkpoint, open_checkpoint, read_weights

# block types served in w4a8 by default: those it keeps exactly (Q3_K and IQ4_NL once rewritten, formats/transcode.py),
# and those it re-quantizes to 4 bits (Q2_K, IQ4_XS: no exact form)
NARROW = frozenset(NATIVE) - {"Q8_0"} | {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"}


def default_quantization(ckpt: Checkpoint, dtype: str, quantization: str | None) -> str | None:
    """--quantization as given ("none" = unquantized); unset with --dtype auto, a GGUF that stores its
    projections in 2- to 6-bit blocks (NARROW) is served in w4a8, one in 8-bit blocks (Q8_0) in w8a8: the file's
    blocks kept exactly where they can be, our integer kernel (the fast CPU mode). Anything else, or an explicit
    --dtype, runs unquantized (exact float)."""
    if quantization is not None:
        return None if quantization == "none" else quantization
    if dtype != "auto":
        return None
    kinds = ckpt.tensor_types("ffn_down.weight") | ckpt.tensor_types("ffn_down_exps.weight")  # dense or MoE
    return "w4a8" if kinds & NARROW else "w8a8" if "Q8_0" in kinds else None


def resident_bytes(ckpt: Checkpoint, dtype: torch.dtype, quantization: str | None) -> int:
    """Memory a load of `ckpt` holds at its peak: a quantized GGUF streams into its packed size; any other path
    holds the whole model in `dtype` before packing."""
    if quantization and ckpt.is_gguf:
        from .gguf_stream import resident_estimate

        return resident_estimate(ckpt.reader)
    return ckpt.cfg.num_params * torch.finfo(dtype).bits // 8


def build_model(model: str | Checkpoint, dtype: torch.dtype, quantization: str | None = None,
                reserve: dict[str, int] | None = None, head_rows: torch.Tensor | None = None
                ) -> tuple[LlamaModel, Tokenizer]:
    """Load a checkpoint (an opened one, or an HF dir, a .gguf or an alias) into our model class; returns
    (model, tokenizer). Every path is first checked to fit in available memory with `reserve` (what the caller
    allocates next, by name: the KV cache, a draft model). `head_rows`: sorted vocab ids the LM head keeps (a
    draft model's reduced vocabulary)."""
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    reserve = {k: v for k, v in (reserve or {}).items() if v}
    if quantization:
        check_quantizable(ckpt.cfg, quantization)
    how = quantization if quantization and ckpt.is_gguf else str(dtype).removeprefix("torch.")
    also = " with " + " and ".join(f"{v / 2**30:.2f} GiB of {k}" for k, v in reserve.items()) if reserve else ""
    check_memory(resident_bytes(ckpt, dtype, quantization) + sum(reserve.values()), f"{ckpt.path.name} ({how}){also}")
    if quantization and ckpt.is_gguf:
        from .gguf_stream import load_quantized_gguf

        return load_quantized_gguf(ckpt, quantization, dtype, head_rows), ckpt.tokenizer
    blocks: dict | None = {} if quantization else None  # a GGUF's exact blocks, filled by read_weights
    cfg, state_dict = read_weights(ckpt, dtype, blocks)
    net = model_class(cfg.architecture)(cfg, dtype)
    net.load_weights(state_dict)
    del state_dict
    if quantization:
        quantize_model(net, quantization, blocks, head_rows=head_rows)
    elif head_rows is not None:
        if not isinstance(net, LlamaModel):
            raise ValueError(f"a reduced draft vocabulary is not supported for {cfg.architecture} draft models")
        net.restrict_head(head_rows)
    return net, ckpt.tokenizer
