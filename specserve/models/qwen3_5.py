"""Qwen3.5 text decoder (`Qwen3_5ForCausalLM`): Gated DeltaNet recurrent layers mixed with gated
attention layers (`layer_types`), each followed by a SwiGLU MLP.

Differences from the Llama family, all from the HF reference: RMSNorms scale by (1 + w) (folded into the
weight at load), attention has an output gate (q_proj emits [q | gate] per head; o = attn · σ(gate)),
q/k RMS-normed per head, RoPE on the first head_dim · partial_rotary_factor dims only. Recurrent layers
keep their state in a `StatePool` slot per request (cache/state_pool.py), attention layers in the
paged KV pool. A forward reads the slots and returns the new states (`fb.states`); it never writes
them: the commit stage picks the accepted row's state (speculative/commit.py, CommitState).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, checked_layer_types, decoder_from_hf
from .attention import paged_attention
from .forward_batch import ForwardBatch
from .gated_delta import RowLayout, causal_conv, delta_rule


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent state and its math run in fp32 under bf16 (as the reference does), else in the model dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _p(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [T, heads, hd]; the rest pass through."""
    rd = cos.shape[-1]
    r, rest = x[..., :rd], x[..., rd:]
    r1, r2 = r.chunk(2, dim=-1)
    return torch.cat([r * cos + torch.cat((-r2, r1), dim=-1) * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nkv, self.hd, self.eps = cfg.num_heads, cfg.num_kv_heads, hd, cfg.rms_norm_eps
        self.q_w = _p(2 * self.nq * hd, h, dtype=dtype)  # per head [q | gate]
        self.kv_w = _p(2 * self.nkv * hd, h, dtype=dtype)
        self.q_norm, self.k_norm = _p(hd, dtype=dtype), _p(hd, dtype=dtype)
        self.o_w = _p(h, self.nq * hd, dtype=dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        q, gate = F.linear(h, self.q_w).view(T, self.nq, 2 * self.hd).chunk(2, dim=-1)
        k, v = F.linear(h, self.kv_w).view(T, 2 * self.nkv, self.hd).split(self.nkv, dim=1)
        q = _rope(F.rms_norm(q, (self.hd,), self.q_norm, self.eps), cos, sin)
        k = _rope(F.rms_norm(k, (self.hd,), self.k_norm, self.eps), cos, sin)
        o = paged_attention(q, k.contiguous(), v.contiguous(), fb, k_cache, v_cache)
        return F.linear(o * torch.sigmoid(gate.reshape(T, -1)), self.o_w)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.index = index  # among the recurrent layers: its state tensors in the pool
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps, self.sdt = cfg.rms_norm_eps, state_dtype(dtype)
        self.qkv_w = _p(cfg.conv_dim, h, dtype=dtype)
        self.z_w = _p(self.hv * self.dv, h, dtype=dtype)
        self.ba_w = _p(2 * self.hv, h, dtype=dtype)  # b (β's logit) | a (the decay's input)
        self.conv_w = _p(cfg.conv_dim, cfg.linear_conv_kernel, dtype=dtype)
        self.dt_bias, self.A_log = _p(self.hv, dtype=dtype), _p(self.hv, dtype=dtype)
        self.norm = _p(self.dv, dtype=dtype)
        self.out_w = _p(h, self.hv * self.dv, dtype=dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, lay: RowLayout) -> torch.Tensor:
        T, sdt, st = h.shape[0], self.sdt, fb.states
        B = len(lay.last)
        K1 = self.conv_w.shape[1] - 1
        conv0 = torch.zeros(B, K1, self.conv_w.shape[0], dtype=sdt)
        rec0 = torch.zeros(B, self.hv, self.dk, self.dv, dtype=sdt)
        if st is not None:
            live = torch.tensor([s >= 0 for s in st.slots])
            slots = torch.tensor([max(s, 0) for s in st.slots])
            conv0[live] = st.conv[self.index][slots[live]]
            rec0[live] = st.rec[self.index][slots[live]]
        x, win = causal_conv(F.linear(h, self.qkv_w).to(sdt), conv0, self.conv_w.to(sdt), lay)
        q, k, v = x.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        b, a = F.linear(h, self.ba_w).to(sdt).chunk(2, dim=-1)
        g = -self.A_log.to(sdt).exp() * F.softplus(a + self.dt_bias.to(sdt))
        keep = st is not None and st.keep_rows
        o, rec = delta_rule(q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk), v.view(T, self.hv, self.dv),
                            g, b.sigmoid(), rec0, lay, keep or st is not None and st.parents is not None)
        if st is not None:
            st.conv_out.append(win if keep else win[lay.last])
            st.rec_out.append(rec)
        # gated RMSNorm per value head: norm(o) · w · silu(z)
        o = F.rms_norm(o, (self.dv,), self.norm.to(sdt), self.eps)
        o = o * F.silu(F.linear(h, self.z_w).to(sdt).view(T, self.hv, self.dv))
        return F.linear(o.reshape(T, -1).to(h.dtype), self.out_w)


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kind: str, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eps, self.recurrent = eps, kind == "linear_attention"
        self.index = index  # its K/V (attention) or state (recurrent) among layers of its kind
        self.mixer = GatedDeltaNet(cfg, dtype, index) if self.recurrent else GatedAttention(cfg, dtype)
        self.input_norm, self.post_norm = _p(h, dtype=dtype), _p(h, dtype=dtype)
        self.gate_up_w = _p(2 * cfg.intermediate_size, h, dtype=dtype)
        self.down_w = _p(h, cfg.intermediate_size, dtype=dtype)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor, lay: RowLayout,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        if self.recurrent:
            x = x + self.mixer(h, fb, lay)
        else:
            x = x + self.mixer(h, fb, cos, sin, k_caches[self.index], v_caches[self.index])
        gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), self.post_norm, self.eps), self.gate_up_w).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_w)


class Qwen35Model(nn.Module):
    """The target interface of LlamaModel: cfg, dtype, forward(fb, k_caches, v_caches, capture_layers),
    compute_logits. `fb.states` carries the recurrent state (None: every request starts from zeros)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        counts = {"full_attention": 0, "linear_attention": 0}
        layers = []
        for kind in cfg.layer_types:
            layers.append(HybridLayer(cfg, dtype, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.embed = _p(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.norm = _p(cfg.hidden_size, dtype=dtype)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _p(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        rd = int(cfg.head_dim * cfg.partial_rotary_factor)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_table", emb.sin().to(dtype), persistent=False)

    def embedding_table(self) -> torch.Tensor:
        return self.embed

    @torch.no_grad()
    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """HF names (`model.` or the multimodal `model.language_model.` prefix); (1 + w) norms folded."""
        pre = "model.language_model." if "model.language_model.embed_tokens.weight" in sd else "model."
        get = lambda n: sd[pre + n].to(self.dtype)  # noqa: E731
        one = lambda n: 1.0 + get(n)  # noqa: E731  Qwen3.5 RMSNorm scales by (1 + weight)
        self.embed.copy_(get("embed_tokens.weight"))
        self.norm.copy_(one("norm.weight"))
        if not self.cfg.tie_word_embeddings:
            self.lm_head.copy_(sd["lm_head.weight"].to(self.dtype))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            layer.input_norm.copy_(one(p + "input_layernorm.weight"))
            layer.post_norm.copy_(one(p + "post_attention_layernorm.weight"))
            layer.gate_up_w.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            layer.down_w.copy_(get(p + "mlp.down_proj.weight"))
            m = layer.mixer
            if layer.recurrent:
                a = p + "linear_attn."
                m.qkv_w.copy_(get(a + "in_proj_qkv.weight"))
                m.z_w.copy_(get(a + "in_proj_z.weight"))
                m.ba_w.copy_(torch.cat([get(a + "in_proj_b.weight"), get(a + "in_proj_a.weight")]))
                m.conv_w.copy_(get(a + "conv1d.weight").squeeze(1))
                m.dt_bias.copy_(get(a + "dt_bias"))
                m.A_log.copy_(get(a + "A_log"))
                m.norm.copy_(get(a + "norm.weight"))  # the gated norm scales by w itself
                m.out_w.copy_(get(a + "out_proj.weight"))
            else:
                a = p + "self_attn."
                m.q_w.copy_(get(a + "q_proj.weight"))
                m.kv_w.copy_(torch.cat([get(a + "k_proj.weight"), get(a + "v_proj.weight")]))
                m.q_norm.copy_(one(a + "q_norm.weight"))
                m.k_norm.copy_(one(a + "k_norm.weight"))
                m.o_w.copy_(get(a + "o_proj.weight"))

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        st = fb.states
        if st is not None:
            if st.parents is not None and not st.keep_rows:
                raise ValueError("tree rows need keep_rows: their states are picked per path")
            st.conv_out.clear()
            st.rec_out.clear()
        lay = RowLayout.build(fb.q_start, None if st is None else st.parents)
        x = F.embedding(fb.input_ids, self.embed)
        cos = self.cos_table[fb.positions].unsqueeze(1)
        sin = self.sin_table[fb.positions].unsqueeze(1)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, fb, cos, sin, lay, k_caches, v_caches)
            if i in capture_layers:
                captured.append(x)
        if fb.logits_index is not None:
            x = x[fb.logits_index]
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.rms_norm_eps), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()


def config_from_hf(cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
    """Qwen3.5 text config (`Qwen3_5ForCausalLM`, or the `text_config` of the multimodal checkpoint)."""
    cfg = cfg.get("text_config") or cfg
    n = cfg["num_hidden_layers"]
    types = checked_layer_types(cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention" for i in range(n)],
        n, ("full_attention", "linear_attention"))
    if "full_attention" not in types:
        raise ValueError("config.json layer_types: a qwen3_5 model needs at least one full_attention layer")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_parameters.rope_type {rope.get('rope_type')!r} for qwen3_5; supported: default")
    return decoder_from_hf(
        cfg, arch, name, qk_norm=True, layer_types=types, rope_scaling=None,
        partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
        linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"], linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"])


MODEL = Qwen35Model
