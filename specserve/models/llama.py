"""Llama-family decoder (Llama/SmolLM, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV pool.

One module for all three: the differences are config switches. Projections are fused at load time
(q|k|v and gate|up) so a layer is two matmuls into attention and two through the MLP.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from . import fused
from .forward_batch import ForwardBatch
from .embedding import GGUFEmbedding
from ..formats.quant import BlockQuantWeight, linear

if TYPE_CHECKING:
    from .tp import TensorParallel


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3 scaling when the config asks for it (as HF computes them)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, hd]. Non-interleaved (rotate-half) layout, as HF."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] of the packed new tokens → attention output [T, H * hd].
    Writes k/v at fb.slot_mapping, then attends over each request's context slots. Fused (ragged,
    C++) when the extension is on, else the padded pure-torch reference below."""
    # NOTE: new K/V land in the pool first; the context read below includes them.
    k_cache.index_copy_(0, fb.slot_mapping, k.to(k_cache.dtype))  # a bf16 pool under fp32: rounded once, here
    v_cache.index_copy_(0, fb.slot_mapping, v.to(v_cache.dtype))
    if fused.enabled():
        return fused.attention(q, fb, k_cache, v_cache)
    return reference_attention(q, fb, k_cache, v_cache)


def reference_attention(q: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """SDPA over the padded [B, q_max] × [B, L] rectangle (K/V already in the pool)."""
    T, nq, hd = q.shape
    pd = fb.padded
    B = pd.ctx_slots.shape[0]
    uq = pd.uniform_q
    qp = (q.reshape(B, uq, nq, hd) if uq else q[pd.q_index]).transpose(1, 2)  # [B, H, q_max, hd]
    if pd.ctx_start is not None:  # one request, consecutive pages: a view instead of a copy
        span = slice(pd.ctx_start, pd.ctx_start + pd.ctx_slots.shape[1])
        kc, vc = k_cache[span].unsqueeze(0).transpose(1, 2), v_cache[span].unsqueeze(0).transpose(1, 2)
    else:
        kc = k_cache[pd.ctx_slots].transpose(1, 2)  # [B, KVH, L, hd]
        vc = v_cache[pd.ctx_slots].transpose(1, 2)
    kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # a bf16 pool under fp32 queries: widened exactly
    o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=pd.attn_mask, enable_gqa=nq != k_cache.shape[1])
    o = o.transpose(1, 2)
    return o.reshape(T, -1) if uq else o[pd.q_valid].reshape(T, -1)  # back to packed order


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nkv, self.hd, self.eps = cfg.num_heads, cfg.num_kv_heads, hd, cfg.rms_norm_eps
        qkv_out = (self.nq + 2 * self.nkv) * hd
        e = lambda *s: nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.input_norm = e(h)
        self.qkv_w = e(qkv_out, h)
        self.qkv_b = e(qkv_out) if cfg.attention_bias else None
        self.q_norm = e(hd) if cfg.qk_norm else None
        self.k_norm = e(hd) if cfg.qk_norm else None
        self.o_w = e(h, self.nq * hd)
        self.post_norm = e(h)
        self.gate_up_w = e(2 * cfg.intermediate_size, h)
        self.down_w = e(h, cfg.intermediate_size)
        self.tp: "TensorParallel | None" = None  # a tensor-parallel shard: row-parallel outputs are all-reduced

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.tp is None else self.tp.all_reduce(t)

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        q, k, v = self._qkv(h)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, fb, k_cache, v_cache)
        x = x + self._reduce(linear(o, self.o_w))
        h = F.rms_norm(x, (x.shape[-1],), self.post_norm, self.eps)
        gate, up = linear(h, self.gate_up_w).chunk(2, dim=-1)
        return x + self._reduce(linear(F.silu(gate) * up, self.down_w))

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed rows [T, H] → q [T, nq, hd], k, v [T, nkv, hd] (Qwen3: q/k RMS-normed per head)."""
        T = h.shape[0]
        q, k, v = linear(h, self.qkv_w, self.qkv_b).split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k, v = q.view(T, self.nq, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.hd,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.hd,), self.k_norm, self.eps)
        return q, k, v

    def forward_fused(self, x: torch.Tensor, h: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Lean loop: h = input_norm(x) is given; x (the residual) gets the attention output added in
        place; returns the MLP output for the caller to add (fused with the next layer's norm)."""
        ops = torch.ops.specserve
        q, k, v = self._qkv(h)
        ops.rope_kv_write(q, k, v, cos, sin, fb.positions, k_cache, v_cache, fb.slot_mapping)
        o = self._reduce(linear(fused.attention(q, fb, k_cache, v_cache), self.o_w))
        h = ops.add_rms_norm(x, o, self.post_norm, self.eps)
        return self._reduce(linear(ops.silu_mul(linear(h, self.gate_up_w)), self.down_w))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        max_pos = cfg.max_position_embeddings
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(dtype), persistent=False)
        self.tp: "TensorParallel | None" = None  # set by parallel.attach on a tensor-parallel shard
        self.head_ids: torch.Tensor | None = None  # a reduced head (draft models): the vocab ids of its rows
        self.logits_vocab = cfg.vocab_size  # a reduced head's logits width (a draft model: the target's vocabulary)
        self._stack: tuple[object, tuple | None] | None = None  # (first qkv weight, _layer_stack's result)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, GGUFEmbedding):  # the file's blocks, rows dequantized when gathered
            return self.embed(ids)
        return F.embedding(ids, self.embed) if self.tp is None else self.tp.embed(ids, self.embed)

    def embedding_table(self) -> torch.Tensor:
        """The embedding as a dense [V, H] tensor (drafters sharing it, training)."""
        return self.embed.dense() if isinstance(self.embed, GGUFEmbedding) else self.embed

    @torch.no_grad()
    def load_weights(self, sd: "Mapping[str, torch.Tensor]", matrices: bool = True) -> None:
        """Load HF-named weights, fusing q|k|v and gate|up. Missing tensors raise KeyError naming them.
        `matrices=False`: norms and biases only (the streaming GGUF load packs the matrices itself)."""
        cast = lambda name: sd[name].to(self.dtype)  # noqa: E731
        self.norm.copy_(cast("model.norm.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm.copy_(cast(p + "input_layernorm.weight"))
            layer.post_norm.copy_(cast(p + "post_attention_layernorm.weight"))
            if layer.qkv_b is not None:
                layer.qkv_b.copy_(torch.cat([cast(a + f"{n}_proj.bias") for n in "qkv"]))
            if layer.q_norm is not None:
                layer.q_norm.copy_(cast(a + "q_norm.weight"))
                layer.k_norm.copy_(cast(a + "k_norm.weight"))
            if not matrices:
                continue
            layer.qkv_w.copy_(torch.cat([cast(a + f"{n}_proj.weight") for n in "qkv"]))
            layer.o_w.copy_(cast(a + "o_proj.weight"))
            m = p + "mlp."
            layer.gate_up_w.copy_(torch.cat([cast(m + "gate_proj.weight"), cast(m + "up_proj.weight")]))
            layer.down_w.copy_(cast(m + "down_proj.weight"))
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
        if fused.enabled() and not any(layer._forward_hooks for layer in self.layers):
            return self._forward_fused(fb, k_caches, v_caches, capture_layers)
        x = self.embed_tokens(fb.input_ids)
        cos = self.cos_table[fb.positions].unsqueeze(1)
        sin = self.sin_table[fb.positions].unsqueeze(1)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, fb, cos, sin, k_caches[i], v_caches[i])
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
            captured = ops.decoder_layers(
                x, h, stack[0], stack[1], self.cos_table, self.sin_table, fb.positions, fb.slot_mapping, k_caches,
                v_caches, fb.q_start, fb.ctx_slots, fb.ctx_start, fb.ctx_first, fb.mask, fb.mask_start,
                fb.causal and fb.mask is None, fb.window or 0, 1.0 / math.sqrt(self.cfg.head_dim), eps,
                list(capture_layers))
            if fb.logits_index is not None:
                x = x[fb.logits_index]
            return ops.rms_norm(x, self.norm, eps), captured
        captured = []
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out = layer.forward_fused(x, h, fb, self.cos_table, self.sin_table, k_caches[i], v_caches[i])
            if i + 1 < n:
                h = ops.add_rms_norm(x, out, self.layers[i + 1].input_norm, eps)
            else:
                x.add_(out)
            if i in capture_layers:
                captured.append(x.clone())  # x keeps changing in place
        if fb.logits_index is not None:
            x = x[fb.logits_index]
        return ops.rms_norm(x, self.norm, eps), captured

    def _layer_stack(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        """The layers' weights flattened for decoder_layers, when every projection is block-quantized and
        nothing runs between the ops but a qkv bias (no q/k norm or tensor-parallel all-reduce); else None.
        Built at the first forward after the weights are final (quantize_model swaps them in place)."""
        first = self.layers[0].qkv_w
        if self._stack is not None and self._stack[0] is first:
            return self._stack[1]
        stack = None
        names = ("qkv_w", "o_w", "gate_up_w", "down_w")
        if self.tp is None and all(isinstance(getattr(l, a), BlockQuantWeight) and l.q_norm is None
                                   and l.tp is None for l in self.layers for a in names):
            weights: list[torch.Tensor | None] = []
            dims: list[int] = []
            for layer in self.layers:
                for a in names:  # per projection: its row segments (a fused q|k|v may mix Q4_K and Q6_K)
                    segs = getattr(layer, a).segments
                    dims.append(len(segs))
                    for wp, wd, wm, n, fmt in segs:
                        weights += [wp, wd, wm]
                        dims += [n, fmt]
                weights += [layer.input_norm, layer.post_norm, layer.qkv_b]
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
