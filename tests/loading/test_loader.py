"""Checkpoint loading: GGUF + HF dirs (tokenizer parity: test_tokenizer.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.models.config import ModelConfig
from specserve.loading.gguf import load_gguf, unpermute_rotary
from specserve.loading.checkpoint import load_checkpoint, resolve_model_path
from specserve.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.test_tokenizer import MESSAGES, gguf_path  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    return load_checkpoint("smollm2-135m", torch.float32)


# ---- geometry -------------------------------------------------------------------------------
def test_smollm2_config(ours, gguf_path: Path) -> None:
    cfg, weights, tok = ours
    assert resolve_model_path("default") == resolve_model_path("SmolLM2-135M-Instruct") == gguf_path
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (9, 3, 64, 1536)
    assert cfg.vocab_size == 49152 == tok.vocab_size
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192 and abs(cfg.rms_norm_eps - 1e-5) < 1e-9
    assert not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and tok.eos_token_ids == (2,)
    assert not tok.add_bos
    assert "135M" in cfg.name
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert len(weights) == 2 + 30 * 9


def test_bf16_cast(gguf_path: Path) -> None:
    _, w, _ = load_gguf(gguf_path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in w.values())


# ---- weights equal HF's dequantization --------------------------------------------------------
def test_weights_match_transformers(ours, gguf_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers requires it for gguf_file=
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ref = model.state_dict()
    _, weights, _ = ours
    assert set(ref) - {"lm_head.weight"} == set(weights)
    for name, w in weights.items():
        assert w.shape == ref[name].shape, name
        torch.testing.assert_close(w, ref[name], atol=1e-6, rtol=0, msg=name)


def test_unpermute_inverts_converter_permute() -> None:
    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_rotary(permute(w, 3), 3), w)
    b = torch.randn(3 * 8)
    assert torch.equal(unpermute_rotary(permute(b, 3), 3), b)


# ---- HF directory ----------------------------------------------------------------------------
def _write_qwen2_dir(root: Path, tok: Tokenizer, arch: str = "Qwen2ForCausalLM") -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    h, inter, heads, kv, hd, vocab = 32, 64, 4, 2, 8, 49152
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "qwen2", "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
        "max_position_embeddings": 512, "eos_token_id": 0, "bos_token_id": None,
    }))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": tok.chat_template,
    }))
    tok.backend.save(str(root / "tokenizer.json"))
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g), "model.norm.weight": torch.ones(h)}
    for i in range(2):
        p = f"model.layers.{i}."
        for n, shape in {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h),
                         "self_attn.v_proj": (kv * hd, h)}.items():
            sd[p + n + ".weight"] = torch.randn(*shape, generator=g)
            sd[p + n + ".bias"] = torch.randn(shape[0], generator=g)
        sd[p + "self_attn.o_proj.weight"] = torch.randn(h, heads * hd, generator=g)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(inter, h, generator=g)
        sd[p + "mlp.up_proj.weight"] = torch.randn(inter, h, generator=g)
        sd[p + "mlp.down_proj.weight"] = torch.randn(h, inter, generator=g)
        sd[p + "input_layernorm.weight"] = torch.randn(h, generator=g)
        sd[p + "post_attention_layernorm.weight"] = torch.randn(h, generator=g)
    save_file(sd, str(root / "model.safetensors"))
    return sd


def test_hf_dir_loads(ours, tmp_path: Path) -> None:
    sd = _write_qwen2_dir(tmp_path / "tiny-qwen2", ours[2])
    cfg, weights, tok = load_checkpoint(str(tmp_path / "tiny-qwen2"), torch.bfloat16)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.num_layers == 2
    assert cfg.name == "tiny-qwen2" and cfg.head_dim == 8 and cfg.tie_word_embeddings
    assert set(weights) == set(sd)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    torch.testing.assert_close(weights["model.layers.1.self_attn.k_proj.bias"].float(),
                               sd["model.layers.1.self_attn.k_proj.bias"].bfloat16().float())
    assert set(cfg.eos_token_ids) == {0, 2} and tok.eos_token_ids[0] == 2
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == ours[2].encode("<|im_start|>user\nhi<|im_end|>")
    msgs = MESSAGES[1]
    assert tok.apply_chat_template(msgs) == ours[2].apply_chat_template(msgs)


# ---- tiny synthetic GGUFs (qwen2 layout, permutation, refusals) ----------------------------------
def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], qtype: str | None = None) -> None:
    import gguf

    from specserve.tokenizer.tokenizer import _bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(_bytes_to_unicode().values()) + ["Ġt"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny"); w.add_block_count(1); w.add_context_length(128)  # noqa: E702
    w.add_embedding_length(32); w.add_feed_forward_length(64); w.add_head_count(2)  # noqa: E702
    w.add_head_count_kv(1); w.add_layer_norm_rms_eps(1e-6); w.add_rope_freq_base(10000.0)  # noqa: E702
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("qwen2"); w.add_token_list(tokens)  # noqa: E702
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3)); w.add_token_merges(["Ġ t"])  # noqa: E702
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_add_bos_token(True)  # noqa: E702
    for name, arr in tensors.items():
        if qtype and arr.ndim == 2:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702


def _tiny_tensors(vocab: int, bias: bool) -> dict[str, np.ndarray]:
    # hidden 32 (one Q8_0/Q5_0 block per row), 2 heads x 16, 1 kv head, ffn 64
    r = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, 32), "output_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32),
              "blk.0.attn_k.weight": (16, 32), "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64),
              "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,)}
    if bias:
        shapes.update({"blk.0.attn_q.bias": (32,), "blk.0.attn_k.bias": (16,), "blk.0.attn_v.bias": (16,)})
    return {k: r.standard_normal(v).astype(np.float32) for k, v in shapes.items()}


def test_tiny_qwen2_gguf_not_permuted(tmp_path: Path) -> None:
    t = _tiny_tensors(260, bias=True)
    _write_gguf(tmp_path / "q.gguf", "qwen2", t)
    cfg, w, tok = load_checkpoint(str(tmp_path / "q.gguf"), torch.float32)
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.vocab_size == 260 and cfg.name == "tiny"
    assert np.array_equal(w["model.layers.0.self_attn.q_proj.weight"].numpy(), t["blk.0.attn_q.weight"])
    assert np.array_equal(w["model.layers.0.self_attn.k_proj.bias"].numpy(), t["blk.0.attn_k.bias"])
    assert tok.add_bos and tok.encode("<|im_end|> t")[:2] == [1, 2]
    assert tok.encode(" t", add_special_tokens=False) == [259]


def test_tiny_llama_gguf_unpermuted(tmp_path: Path) -> None:
    t = _tiny_tensors(260, bias=False)
    hf_q, hf_k = t["blk.0.attn_q.weight"].copy(), t["blk.0.attn_k.weight"].copy()
    perm = lambda w, n: w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # noqa: E731
    t["blk.0.attn_q.weight"], t["blk.0.attn_k.weight"] = perm(hf_q, 2), perm(hf_k, 1)
    _write_gguf(tmp_path / "l.gguf", "llama", t, qtype="Q8_0")
    _, w, _ = load_gguf(tmp_path / "l.gguf", torch.float32)
    # Q8_0 rounding: within one quant step of the HF-layout original
    assert np.allclose(w["model.layers.0.self_attn.q_proj.weight"].numpy(), hf_q, atol=0.05)
    assert np.allclose(w["model.layers.0.self_attn.k_proj.weight"].numpy(), hf_k, atol=0.05)


def test_unsupported_quant_type_refused(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "mx.gguf", "llama", _tiny_tensors(260, bias=False), qtype="MXFP4")
    with pytest.raises(ValueError, match="MXFP4.*supported: F32"):
        load_gguf(tmp_path / "mx.gguf", torch.float32)


def test_q5_0_loads(tmp_path: Path) -> None:
    """Q4_K_M files (the Qwen pair) mix in Q5_0 tensors."""
    _write_gguf(tmp_path / "q5.gguf", "llama", _tiny_tensors(260, bias=False), qtype="Q5_0")
    cfg, weights, _ = load_gguf(tmp_path / "q5.gguf", torch.float32)
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (64, 32)


# ---- errors ----------------------------------------------------------------------------------
def test_unknown_architecture_errors(ours, tmp_path: Path) -> None:
    _write_gguf(tmp_path / "g.gguf", "gpt2", _tiny_tensors(260, bias=False))
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_checkpoint(str(tmp_path / "g.gguf"), torch.float32)
    _write_qwen2_dir(tmp_path / "hf", ours[2], arch="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported"):
        load_checkpoint(str(tmp_path / "hf"), torch.float32)


def test_an_unsupported_family_is_refused_by_name_before_its_tensors(tmp_path: Path) -> None:
    """A family we do not run (its layers carry tensors ours lack) is refused naming the architecture and the
    supported list, not the first tensor we cannot place; an unexpected tensor in a supported family names it."""
    extra = {**_tiny_tensors(260, bias=False), "blk.0.post_attention_norm.weight": np.ones(32, np.float32)}
    _write_gguf(tmp_path / "s2.gguf", "starcoder2", extra)
    with pytest.raises(ValueError, match="s2.gguf: unsupported model architecture 'starcoder2'; supported: llama, qwen2"):
        load_checkpoint(str(tmp_path / "s2.gguf"), torch.float32)
    _write_gguf(tmp_path / "l.gguf", "llama", extra)
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.post_attention_norm.weight' for a llama model"):
        load_checkpoint(str(tmp_path / "l.gguf"), torch.float32)


def test_missing_path_and_files_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*smollm2-135m"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_checkpoint(str(tmp_path / "empty"), torch.float32)
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(str(tmp_path / "empty"), torch.float32)
