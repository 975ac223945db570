"""Tiny random Llama-family models for exactness tests (fp64 by default)."""
from __future__ import annotations

import torch

from specserve.models.config import ModelConfig
from specserve.models.llama import LlamaModel


def tiny_config(arch: str = "llama", vocab: int = 97, layers: int = 2, **kw) -> ModelConfig:
    base = dict(architecture=arch, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=layers,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=arch == "llama",
                attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", eos_token_ids=(), name=f"tiny-{arch}")
    base.update(kw)
    return ModelConfig(**base)


def tiny_state_dict(cfg: ModelConfig, seed: int = 0, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h) * 3, "model.norm.weight": 1 + r(h) * 0.1}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(cfg.vocab_size, h) * 3
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = 1 + r(h) * 0.1
        sd[p + "post_attention_layernorm.weight"] = 1 + r(h) * 0.1
        sd[p + "self_attn.q_proj.weight"] = r(cfg.num_heads * hd, h)
        sd[p + "self_attn.k_proj.weight"] = r(cfg.num_kv_heads * hd, h)
        sd[p + "self_attn.v_proj.weight"] = r(cfg.num_kv_heads * hd, h)
        sd[p + "self_attn.o_proj.weight"] = r(h, cfg.num_heads * hd)
        if cfg.attention_bias:
            for n, d in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                sd[p + f"self_attn.{n}_proj.bias"] = r(d * hd)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = 1 + r(hd) * 0.1
            sd[p + "self_attn.k_norm.weight"] = 1 + r(hd) * 0.1
        sd[p + "mlp.gate_proj.weight"] = r(i, h)
        sd[p + "mlp.up_proj.weight"] = r(i, h)
        sd[p + "mlp.down_proj.weight"] = r(h, i)
    return sd


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float64, seed: int = 0, **kw) -> LlamaModel:
    cfg = tiny_config(arch, **kw)
    m = LlamaModel(cfg, dtype)
    m.load_weights(tiny_state_dict(cfg, seed))
    return m


def reference_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """Plain full-recompute greedy decoding with no cache reuse: the oracle for engine tests."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    ids = list(prompt)
    out = []
    for _ in range(n):
        kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
        pt: list[int] = []
        kv.ensure(pt, len(ids))
        logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [[len(ids) - 1]])
        t = int(logits[0][0].argmax())
        ids.append(t)
        out.append(t)
    return out


def save_tiny_hf_dir(cfg: ModelConfig, sd: dict[str, torch.Tensor], path) -> str:  # noqa: ANN001
    """Write an HF-style checkpoint dir (config.json, model.safetensors, a word-level tokenizer.json)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.architecture]
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": list(cfg.eos_token_ids) or None, "torch_dtype": "float64"}))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return str(path)


def ref_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Full forward of ids from scratch: row j = logits after ids[: j + 1]."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [list(range(len(ids)))])
    return logits[0]


def target_and_draft_dirs(root) -> dict[str, str]:  # noqa: ANN001
    """A tiny llama target and a 1-layer qwen2 draft of the same vocabulary, saved as HF dirs."""
    cfg, dcfg = tiny_config("llama"), tiny_config("qwen2", layers=1)
    return {"target": save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=1), root / "target"),
            "small": save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=2), root / "small")}
