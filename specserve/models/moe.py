"""Mixture-of-experts decoders (qwen2_moe, qwen3_moe, mixtral, olmoe): the llama decoder whose MLP is a router
and `num_experts` SwiGLU experts, `num_experts_per_tok` (k) of them per token, plus (qwen2_moe) one shared expert
every token runs, scaled by sigmoid(x · g).

Routing, as all four families define it: softmax over every expert's logit (in fp32), top-k of those
probabilities (torch.topk: ties go as the reference breaks them), and with `norm_topk_prob` the k weights
renormalised to sum to 1 (Mixtral's top-k-then-softmax is the same thing).

A step gathers the rows routed to each expert and runs that expert's matrices once on them; experts no row
routes to are not touched (`MoEDecoderLayer.touched` counts the ones a forward ran: the expert bytes a step reads,
`MoEModel.expert_bytes_read`). NOTE: a token's output does not depend on its batch: each expert GEMM is
row-independent on the integer path (formats/quant.py), the router's logits are too (the `router_logits` op,
kernels/csrc/router.cpp) and a token's expert outputs are summed in its own top-k order.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import fused
from .config import ModelConfig, decoder_from_hf
from .llama import PARTS, DecoderLayer, LlamaModel, add_segments
from ..formats.quant import BlockQuantWeight, Int4Weight, StackedQuantWeight, linear

# attention only: a dense MLP's slots hold the shared expert where the family has one
ATTENTION_PARTS = {k: PARTS[k] for k in ("qkv_w", "o_w")}
SHARED_PARTS = {"gate_up_w": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                "down_w": ("mlp.shared_expert.down_proj",)}
# GGUF leaves (llama.cpp's layout) → HF leaves; `*_exps` are stacked [E, rows, cols]: loading/names.py splits
# them into the per-expert names (`experts.{e}.`)
GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] fp32, experts [T, k]) in top-k order: softmax in fp32, top-k
    (torch.topk, as every reference picks), renormalised when `norm`."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _combine(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[t, j] · ys[t, j] over ys [T, k, H]. NOTE: summed in top-k order per token, whatever else the
    batch holds (a token's result must not depend on its batch)."""
    ys = ys * weights.unsqueeze(-1)
    out = ys[:, 0]
    for j in range(1, ys.shape[1]):
        out = out + ys[:, j]
    return out


def weight_nbytes(w: "torch.Tensor | BlockQuantWeight | Int4Weight") -> int:
    """Bytes a matmul with `w` reads (packed codes and scales for a quantized weight)."""
    if isinstance(w, BlockQuantWeight):
        return sum(t.numel() * t.element_size() for t in w._flat if t is not None)
    if isinstance(w, Int4Weight):
        return sum(t.numel() * t.element_size() for t in (w.packed, w.scale_zero))
    return w.numel() * w.element_size()


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0) -> None:
        shared = cfg.shared_expert_intermediate_size
        super().__init__(replace(cfg, intermediate_size=shared), dtype, index)  # the dense slots: the shared expert
        if not shared:
            self.gate_up_w = self.down_w = None
        E, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        e = lambda *s: nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.num_experts, self.top_k, self.norm_topk = E, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router_w = e(E + (1 if shared else 0), h)  # the router's E rows, then the shared expert's gate row
        # NOTE: stacked float [E, 2I, H] (gate | up rows) and [E, H, I]; quantize_model swaps each for a list of
        # per-expert packed weights: `[e]` gives expert e's matrix either way
        self.experts_gate_up: Any = e(E, 2 * inter, h)
        self.experts_down: Any = e(E, h, inter)
        self._touched: "list[int] | torch.Tensor" = []  # the experts the last forward ran, ascending

    @property
    def touched(self) -> list[int]:
        """The experts the last forward ran, ascending (the C++ op hands them over as a tensor)."""
        if isinstance(self._touched, torch.Tensor):
            self._touched = self._touched.tolist()
        return self._touched

    @touched.setter
    def touched(self, experts: "list[int] | torch.Tensor") -> None:
        self._touched = experts

    def _router(self, h: torch.Tensor) -> torch.Tensor:
        if h.dtype == torch.float32 and fused.available():
            return torch.ops.specserve.router_logits(h, self.router_w)  # row-invariant (kernels/csrc/router.cpp)
        return F.linear(h, self.router_w)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self._moe(h, self._swiglu, super()._mlp)

    def _mlp_fused(self, h: torch.Tensor) -> torch.Tensor:
        """The same with the activation as one fused op (silu_mul) per expert; on stacked block-quantized experts
        the whole block is one op (kernels/csrc/moe.cpp: the same ops, so the same bits)."""
        if self.mlp_stackable() and h.dtype == torch.float32:
            weights: list[torch.Tensor | None] = []
            dims: list[int] = []
            self._expert_segments(weights, dims)
            out, self.touched = torch.ops.specserve.moe_mlp(h, self.router_w, weights, dims, self.top_k, self.norm_topk)
            return out
        return self._moe(h, torch.ops.specserve.silu_mul, super()._mlp_fused)

    def mlp_stackable(self) -> bool:
        """The one-op block (and decoder_layers) can run it: stacked block-quantized experts, a float32 router."""
        return isinstance(self.experts_gate_up, StackedQuantWeight) and isinstance(self.experts_down, StackedQuantWeight) \
            and (self.gate_up_w is None or isinstance(self.gate_up_w, BlockQuantWeight)) \
            and self.router_w.dtype == torch.float32

    def mlp_stack(self, weights: list[torch.Tensor | None], dims: list[int]) -> None:
        """decoder_layers' MoE MLP: the router, (top_k, norm), then the block's segments."""
        weights.append(self.router_w)
        dims += [self.top_k, int(self.norm_topk)]
        self._expert_segments(weights, dims)

    def _expert_segments(self, weights: list[torch.Tensor | None], dims: list[int]) -> None:
        """The shared expert's gate_up and down (none: no segments), then the stacked experts' (kernels/csrc/moe.h)."""
        for w in (self.gate_up_w, self.down_w, self.experts_gate_up, self.experts_down):
            add_segments(w.segments if w is not None else [], weights, dims)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return self.act(gate) * up

    def _moe(self, h: torch.Tensor, swiglu: Callable[[torch.Tensor], torch.Tensor],
             shared: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        E = self.num_experts
        logits = self._router(h)
        weights, experts = route(logits[:, :E], self.top_k, self.norm_topk)
        out = self._experts(h, weights.to(h.dtype), experts, swiglu)
        if self.gate_up_w is not None:  # qwen2_moe's shared expert
            out = out + torch.sigmoid(logits[:, E:]) * shared(h)
        return out

    def _experts(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 swiglu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{experts[t, j]}(h[t]), each expert run once on the rows routed to it."""
        T, k = experts.shape
        flat = experts.reshape(-1)  # slot t·k + j: token t's j-th choice
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens ascending within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        ys = h.new_empty(T * k, h.shape[-1])
        touched, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            ys[slots] = linear(swiglu(linear(h[slots // k], self.experts_gate_up[e])), self.experts_down[e]).to(ys.dtype)
            touched.append(e)
        self.touched = touched
        return _combine(ys.view(T, k, -1), weights)

    def expert_nbytes(self, e: int) -> int:
        return weight_nbytes(self.experts_gate_up[e]) + weight_nbytes(self.experts_down[e])


class MoEModel(LlamaModel):
    LAYER = MoEDecoderLayer
    # HF leaves of a layer's router, the shared expert's gate and each expert's weights ({e}: its index), by the
    # layer attribute they are stacked into (gate | up fused as a dense MLP's)
    ROUTER, SHARED_GATE = "mlp.gate", "mlp.shared_expert_gate"
    EXPERTS = {"experts_gate_up": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
               "experts_down": ("mlp.experts.{e}.down_proj",)}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, dtype)
        self.PARTS = {**ATTENTION_PARTS, **(SHARED_PARTS if cfg.shared_expert_intermediate_size else {})}

    @torch.no_grad()
    def load_weights(self, sd: "Mapping[str, torch.Tensor]", matrices: bool = True) -> None:
        """llama's tensors (attention, the shared expert), then each layer's router (always: it stays float) and
        its experts, stacked."""
        super().load_weights(sd, matrices)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            rows = [sd[p + self.ROUTER + ".weight"]]
            if self.cfg.shared_expert_intermediate_size:
                rows.append(sd[p + self.SHARED_GATE + ".weight"].reshape(1, -1))  # a GGUF stores it as [H]
            layer.router_w.copy_(torch.cat(rows).to(self.dtype))
            if not matrices:
                continue
            for attr, parts in self.EXPERTS.items():
                stacked = getattr(layer, attr)
                for e in range(self.cfg.num_experts):
                    stacked[e].copy_(torch.cat([sd[f"{p}{n.format(e=e)}.weight"] for n in parts]).to(self.dtype))

    def _captured(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """decoder_layers returns the captured states, then each layer's experts run (every layer is MoE here)."""
        n = len(outs) - len(self.layers)
        for layer, ran in zip(self.layers, outs[n:]):
            layer.touched = ran
        return outs[:n]

    def expert_reads(self) -> list[int]:
        """Experts each layer's last forward ran (a verify of K tokens: the union of their routes)."""
        return [len(layer.touched) for layer in self.layers]

    def expert_bytes_read(self) -> int:
        """Bytes of expert weights the last forward read (every expert of a layer has one block type)."""
        return sum(len(l.touched) * l.expert_nbytes(l.touched[0]) for l in self.layers if l.touched)


def moe_config_from_hf(cfg: dict[str, Any], arch: str, name: str, **extra: Any) -> ModelConfig:
    """The expert geometry every family states the same way; `extra`: the family's own fields."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{arch} with dense MLP layers between the sparse ones (mlp_only_layers "
                         f"{cfg.get('mlp_only_layers')}, decoder_sparse_step {cfg.get('decoder_sparse_step')}) "
                         "is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported {arch} hidden_act {cfg['hidden_act']!r}; supported: silu")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    base = dict(num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return decoder_from_hf(cfg, arch, name, **{**base, **extra})


def moe_config_from_gguf(cfg: ModelConfig, get: Callable[[str, Any], Any], norm_topk_prob: bool,
                         **extra: Any) -> ModelConfig:
    """llama.cpp's reading of an MoE GGUF: `expert_count`, `expert_used_count`, the expert width
    (`expert_feed_forward_length`, else `feed_forward_length`), the shared expert's, and whether the top-k weights
    are renormalised (`expert_weights_norm`, else what llama.cpp hard-codes for the family: `norm_topk_prob`)."""
    gating = get("expert_gating_func", None)
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{cfg.architecture}: expert_gating_func {gating} is not supported (softmax only)")
    scale = get("expert_weights_scale", None)
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"{cfg.architecture}: expert_weights_scale {scale} is not supported")
    norm = get("expert_weights_norm", None)
    return replace(
        cfg, num_experts=int(get("expert_count", 0)), num_experts_per_tok=int(get("expert_used_count", 0)),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0) or cfg.intermediate_size),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
        norm_topk_prob=norm_topk_prob if norm is None else bool(norm), **extra)
