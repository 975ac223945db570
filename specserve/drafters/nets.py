"""Trainable pieces shared by the learned drafters (EAGLE-3, MTP, DFlash, DSpark).

Every net runs the same weights two ways:
  * paged (serving): new K/V go to the drafter's own KV pool through a ForwardBatch, like the target;
  * dense (training): one sequence at a time, an explicit boolean mask, autograd on.
The target's embedding table (and, for MTP/DFlash/DSpark, its LM head) is shared and frozen: it is
bound at load time (`bind`) and never saved in the drafter artifact.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from ..models.forward_batch import ForwardBatch
from ..models.attention import apply_rope, paged_attention, rope_inv_freq
from ..models.llama import LlamaModel

ALGORITHMS = ("eagle3", "mtp", "dflash", "dspark")


@dataclass(frozen=True)
class DrafterConfig:
    """Everything `config.json` of a drafter artifact holds (geometry, target, training record)."""

    algorithm: str  # eagle3 | mtp | dflash | dspark
    target: str  # name of the target model it was trained for
    target_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose outputs feed the drafter
    draft_vocab_size: int  # ≤ target vocab; d2t maps draft ids to target ids
    block_size: int = 0  # block drafters: [anchor, MASK × (block_size − 1)]
    markov_rank: int = 0  # DSpark: rank of the transition term
    ttt_steps: int = 0  # chain drafters: training-time-test unroll length
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    training: dict[str, Any] = field(default_factory=dict)  # data, steps, losses, measured acceptance

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"drafter algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))

    @property
    def is_block(self) -> bool:
        return self.algorithm in ("dflash", "dspark")

    def model_config(self) -> ModelConfig:
        """The draft geometry as a ModelConfig: sizes its KV pool and its RoPE table."""
        return ModelConfig("llama", self.target_vocab_size, self.target_hidden_size, self.intermediate_size,
                           self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.rms_norm_eps,
                           self.rope_theta, self.rope_scaling, self.max_position_embeddings, name=f"{self.algorithm}-draft")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "DrafterConfig":
        known = {f.name for f in fields(DrafterConfig)}
        return DrafterConfig(**{k: v for k, v in d.items() if k in known})

    @staticmethod
    def for_target(algorithm: str, t: ModelConfig, **overrides: Any) -> "DrafterConfig":
        """Defaults scaled to the target: its attention geometry, EAGLE-3's aux layers [1, N/2−1, N−4]."""
        n = t.num_layers
        aux = (1, n // 2 - 1, n - 4) if n >= 8 else tuple(sorted({0, n // 2, n - 1}))
        base: dict[str, Any] = dict(
            algorithm=algorithm, target=t.name, target_vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
            target_num_layers=n, num_layers=2 if algorithm in ("dflash", "dspark") else 1, num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
            aux_layer_ids=(n - 1,) if algorithm == "mtp" else aux, draft_vocab_size=t.vocab_size,
            block_size=8 if algorithm in ("dflash", "dspark") else 0,
            # DSpark's rank 256 is for 4096-wide targets: scale with the hidden size, at least 32
            markov_rank=max(32, 256 * t.hidden_size // 4096 // 32 * 32) if algorithm == "dspark" else 0,
            ttt_steps=5 if algorithm in ("eagle3", "mtp") else 0, rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return DrafterConfig(**base)


def dense_head(target: LlamaModel) -> torch.Tensor:
    """The target's LM head as a dense [V, H] matrix (tied heads are the embedding table)."""
    if target.cfg.tie_word_embeddings:
        return target.embedding_table()
    if isinstance(target.lm_head, torch.Tensor):
        return target.lm_head
    raise ValueError("this drafter shares the target's LM head, which is int4-packed here; "
                     "serve the target without --quantization int4 or use a tied-embedding target")


class DraftLayer(nn.Module):
    """Llama decoder layer whose attention input (`a`, width in_dim) and residual (`x`) are given
    separately: EAGLE-3 attends from [embed; hidden] (2H) while its residual stream is the hidden."""

    def __init__(self, cfg: ModelConfig, in_dim: int) -> None:
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(in_dim, (self.nq + 2 * self.nkv) * self.hd, bias=False)
        self.o = nn.Linear(self.nq * self.hd, cfg.hidden_size, bias=False)
        self.post_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def project(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        T = a.shape[0]
        q, k, v = self.qkv(a).split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q, k = apply_rope(q.view(T, self.nq, self.hd), cos, sin), apply_rope(k.view(T, self.nkv, self.hd), cos, sin)
        return q, k, v.view(T, self.nkv, self.hd)

    def project_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V only (DFlash context injection): the K and V rows of the fused projection."""
        T, n = ctx.shape[0], self.nkv * self.hd
        k, v = F.linear(ctx, self.qkv.weight[self.nq * self.hd :]).split([n, n], dim=-1)
        return apply_rope(k.view(T, self.nkv, self.hd), cos, sin), v.view(T, self.nkv, self.hd)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o(attn)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd], k/v [S, KVH, hd], mask [T, S] (True = may attend) → [T, H * hd]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask[None, None], enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


def paged(fb: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor):  # noqa: ANN201
    """An `attend(q, k, v)` that goes through the drafter's KV pool (serving)."""
    return lambda q, k, v: paged_attention(q, k, v, fb, k_cache, v_cache)


class DraftNet(nn.Module):
    """Base: config, RoPE table, draft vocabulary (d2t) and the frozen target tensors."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg, self.mcfg = cfg, cfg.model_config()
        # d2t[i] = target id of draft id i − i (EAGLE-3's convention); zeros = identity
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), rope_inv_freq(self.mcfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().float(), persistent=False)
        self.register_buffer("sin_table", emb.sin().float(), persistent=False)
        self.target_embed: torch.Tensor | None = None

    def bind(self, target: LlamaModel) -> None:
        """Share the target's frozen tensors (not parameters of the drafter; never saved)."""
        self.target_embed = target.embedding_table().detach()  # a plain tensor: not a parameter of the drafter

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids: sorted target ids of the draft vocabulary (len = draft_vocab_size)."""
        self.d2t.copy_(target_ids - torch.arange(len(target_ids)))

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.target_embed).to(self.cos_table.dtype)
