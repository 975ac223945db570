"""Tensor names: a GGUF tensor or a family's fused HF tensor → the canonical HF names the models load.

Canonical names are llama's (`model.layers.{i}.self_attn.q_proj.weight`, ...). A family module may rename GGUF
leaves (`GGUF_NAMES`: gemma's `ffn_norm` is its pre-feed-forward norm) and store projections fused
(`FUSED`: phi3's `qkv_proj`, `gate_up_proj`); a fused tensor is split into its canonical parts by rows, so a
block-quantized file's blocks stay exact and every later stage (packing, tensor parallelism) sees llama's names.
"""
from __future__ import annotations

import re
from ..models.config import ModelConfig
from ..models.registry import family

# GGUF per-layer leaf name → HF leaf name (under model.layers.{i}.), llama's layout.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# a GGUF's stacked experts under their HF leaf without the index (`mlp.experts.gate_proj`): [E, rows, cols]
_STACKED = re.compile(r"^(.*\.experts)\.([a-z]\w*)$")


def layer_names(arch: str) -> dict[str, str]:
    """GGUF leaf → HF leaf for a family."""
    return {**LAYER_NAMES, **getattr(family(arch), "GGUF_NAMES", {})}


def hf_name(gguf_name: str, names: dict[str, str] = LAYER_NAMES) -> str | None:
    """HF parameter name for a GGUF tensor name (fused families: the fused HF name), or None if unknown."""
    m = _BLK.match(gguf_name)
    if m:
        leaf = names.get(m.group(2))
        return None if leaf is None else f"model.layers.{m.group(1)}.{leaf}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    base = _GLOBAL_NAMES.get(stem)
    return None if base is None else f"{base}.{kind}"


def _part_rows(cfg: ModelConfig, leaf: str) -> int:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": cfg.intermediate_size, "mlp.up_proj": cfg.intermediate_size}[leaf]


def permutes_qk(arch: str) -> bool:
    """convert_hf_to_gguf interleaves q/k rows for the llama family (incl. mistral, smollm, mixtral) only."""
    return arch in ("llama", "mixtral")


def split_rows(cfg: ModelConfig, name: str) -> list[tuple[str, "slice | int"]]:
    """(canonical name, its rows of `name`) per part: `name` whole unless the family stores it fused. An MoE's
    stacked experts [E, rows, cols] → expert e's HF name (`experts.{e}.`) and index e."""
    m = _LAYER.match(name)
    stacked = _STACKED.match(m.group(2)) if m and cfg.num_experts else None
    if stacked:
        return [(f"model.layers.{m.group(1)}.{stacked.group(1)}.{e}.{stacked.group(2)}.{m.group(3)}", e)
                for e in range(cfg.num_experts)]
    parts = getattr(family(cfg.architecture), "FUSED", {}).get(m.group(2)) if m else None
    if parts is None:
        return [(name, slice(None))]
    out, start = [], 0
    for leaf in parts:
        n = _part_rows(cfg, leaf)
        out.append((f"model.layers.{m.group(1)}.{leaf}.{m.group(3)}", slice(start, start + n)))
        start += n
    return out
