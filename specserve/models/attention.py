"""Attention blocks every decoder family composes: RoPE tables, and paged attention over the KV pool with a
layer's own sliding window, scale and score soft-cap."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import fused
from .config import ModelConfig
from .forward_batch import ForwardBatch


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Inverse frequencies, scaled as the config asks (as HF computes them). `theta`: another base (gemma3's
    sliding layers); `scaled=False`: no rope_scaling (those layers are unscaled)."""
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    rs = (cfg.rope_scaling or {}) if scaled else {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "longrope":  # phi3: per-dim divisors; the config reader keeps the context within the original
        return inv / torch.tensor(rs["short_factor"], dtype=torch.float64)
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, longrope")
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled_inv = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled_inv / factor + smooth * scaled_inv
    is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(is_mid, mid, scaled_inv)


def rope_tables(cfg: ModelConfig, dtype: torch.dtype, theta: float | None = None, scaled: bool = True,
                positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions (default max_position_embeddings), head_dim] (rotate-half layout). longrope scales
    both by its attention factor, as HF does."""
    n = cfg.max_position_embeddings if positions is None else positions
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), rope_inv_freq(cfg, theta, scaled))
    emb = torch.cat((freqs, freqs), dim=-1)
    rs = (cfg.rope_scaling or {}) if scaled else {}
    mult = 1.0
    if rs.get("rope_type", rs.get("type")) == "longrope":
        orig = rs["original_max_position_embeddings"]
        factor = rs["factor"]
        mult = rs.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0)
    return (emb.cos() * mult).to(dtype), (emb.sin() * mult).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/sin [T, 1, hd]. Non-interleaved (rotate-half) layout, as HF."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] of the packed new tokens → attention output [T, H * hd].
    Writes k/v at fb.slot_mapping, then attends over each request's context slots. `window`: the layer's
    sliding window (on top of fb.window); `scale`: q·k multiplier (default hd ** -0.5); `softcap`: scores
    → cap · tanh(scores / cap) before the softmax. Fused (ragged, C++) when the extension is on and no
    soft-cap is asked for, else the padded pure-torch reference below."""
    # NOTE: new K/V land in the pool first; the context read below includes them.
    k_cache.index_copy_(0, fb.slot_mapping, k.to(k_cache.dtype))  # a bf16 pool under fp32: rounded once, here
    v_cache.index_copy_(0, fb.slot_mapping, v.to(v_cache.dtype))
    if fused.enabled() and softcap is None:
        return fused.attention(q, fb, k_cache, v_cache, window, scale)
    return reference_attention(q, fb, k_cache, v_cache, window, scale, softcap)


def reference_attention(q: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        window: int | None = None, scale: float | None = None, softcap: float | None = None
                        ) -> torch.Tensor:
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
    mask = pd.attn_mask
    if window is not None:  # NOTE: a query always sees itself (window ≥ 1), so no valid row is empty
        inside = (pd.kv_pos[:, None, :] > pd.q_pos[:, :, None] - window) | ~pd.q_valid[:, :, None]
        inside = inside[:, None]  # padded rows keep a finite row: discarded
        mask = inside if mask is None else mask & inside
    if softcap is None:
        o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=mask, scale=scale, enable_gqa=nq != k_cache.shape[1])
    else:
        g = nq // k_cache.shape[1]
        kc, vc = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)
        s = qp @ kc.transpose(-1, -2) * (hd ** -0.5 if scale is None else scale)
        s = softcap * torch.tanh(s / softcap)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, dim=-1) @ vc
    o = o.transpose(1, 2)
    return o.reshape(T, -1) if uq else o[pd.q_valid].reshape(T, -1)  # back to packed order
