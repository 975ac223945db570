"""Model geometry, read from an HF `config.json` or a GGUF header."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key: "llama" | "qwen2" | "qwen3" | "qwen3_5"
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
    # hybrid targets (qwen3_5): per layer "full_attention" or "linear_attention" (Gated DeltaNet);
    # () = every layer is attention
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # RoPE rotates only the first head_dim * factor dims
    linear_conv_kernel: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    @property
    def is_hybrid(self) -> bool:
        """Has recurrent layers: their state cannot be rolled back by truncating a KV cache."""
        return "linear_attention" in self.layer_types

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep K/V in the paged pool (all of them for pure attention)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_params(self) -> int:
        """Parameters of a llama-family decoder of this geometry (attention + MLP + embedding and head): how
        big a model is, for comparing a draft with its target before loading either."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
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
        from .registry import architecture_from_hf

        arch = architecture_from_hf(cfg)
        if arch == "qwen3_5":
            return _qwen3_5_from_hf(cfg.get("text_config") or cfg, name)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


_LAYER_TYPES = ("full_attention", "linear_attention")


def _qwen3_5_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    """Qwen3.5 text config (`Qwen3_5ForCausalLM`, or the `text_config` of the multimodal checkpoint)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config.json layer_types must list {n} entries from {_LAYER_TYPES}, got {types!r}")
    if "full_attention" not in types:
        raise ValueError("config.json layer_types: a qwen3_5 model needs at least one full_attention layer")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_parameters.rope_type {rope.get('rope_type')!r} for qwen3_5; supported: default")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture="qwen3_5", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False), attention_bias=cfg.get("attention_bias", False),
        qk_norm=True, bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()), name=name,
        layer_types=tuple(types), partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
        linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"], linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"])
