"""Load a GGUF checkpoint into HF-named, dequantized torch tensors plus our ModelConfig and Tokenizer."""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.config import ModelConfig
from ..formats.gguf_blocks import BlockCodes, UnsupportedBlockType, gguf_blocks
from ..formats.transcode import transcode
from ..models.registry import family, normalize_architecture
from ..tokenizer.tokenizer import Tokenizer
from .names import hf_name, layer_names, permutes_qk, split_rows

log = logging.getLogger(__name__)

_SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                     "IQ4_NL", "IQ4_XS")

# Tensors llama.cpp writes that carry no HF parameter (handled via config instead).
_SKIP = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's `permute` for llama q/k.

    The converter reorders each head's rows from HF's rotate-half layout (first half | second half)
    to interleaved pairs: reshape(n_head, 2, d/2, ...).swapaxes(1, 2). Undo by viewing the rows as
    (n_head, d/2, 2) and swapping back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_scaling(reader: Any, arch: str, freqs: np.ndarray | None, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    # NOTE: only what rope_inv_freq (models/attention.py) computes is read: a type it lacks (yarn) is refused here, by name
    if kind == "linear" and factor:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: linear, and llama3 "
                         "from rope_freqs)")
    if freqs is not None:
        return _llama3_from_freqs(freqs, head_dim, theta)
    return None


def _llama3_from_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """llama.cpp stores Llama-3.x rope scaling only as a `rope_freqs` tensor of per-dim divisors.

    Recover the HF `llama3` rope_scaling dict by assuming Meta's published low/high factors and
    original context, and refusing if recomputing the divisors from them does not reproduce the tensor.
    """
    factor = float(freqs.max())
    cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    inv = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    lo_wl, hi_wl = 8192 / 1.0, 8192 / 4.0
    want = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            want.append(1.0)
        elif wl > lo_wl:
            want.append(factor)
        else:
            s = (8192 / wl - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - s) / factor + s))
    if len(want) != freqs.size or not np.allclose(freqs.astype(np.float64), want, rtol=1e-3):
        raise ValueError("GGUF has a rope_freqs tensor that does not match llama3 rope scaling; unsupported")
    return cand


def gguf_architecture(reader: Any) -> str:
    """The registry key of a GGUF's `general.architecture`; llama.cpp writes Mixtral as `llama` with experts."""
    raw = str(_field(reader, "general.architecture"))
    arch = normalize_architecture(raw)
    return "mixtral" if arch == "llama" and _field(reader, f"{raw}.expert_count") else arch


def read_config(reader: Any, tensor_shapes: dict[str, tuple[int, ...]],
                tensor: Any = lambda name: None) -> ModelConfig:
    """ModelConfig from GGUF metadata. `tensor_shapes` are HF-order shapes keyed by GGUF name; `tensor(name)`
    reads a small tensor (fp32 numpy) or gives None (rope_freqs, a family's rope factors)."""
    arch_raw = _field(reader, "general.architecture")
    arch = gguf_architecture(reader)
    g = lambda k, d=None: _field(reader, f"{arch_raw}.{k}", d)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    kv = g("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer list in some files; we only do uniform GQA
        if len(set(kv)) != 1:
            raise ValueError(f"per-layer head_count_kv {kv} is not supported")
        kv = kv[0]
    head_dim = int(g("attention.key_length") or hidden // heads)
    rot = g("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rot}, head_dim={head_dim}) unsupported")
    theta = float(g("rope.freq_base", 10000.0))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    emb = tensor_shapes.get("token_embd.weight")
    # The embedding row count is what the model needs; token lists are normally the same length.
    vocab = emb[0] if emb else len(tokens)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, str(arch_raw), tensor("rope_freqs.weight"), head_dim, theta),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=int(bos) if bos is not None else None,
        name=str(_field(reader, "general.name") or ""),
    )
    extra = getattr(family(arch), "config_from_gguf", None)  # the family's own metadata
    return cfg if extra is None else extra(cfg, g, tensor)


def tensor_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in HF (row-major) order: GGUF lists dimensions fastest first."""
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def open_gguf(path: Path) -> tuple[Any, ModelConfig, Tokenizer]:
    """(memory-mapped reader, config, tokenizer), after checks that fail before anything is loaded: a file
    the reader cannot parse (truncated, corrupt), tensor data past the end of the file, a block type we
    cannot read (named with its tensor), a tensor we cannot place."""
    from gguf.quants import dequantize

    from ..formats.gguf_file import GGUFFile

    size = path.stat().st_size
    try:
        reader = GGUFFile(path)  # memory-maps the file; tensors are read lazily
    except Exception as e:  # noqa: BLE001 - bad bytes surface as struct/numpy/enum errors
        raise ValueError(f"{path.name}: not a readable GGUF file ({type(e).__name__}: {e}); "
                         f"it may be truncated or corrupt ({size} bytes)") from None
    try:  # the architecture first: an unsupported family's tensors are refused by its name, not by a tensor's
        arch = gguf_architecture(reader)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None
    names = layer_names(arch)
    for t in reader.tensors:
        if t.tensor_type.name not in _SUPPORTED_QTYPES:
            raise ValueError(f"{path.name}: tensor {t.name!r} has GGUF block type {t.tensor_type.name}, which "
                             f"specserve cannot read; supported: {', '.join(_SUPPORTED_QTYPES)}")
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ValueError(f"{path.name}: tensor {t.name!r} ends at byte {int(t.data_offset) + int(t.n_bytes)} "
                             f"but the file has {size} bytes: the file is truncated")
        if t.name not in _SKIP and hf_name(t.name, names) is None:
            raise ValueError(f"{path.name}: unexpected GGUF tensor {t.name!r} for a {arch} model (a {arch} layer "
                             f"has: {', '.join(sorted(names))})")
    shapes = {t.name: tensor_shape(t) for t in reader.tensors}
    by_name = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> np.ndarray | None:
        t = by_name.get(name)
        return None if t is None else np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    cfg = read_config(reader, shapes, tensor)
    tokenizer = Tokenizer.from_gguf(reader)
    return reader, replace(cfg, eos_token_ids=tokenizer.eos_token_ids), tokenizer


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, blocks: dict[str, BlockCodes] | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file: config, HF-named dequantized weights (cast to `dtype`), tokenizer."""
    path = Path(path)
    reader, cfg, tokenizer = open_gguf(path)
    return cfg, gguf_weights(reader, cfg, path.name, dtype, blocks), tokenizer


def gguf_weights(reader: Any, cfg: ModelConfig, name: str, dtype: torch.dtype = torch.float32,
                 blocks: dict[str, BlockCodes] | None = None) -> dict[str, torch.Tensor]:
    """HF-named dequantized weights (cast to `dtype`) of an opened GGUF (`open_gguf`).
    If `blocks` is given, it is filled with HF name → the exact blocks of every matrix the file stores in a
    block type the integer GEMMs take (--quantization w4a8/w8a8/int4). Quantized serving without tensor
    parallelism streams instead (gguf_stream.py): this path holds the whole model in `dtype`."""
    from gguf.quants import dequantize

    # llama.cpp only permutes q/k for the llama family (incl. mistral/smollm/mixtral); qwen keeps HF layout.
    permuted = permutes_qk(cfg.architecture)
    names = layer_names(cfg.architecture)

    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _SKIP:
            continue
        shape = tensor_shape(t)
        arr = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32)
        if not arr.flags.writeable:  # F32 comes back as a view of the read-only mmap: own a copy
            arr = arr.copy()
        whole = torch.from_numpy(arr)
        try:  # Q3_K/IQ4_NL: rewritten exactly into a kernel's type (formats/transcode.py); stacked experts: none
            whole_codes = (None if blocks is None or len(shape) != 2
                           else gguf_blocks(*transcode(t.data, t.tensor_type.name), shape, t.name))
        except UnsupportedBlockType:  # Q2_K/IQ4_XS: dequantized here, re-quantized by the mode
            whole_codes = None
        for name, rows in split_rows(cfg, hf_name(t.name, names)):  # a fused tensor: its parts' rows
            w = whole[rows]
            # NOTE: whole rows move, so every block stays exact
            codes = None if whole_codes is None else whole_codes.rows(lambda r: r[rows].contiguous())
            if permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                n = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
                w = unpermute_rotary(w, n)
                codes = None if codes is None else codes.rows(lambda r: unpermute_rotary(r, n).contiguous())
            if codes is not None:
                blocks[name] = codes
            weights[name] = hf_form(cfg, name, w, dtype)
        del arr, whole
    log.info("loaded GGUF %s: %d tensors, %s", name, len(weights), cfg.architecture)
    return weights


def hf_form(cfg: ModelConfig, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor as its HF checkpoint holds it: gemma's norms are stored as offset + w in the file, and
    come back as w in float64 (exact, so the load's offset + w is the file's value again)."""
    if cfg.norm_offset and name.endswith("norm.weight"):
        return w.double() - cfg.norm_offset
    return w.to(dtype).contiguous()
