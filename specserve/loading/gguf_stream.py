"""Load a GGUF straight into the quantized model, one tensor at a time, from the memory-mapped file.

No full-precision copy of the model exists at any point: each projection's blocks are read from the map
and packed for the integer kernel (`BlockQuantWeight`), norms and biases are copied, and the embedding
table stays in the file's blocks (`GGUFEmbedding`). A type the mode cannot keep exactly is dequantized
and re-quantized alone, so the transient peak is one matrix, not the model. The dense path
(`gguf.gguf_weights`: every tensor dequantized to `dtype`) remains for unquantized serving and
tensor parallelism.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..memory import peak_rss_bytes
from ..models.embedding import GGUFEmbedding
from ..formats.gguf_blocks import NATIVE
from ..formats.transcode import TRANSCODED, transcode
from .gguf import hf_form, tensor_shape, unpermute_rotary
from .names import hf_name, layer_names, permutes_qk, split_rows
from ..models.config import ModelConfig
from ..formats.gguf_repack import RawBlocks
from ..models.llama import LlamaModel
from .checkpoint import Checkpoint
from ..formats.quant import packed_nbytes, quantize_model
from ..models.registry import model_class

log = logging.getLogger(__name__)


class GGUFTensors(Mapping):
    """HF name → the file's tensor, read on access: `[name]` dequantizes (fp32, q/k rows un-permuted for the
    llama family; a fused tensor's rows of that part; gemma's norms in their HF form), `codes(name)` gives the
    raw blocks (RawBlocks) or None. Nothing is cached."""

    def __init__(self, reader: Any, cfg: ModelConfig) -> None:
        self.reader, self.cfg = reader, cfg
        names = layer_names(cfg.architecture)
        # HF name → (GGUF tensor, its rows)
        self.by_name = {n: (t, rows) for t in reader.tensors if (h := hf_name(t.name, names)) is not None
                        for n, rows in split_rows(cfg, h)}
        permuted = permutes_qk(cfg.architecture)
        self.heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads} if permuted else {}
        # NOTE: the stacked expert tensors last dequantized (gate and up: an expert's fused weight reads both), by
        # GGUF name: their E experts are asked for one after another
        self._stacked: dict[str, torch.Tensor] = {}

    def _rows(self, name: str) -> int | None:
        """Heads whose rows convert_hf_to_gguf interleaved, for a llama-family q/k weight, else None."""
        return next((n for p, n in self.heads.items() if f".self_attn.{p}." in name), None)

    def tensor(self, name: str) -> Any:
        """The GGUF tensor `name` is read from."""
        return self.by_name[name][0]

    def __getitem__(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t, rows = self.by_name[name]
        whole = self._stacked.get(t.name)
        if whole is None:
            whole = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            whole = whole.reshape(tensor_shape(t))
            if isinstance(rows, int):
                self._stacked = {**dict(list(self._stacked.items())[-1:]), t.name: whole}
        w = whole[rows]
        n = self._rows(name)
        return hf_form(self.cfg, name, w if n is None else unpermute_rotary(w, n), torch.float32)

    def codes(self, name: str) -> RawBlocks | None:
        """The file's blocks, unconverted: `quantize_model` packs them straight from the map (C++)."""
        if name not in self.by_name:
            return None
        t, rows = self.by_name[name]
        shape = tensor_shape(t)
        if isinstance(rows, int):  # expert `rows` of a stacked [E, N, K] tensor: its own [N, K] blocks
            shape = shape[1:]
        # a fused tensor's part: a view of its rows, every block whole; Q3_K/IQ4_NL rewritten exactly
        # (formats/transcode.py)
        data, qtype = transcode(t.data[rows], t.tensor_type.name)
        # float tensors stay dense; other block types are readable (dequantized) but have no exact integer
        # form: re-quantized alone
        if qtype not in NATIVE or len(shape) != 2:
            return None
        shape = (int(data.shape[0]), shape[1])
        n = self._rows(name)
        # NOTE: a row permutation moves whole rows, so every block stays exact
        order = None if n is None else unpermute_rotary(torch.arange(shape[0]), n).contiguous()
        return RawBlocks(data, qtype, shape, order, t.name)

    def release(self, names: list[str]) -> None:
        """Those tensors are copied out: drop their mapped pages from the RSS (GGUFFile.release)."""
        for n in names:
            if n in self.by_name and hasattr(self.reader, "release"):
                self.reader.release(self.by_name[n][0])
        self._stacked = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)


def resident_estimate(reader: Any) -> int:
    """Bytes the loaded model keeps in memory (an upper bound): packed matrices, the mapped embedding
    blocks, fp32 vectors. Compared with MemAvailable before anything is loaded."""
    total = 0
    for t in reader.tensors:
        shape = tensor_shape(t)
        kind = t.tensor_type.name
        if len(shape) == 3:  # stacked experts: E matrices
            shape = (shape[0] * shape[1], shape[2])
        if len(shape) == 2 and kind in TRANSCODED:  # rewritten (formats/transcode.py): its new block size
            total += int(t.n_bytes * TRANSCODED[kind][2] / TRANSCODED[kind][1] * 1.15)
        elif len(shape) == 2 and kind in NATIVE:  # packed formats stay within 15% of the file's bytes (Q4_0: its offsets)
            total += int(t.n_bytes * 1.15)
        elif len(shape) == 2:  # float or a type without an exact form: quantized here, at most 8-bit
            total += packed_nbytes(shape, 8)
        else:
            total += 4 * int(np.prod(shape))
    return total


def load_quantized_gguf(ckpt: Checkpoint, mode: str, dtype: torch.dtype,
                        head_rows: torch.Tensor | None = None) -> LlamaModel:
    """The model with packed projections and a block-stored embedding, for `--quantization mode` (checked to
    fit by the caller, loading/pipeline.py). `head_rows`: keep only these rows of the LM head (a draft model's
    reduced vocabulary)."""
    t0 = time.perf_counter()
    path, reader, cfg = ckpt.path, ckpt.reader, ckpt.cfg
    tensors = GGUFTensors(reader, cfg)
    # NOTE: parameters are torch.empty: their pages are never touched for the matrices swapped out below
    model = model_class(cfg.architecture)(cfg, dtype)
    model.load_weights(tensors, matrices=False)
    quantize_model(model, mode, tensors.codes, dense=tensors.__getitem__, head_rows=head_rows, done=tensors.release)
    emb = tensors.tensor("model.embed_tokens.weight")
    # a dense table in the file, or a tied head left float: the embedding stays a dense parameter
    if emb.tensor_type.name in ("F32", "F16", "BF16") or model.lm_head is model.embed:
        model.embed.copy_(tensors["model.embed_tokens.weight"])
    else:
        del model.embed  # a registered parameter: drop it before the attribute can hold the block table
        model.embed = GGUFEmbedding(emb.data, emb.tensor_type, cfg.hidden_size, dtype)
    log.info("loaded GGUF %s (%s) in %.1f s: %d tensors, %s; peak RSS %.2f GiB", path.name, mode,
             time.perf_counter() - t0, len(tensors), cfg.architecture, peak_rss_bytes() / 2**30)
    return model
