"""Megatron layout of a Llama-family decoder over `world` ranks, and the slicing of its checkpoint.

- Column-parallel (output rows split): q/k/v by whole KV groups (each rank keeps its K/V heads and the
  query heads that read them: GQA groups never straddle ranks), gate/up by blocks of 32 channels.
- Row-parallel (input columns split, partial sums all-reduced): o_proj by the same heads, down_proj by
  the same channels.
- Vocab-parallel: embedding rows and LM-head rows split by token id.
Uneven splits are allowed (SmolLM2: 3 KV groups over 2 ranks → 2 + 1; lower ranks take the extra),
so rank 0 always holds the largest shard: its KV pool size bounds every rank's.
Splits of quantized weights fall on blocks of 32 (a GGUF's blocks are sliced, never re-quantized).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..models.config import ModelConfig
from ..formats.gguf_blocks import BlockCodes

GROUP = 32


def split(n: int, world: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of rank's share of n items taken `unit` at a time (lower ranks take the remainder)."""
    units = n // unit
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


@dataclass(frozen=True)
class Layout:
    """One rank's share of every split dimension."""

    rank: int
    world: int
    kv_heads: tuple[int, int]  # [start, end) of KV heads
    q_heads: tuple[int, int]
    inter: tuple[int, int]  # MLP channels
    vocab: tuple[int, int]
    vocab_sizes: tuple[int, ...]  # every rank's vocab shard (logits are gathered padded to the largest)

    @staticmethod
    def make(cfg: ModelConfig, rank: int, world: int) -> "Layout":
        if cfg.is_hybrid:
            raise ValueError(f"--tp-size {world}: tensor parallelism supports llama/qwen2/qwen3 targets, "
                             f"not {cfg.architecture} (hybrid recurrent)")
        if cfg.is_moe:
            raise ValueError(f"--tp-size {world}: tensor parallelism does not shard mixture-of-experts targets "
                             f"({cfg.architecture}); serve it on one rank (--tp-size 1)")
        if cfg.num_kv_heads < world:
            raise ValueError(f"--tp-size {world}: the model has {cfg.num_kv_heads} KV heads; each rank needs at "
                             f"least one (use --tp-size <= {cfg.num_kv_heads})")
        group = cfg.num_heads // cfg.num_kv_heads
        k0, k1 = split(cfg.num_kv_heads, world, rank)
        unit = GROUP if cfg.intermediate_size % GROUP == 0 else 1
        vocab_sizes = tuple(b - a for a, b in (split(cfg.vocab_size, world, r) for r in range(world)))
        return Layout(rank, world, (k0, k1), (k0 * group, k1 * group), split(cfg.intermediate_size, world, rank, unit),
                      split(cfg.vocab_size, world, rank), vocab_sizes)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The geometry of this rank's shard (what its layers and KV pool are built from)."""
        n = lambda r: r[1] - r[0]  # noqa: E731
        return replace(cfg, num_heads=n(self.q_heads), num_kv_heads=n(self.kv_heads),
                       intermediate_size=n(self.inter), vocab_size=n(self.vocab))


def _rows(t: torch.Tensor, r: tuple[int, int], per: int = 1) -> torch.Tensor:
    return t[r[0] * per: r[1] * per].contiguous()


def _cols(t: torch.Tensor, r: tuple[int, int], per: int = 1) -> torch.Tensor:
    return t[:, r[0] * per: r[1] * per].contiguous()


def _block_rows(c: BlockCodes, r: tuple[int, int], per: int = 1) -> BlockCodes:
    return c.rows(lambda t: _rows(t, r, per))


def _block_cols(c: BlockCodes, r: tuple[int, int], per: int, name: str) -> BlockCodes:
    a, b = r[0] * per, r[1] * per
    unit = 256 if c.kquant else GROUP  # a k-quant's scales are per super-block of 256
    if a % unit or b % unit:
        raise ValueError(f"--tp-size: {name} splits at input column {a if a % unit else b}, inside a quantized "
                         f"block of {unit}; serve this model unquantized (--dtype float32) or with another --tp-size")
    return c.cols(a, b)


def shard_checkpoint(cfg: ModelConfig, layout: Layout, sd: dict[str, torch.Tensor],
                     blocks: dict[str, BlockCodes] | None) -> tuple[dict[str, torch.Tensor], dict[str, BlockCodes] | None]:
    """HF-named weights (and a GGUF's exact blocks) → this rank's slices, under the same names."""
    hd, L = cfg.head_dim, layout
    rules = {  # HF name suffix → (slice of a dense tensor, slice of its blocks)
        "q_proj.weight": (lambda t: _rows(t, L.q_heads, hd), lambda c, n: _block_rows(c, L.q_heads, hd)),
        "q_proj.bias": (lambda t: _rows(t, L.q_heads, hd), None),
        "k_proj.weight": (lambda t: _rows(t, L.kv_heads, hd), lambda c, n: _block_rows(c, L.kv_heads, hd)),
        "k_proj.bias": (lambda t: _rows(t, L.kv_heads, hd), None),
        "v_proj.weight": (lambda t: _rows(t, L.kv_heads, hd), lambda c, n: _block_rows(c, L.kv_heads, hd)),
        "v_proj.bias": (lambda t: _rows(t, L.kv_heads, hd), None),
        "o_proj.weight": (lambda t: _cols(t, L.q_heads, hd), lambda c, n: _block_cols(c, L.q_heads, hd, n)),
        "gate_proj.weight": (lambda t: _rows(t, L.inter), lambda c, n: _block_rows(c, L.inter)),
        "up_proj.weight": (lambda t: _rows(t, L.inter), lambda c, n: _block_rows(c, L.inter)),
        "down_proj.weight": (lambda t: _cols(t, L.inter), lambda c, n: _block_cols(c, L.inter, 1, n)),
        "embed_tokens.weight": (lambda t: _rows(t, L.vocab), lambda c, n: _block_rows(c, L.vocab)),
        "lm_head.weight": (lambda t: _rows(t, L.vocab), lambda c, n: _block_rows(c, L.vocab)),
    }

    def rule(name: str) -> tuple | None:
        return next((v for k, v in rules.items() if name.endswith(k)), None)

    out = {}
    for name, t in sd.items():
        r = rule(name)
        out[name] = r[0](t) if r else t  # norms and anything per-head-dim stay whole
    if blocks is None:
        return out, None
    bout = {}
    for name, c in blocks.items():
        r = rule(name)
        if r is None or r[1] is None:
            raise ValueError(f"--tp-size: no tensor-parallel split known for quantized tensor {name}")
        bout[name] = r[1](c, name)
    return out, bout
