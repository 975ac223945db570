"""Model geometry, read from an HF `config.json` or a GGUF header."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key (models/registry.py FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""  # human-readable model name (for logs, /v1/models, drafter matching)
    # per layer "full_attention", "sliding_attention" (sees positions > p − sliding_window) or
    # "linear_attention" (Gated DeltaNet, hybrid qwen3_5); () = every layer is full attention
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # gemma3: the sliding layers' RoPE base (unscaled); None = rope_theta
    attention_scale: float | None = None  # q·k multiplier; None = head_dim ** -0.5 (gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # gemma2: scores → cap · tanh(scores / cap)
    final_softcap: float | None = None  # gemma2: logits → cap · tanh(logits / cap)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" | "gelu_tanh"
    sandwich_norms: bool = False  # gemma2/3: attention and MLP outputs are RMS-normed before the residual add
    norm_offset: float = 0.0  # gemma: a checkpoint stores w, the norm multiplies by (norm_offset + w)
    embed_scale: float = 1.0  # gemma: embeddings × sqrt(hidden_size)
    partial_rotary_factor: float = 1.0  # RoPE rotates only the first head_dim * factor dims
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # mixture of experts (models/moe.py): every layer's MLP is `num_experts` SwiGLU experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token; 0 experts = a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # qwen2_moe: one always-on expert, gated by sigmoid(x · g)
    qk_norm_whole: bool = False  # olmoe: q and k RMS-normed over the whole projection, not per head

    @property
    def is_hybrid(self) -> bool:
        """Has recurrent layers: their state cannot be rolled back by truncating a KV cache."""
        return "linear_attention" in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep K/V in the paged pool (all of them for pure attention)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t != "linear_attention")

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, None for full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The window when every attention layer slides (Mistral): positions behind it are never read again,
        so their pages can go. None when any layer attends to the whole context."""
        ws = {self.layer_window(i) for i in self.attention_layers}
        return ws.pop() if len(ws) == 1 and None not in ws else None

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_params(self) -> int:
        """Parameters of a llama-family decoder of this geometry (attention + MLP + embedding and head): how
        big a model is, for comparing a draft with its target before loading either. An MoE counts every
        expert (what a load holds), not the ones a token reads."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self.hidden_size
        mlp = (3 * h * (self.num_experts * self.moe_intermediate_size + self.shared_expert_intermediate_size)
               + h * (self.num_experts + 1) if self.is_moe else 3 * h * self.intermediate_size)
        layer = h * (2 * q + 2 * kv) + mlp
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per dtype byte: attention layers x (k+v) x kv_heads x head_dim."""
        return len(self.attention_layers) * 2 * self.num_kv_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's causal convolution (q | k | v)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def state_elems_per_layer(self) -> int:
        """Elements of one request's state in one recurrent layer: conv window + delta-rule matrix."""
        return ((self.linear_conv_kernel - 1) * self.conv_dim
                + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a parsed HF `config.json`. Raises ValueError on an unsupported architecture."""
        from .registry import architecture_from_hf, family

        arch = architecture_from_hf(cfg)
        return family(arch).config_from_hf(cfg, arch, name)


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def decoder_from_hf(cfg: dict[str, Any], arch: str, name: str, **extra: Any) -> ModelConfig:
    """The geometry every llama-shaped decoder's `config.json` states the same way; `extra` adds or overrides
    the family's own fields."""
    heads = cfg["num_attention_heads"]
    base: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        name=name,
    )
    base.update(extra)
    return ModelConfig(**base)


def checked_layer_types(types: list[str] | tuple[str, ...], n: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if len(types) != n or any(t not in allowed for t in types):
        raise ValueError(f"config.json layer_types must list {n} entries from {allowed}, got {list(types)!r}")
    return tuple(types)
