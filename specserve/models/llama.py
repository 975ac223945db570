"""The decoder every llama-shaped family composes (Llama/SmolLM, Qwen2 with qkv bias, Qwen3 with q/k norm; and
through config switches Mistral's sliding window, Phi-3's fused checkpoints, Gemma's sandwich norms, GeLU,
soft-caps and local/global layers) over a paged KV pool.

Projections are fused at load time (q|k|v and gate|up) so a layer is two matmuls into attention and two
through the MLP. A family module subclasses `LlamaModel` only to name its checkpoint's tensors (PARTS, NORMS).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, decoder_from_hf
from . import fused
from .attention import apply_rope, paged_attention, rope_tables
from .forward_batch import ForwardBatch
from .embedding import GGUFEmbedding
from ..formats.quant import BlockQuantWeight, linear

if TYPE_CHECKING:
    from .tp import TensorParallel


# the fused projections: each layer attribute and the (canonical, HF-named) parts concatenated into it
PARTS = {"qkv_w": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_w": ("self_attn.o_proj",),
         "gate_up_w": ("mlp.gate_proj", "mlp.up_proj"), "down_w": ("mlp.down_proj",)}
# each layer's norms: attribute → HF leaf (a norm the config does not switch on is None and skipped)
NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
         "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
ROPE_POSITIONS = 4096  # positions the RoPE tables cover at first; they grow as requests reach further (_cover)


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda t: F.gelu(t, approximate="tanh")
    raise ValueError(f"unsupported MLP activation {name!r}; supported: silu, gelu_tanh")


def add_segments(segments: list, weights: list[torch.Tensor | None], dims: list[int]) -> None:
    """One packed projection for the C++ ops' flat lists: its segment count, then (wp, wd, wm) and (n, fmt) each
    (a fused q|k|v may mix Q4_K and Q6_K)."""
    dims.append(len(segments))
    for wp, wd, wm, n, fmt in segments:
        weights += [wp, wd, wm]
        dims += [n, fmt]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nkv, self.hd, self.eps = cfg.num_heads, cfg.num_kv_heads, hd, cfg.rms_norm_eps
        qkv_out = (self.nq + 2 * self.nkv) * hd
        e = lambda *s: nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.input_norm = e(h)
        self.qkv_w = e(qkv_out, h)
        self.qkv_b = e(qkv_out) if cfg.attention_bias else None
        # per head (qwen3, gemma3), or over the whole projection (olmoe: `qk_whole`)
        self.qk_whole = cfg.qk_norm_whole
        self.q_norm = e(self.nq * hd if self.qk_whole else hd) if cfg.qk_norm else None
        self.k_norm = e(self.nkv * hd if self.qk_whole else hd) if cfg.qk_norm else None
        self.o_w = e(h, self.nq * hd)
        self.post_norm = e(h)  # before the MLP
        self.gate_up_w = e(2 * cfg.intermediate_size, h)
        self.down_w = e(h, cfg.intermediate_size)
        # sandwich norms (gemma): the attention and MLP outputs are normed before their residual add
        self.attn_out_norm = e(h) if cfg.sandwich_norms else None
        self.mlp_out_norm = e(h) if cfg.sandwich_norms else None
        self.window, self.scale, self.softcap = cfg.layer_window(index), cfg.attention_scale, cfg.attn_softcap
        self.local = self.window is not None and cfg.rope_local_theta is not None  # its own RoPE tables
        self.act_name, self.act = cfg.hidden_act, _act(cfg.hidden_act)
        self.tp: "TensorParallel | None" = None  # a tensor-parallel shard: row-parallel outputs are all-reduced

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.tp is None else self.tp.all_reduce(t)

    def _norm(self, t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return t if w is None else F.rms_norm(t, (t.shape[-1],), w, self.eps)

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self._norm(x, self.input_norm)
        q, k, v = self._qkv(h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, fb, k_cache, v_cache, self.window, self.scale, self.softcap)
        x = x + self._norm(self._reduce(linear(o, self.o_w)), self.attn_out_norm)
        return x + self._norm(self._mlp(self._norm(x, self.post_norm)), self.mlp_out_norm)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on normed rows (an MoE layer overrides it: models/moe.py)."""
        gate, up = linear(h, self.gate_up_w).chunk(2, dim=-1)
        return self._reduce(linear(self.act(gate) * up, self.down_w))

    def _mlp_fused(self, h: torch.Tensor) -> torch.Tensor:
        """`_mlp` on the fused ops (the lean loop)."""
        gu = linear(h, self.gate_up_w)
        if self.act_name == "silu":
            a = torch.ops.specserve.silu_mul(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            a = self.act(gate) * up
        return self._reduce(linear(a, self.down_w))

    def mlp_stackable(self) -> bool:
        """decoder_layers can run this MLP (a dense one: its projections are checked with the attention's)."""
        return True

    def mlp_stack(self, weights: list[torch.Tensor | None], dims: list[int]) -> None:
        """Append this layer's MLP to decoder_layers' flat lists: no router, then gate_up and down."""
        weights.append(None)
        add_segments(self.gate_up_w.segments, weights, dims)
        add_segments(self.down_w.segments, weights, dims)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed rows [T, H] → q [T, nq, hd], k, v [T, nkv, hd] (Qwen3, Gemma 3: q/k RMS-normed per head)."""
        T = h.shape[0]
        q, k, v = linear(h, self.qkv_w, self.qkv_b).split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        if self.q_norm is not None and self.qk_whole:
            q = F.rms_norm(q, (q.shape[-1],), self.q_norm, self.eps)
            k = F.rms_norm(k, (k.shape[-1],), self.k_norm, self.eps)
        q, k, v = q.reshape(T, self.nq, self.hd), k.reshape(T, self.nkv, self.hd), v.reshape(T, self.nkv, self.hd)
        if self.q_norm is not None and not self.qk_whole:
            q = F.rms_norm(q, (self.hd,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.hd,), self.k_norm, self.eps)
        return q, k, v

    @property
    def lean(self) -> bool:
        """The fused loop runs it: no score soft-cap (the C++ attention has none)."""
        return self.softcap is None

    def forward_fused(self, x: torch.Tensor, h: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Lean loop: h = input_norm(x) is given; x (the residual) gets the attention output added in
        place; returns the MLP output for the caller to add (fused with the next layer's norm). Sandwich norms
        (gemma) are one more rms_norm op each."""
        ops = torch.ops.specserve
        q, k, v = self._qkv(h)
        ops.rope_kv_write(q, k, v, cos, sin, fb.positions, k_cache, v_cache, fb.slot_mapping)
        o = self._reduce(linear(fused.attention(q, fb, k_cache, v_cache, self.window, self.scale), self.o_w))
        if self.attn_out_norm is not None:
            o = ops.rms_norm(o, self.attn_out_norm, self.eps)
        h = ops.add_rms_norm(x, o, self.post_norm, self.eps)
        out = self._mlp_fused(h)
        return out if self.mlp_out_norm is None else ops.rms_norm(out, self.mlp_out_norm, self.eps)


class LlamaModel(nn.Module):
    PARTS, NORMS = PARTS, NORMS
    LAYER = DecoderLayer  # an MoE model's layers: models/moe.py

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(self.LAYER(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self._grow_rope(min(cfg.max_position_embeddings, ROPE_POSITIONS))
        self._lean = all(layer.lean for layer in self.layers)  # the fused loop runs every layer (static)
        self.tp: "TensorParallel | None" = None  # set by parallel.attach on a tensor-parallel shard
        self.head_ids: torch.Tensor | None = None  # a reduced head (draft models): the vocab ids of its rows
        self.logits_vocab = cfg.vocab_size  # a reduced head's logits width (a draft model: the target's vocabulary)
        self._stack: tuple[object, tuple | None] | None = None  # (first qkv weight, _layer_stack's result)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, GGUFEmbedding):  # the file's blocks, rows dequantized when gathered
            x = self.embed(ids)
        else:
            x = F.embedding(ids, self.embed) if self.tp is None else self.tp.embed(ids, self.embed)
        if self.cfg.embed_scale != 1.0:  # gemma: the multiplier rounded to the model's dtype first, as HF does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def embedding_table(self) -> torch.Tensor:
        """The embedding as a dense [V, H] tensor (drafters sharing it, training)."""
        return self.embed.dense() if isinstance(self.embed, GGUFEmbedding) else self.embed

    def _grow_rope(self, n: int) -> None:
        """cos/sin tables for positions < n (cos_local/sin_local: gemma3's sliding layers' own base, unscaled;
        else the same tensors)."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg, self.dtype, positions=n)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        if cfg.rope_local_theta is not None:
            cos, sin = rope_tables(cfg, self.dtype, cfg.rope_local_theta, scaled=False, positions=n)
        self.register_buffer("cos_local", cos, persistent=False)
        self.register_buffer("sin_local", sin, persistent=False)

    def _cover(self, positions: torch.Tensor) -> None:
        """Grow the RoPE tables (doubling, up to max_position_embeddings) to cover `positions`: a 32k-context
        model with 256-wide heads would otherwise hold 128 MiB of tables its requests mostly never reach."""
        have = self.cos_table.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:
            self._grow_rope(min(self.cfg.max_position_embeddings, max(need, 2 * have)))

    def _rope(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos_local, self.sin_local) if layer.local else (self.cos_table, self.sin_table)

    @torch.no_grad()
    def load_weights(self, sd: "Mapping[str, torch.Tensor]", matrices: bool = True) -> None:
        """Load HF-named weights (the family's PARTS and NORMS), fusing q|k|v and gate|up. Missing tensors raise
        KeyError naming them. `matrices=False`: norms and biases only (the streaming GGUF load packs the
        matrices itself). Norms take the config's norm_offset (gemma's 1 + w), added in float64: exact."""
        cast = lambda name: sd[name].to(self.dtype)  # noqa: E731
        off = self.cfg.norm_offset
        norm = lambda name: (sd[name].double() + off).to(self.dtype) if off else cast(name)  # noqa: E731
        self.norm.copy_(norm("model.norm.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for attr, leaf in self.NORMS.items():
                if getattr(layer, attr) is not None:
                    getattr(layer, attr).copy_(norm(f"{p}{leaf}.weight"))
            if layer.qkv_b is not None:
                layer.qkv_b.copy_(torch.cat([cast(f"{p}{n}.bias") for n in self.PARTS["qkv_w"]]))
            if not matrices:
                continue
            for attr, parts in self.PARTS.items():
                getattr(layer, attr).copy_(torch.cat([cast(f"{p}{n}.weight") for n in parts]))
        if matrices:
            self.embed.copy_(cast("model.embed_tokens.weight"))
            if not self.cfg.tie_word_embeddings:
                self.lm_head.copy_(cast("lm_head.weight"))

    @torch.no_grad()
    def forward(
        self, fb: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the decoder. Returns (final-normed hidden at fb.logits_index (all if None),
        [hidden after each layer in capture_layers, packed [T, H]])."""
        # NOTE: the fused loop never calls a layer module, so layers with forward hooks (tests that
        # poison one request's hidden rows, debugging) run the reference loop
        self._cover(fb.positions)
        if fused.enabled() and self._lean and not any(layer._forward_hooks for layer in self.layers):
            return self._forward_fused(fb, k_caches, v_caches, capture_layers)
        x = self.embed_tokens(fb.input_ids)
        tables = {False: (self.cos_table, self.sin_table), True: (self.cos_local, self.sin_local)}
        rope = {k: (c[fb.positions].unsqueeze(1), s[fb.positions].unsqueeze(1)) for k, (c, s) in tables.items()}
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, fb, *rope[layer.local], k_caches[i], v_caches[i])
            if i in capture_layers:
                captured.append(x)
        if fb.logits_index is not None:
            x = x[fb.logits_index]
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps), captured

    def _forward_fused(self, fb: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                       capture_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ops, eps = torch.ops.specserve, self.cfg.rms_norm_eps
        x = self.embed_tokens(fb.input_ids)  # a fresh tensor: the residual stream, updated in place
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        stack = self._layer_stack()
        if stack is not None:  # the whole loop below as one C++ op (kernels/csrc/decoder.cpp), same ops in order
            layer = self.layers[0]
            captured = self._captured(ops.decoder_layers(
                x, h, stack[0], stack[1], self.cos_table, self.sin_table, fb.positions, fb.slot_mapping, k_caches,
                v_caches, fb.q_start, fb.ctx_slots, fb.ctx_start, fb.ctx_first, fb.mask, fb.mask_start,
                fb.causal and fb.mask is None, fused.combined_window(fb.window, layer.window),
                1.0 / math.sqrt(self.cfg.head_dim) if layer.scale is None else layer.scale, eps, list(capture_layers)))
            if fb.logits_index is not None:
                x = x[fb.logits_index]
            return ops.rms_norm(x, self.norm, eps), captured
        captured = []
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out = layer.forward_fused(x, h, fb, *self._rope(layer), k_caches[i], v_caches[i])
            if i + 1 < n:
                h = ops.add_rms_norm(x, out, self.layers[i + 1].input_norm, eps)
            else:
                x.add_(out)
            if i in capture_layers:
                captured.append(x.clone())  # x keeps changing in place
        if fb.logits_index is not None:
            x = x[fb.logits_index]
        return ops.rms_norm(x, self.norm, eps), captured

    def _captured(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """decoder_layers' outputs → the captured hidden states (an MoE model takes its experts lists off the end)."""
        return outs

    def _layer_stack(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        """The layers' weights flattened for decoder_layers, when every projection is block-quantized, nothing
        runs between the ops but a qkv bias and q/k norms (no sandwich norm or tensor-parallel all-reduce), the MLP is SwiGLU
        (or a mixture of stacked experts: `mlp_stack`) and every layer shares one window, scale and RoPE table; else
        None. Built at the first forward after the weights are final (quantize_model swaps them in place)."""
        first = self.layers[0].qkv_w
        if self._stack is not None and self._stack[0] is first:
            return self._stack[1]
        stack = None
        uniform = len({(l.window, l.scale, l.local, l.act_name) for l in self.layers}) == 1
        if self.tp is None and uniform and self.layers[0].act_name == "silu" and all(
                isinstance(getattr(l, a), BlockQuantWeight) and l.attn_out_norm is None and l.tp is None
                and l.mlp_stackable() for l in self.layers for a in self.PARTS):
            weights: list[torch.Tensor | None] = []
            dims: list[int] = []
            for layer in self.layers:
                for a in ("qkv_w", "o_w"):
                    add_segments(getattr(layer, a).segments, weights, dims)
                dims.append(int(layer.qk_whole))
                weights += [layer.input_norm, layer.post_norm, layer.qkv_b, layer.q_norm, layer.k_norm]
                layer.mlp_stack(weights, dims)
            stack = (weights, dims + [self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim])
        self._stack = (first, stack)
        return stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 (or fp64 for fp64 models): sampling math never runs in bf16. A reduced head's logits
        are scattered into the full vocabulary at −inf elsewhere: a token outside it has probability 0."""
        logits = linear(hidden, self.lm_head)
        if self.tp is not None:  # vocab-parallel head: the full rows on rank 0 only (elsewhere empty)
            logits = self.tp.gather_vocab(logits)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        cap = self.cfg.final_softcap
        if cap is not None:  # gemma2: logits → cap · tanh(logits / cap), in fp32 as HF does
            logits = torch.tanh(logits / cap) * cap
        if self.head_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.logits_vocab), float("-inf"))
        return full.index_copy_(-1, self.head_ids, logits)

    @torch.no_grad()
    def restrict_head(self, ids: torch.Tensor) -> None:
        """Keep only the head rows of `ids` (sorted vocab ids) on a float head; quantized heads are restricted
        while they are packed (quantize_model's `head_rows`)."""
        if not isinstance(self.lm_head, torch.Tensor) or self.tp is not None:
            raise ValueError("restrict_head: the head is packed or sharded; restrict it while quantizing")
        self.lm_head = nn.Parameter(self.lm_head[ids].clone(), requires_grad=False)  # tied: the embedding stays
        self.head_ids = ids


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    """Llama / SmolLM, Qwen2 (q/k/v bias), Qwen3 (q/k norm)."""
    return decoder_from_hf(cfg, arch, name, attention_bias=cfg.get("attention_bias", arch == "qwen2"),
                           qk_norm=arch == "qwen3")


MODEL = LlamaModel
