"""Q3_K → Q6_K and IQ4_NL → Q8_0 keep every value: gguf-py's dequantizer reads the same floats from both."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize
from gguf import GGMLQuantizationType as T

from specserve.formats.transcode import TRANSCODED, transcode


def _blocks(qtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with a finite fp16 d (the rest of the bytes any pattern)."""
    size = TRANSCODED[qtype][1]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == "Q3_K":
        b[:, 108:110] = d
    else:
        b[:, :2] = d
    return b


@pytest.mark.parametrize("qtype", list(TRANSCODED))
def test_rewrite_keeps_every_value(qtype: str) -> None:
    rng = np.random.default_rng(0)
    per_block = 256 if qtype == "Q3_K" else 32
    rows, blocks_per_row = 6, 4
    data = _blocks(qtype, rows * blocks_per_row, rng).reshape(rows, -1)
    out, out_type = transcode(data, qtype)
    assert out_type == TRANSCODED[qtype][0] and out.shape == (rows, blocks_per_row * TRANSCODED[qtype][2])
    want = dequantize(data, T[qtype]).reshape(rows, blocks_per_row * per_block)
    got = dequantize(out, T[out_type]).reshape(rows, blocks_per_row * per_block)
    assert np.array_equal(want, got)


def test_other_types_pass_through() -> None:
    data = np.zeros((2, 34), np.uint8)
    assert transcode(data, "Q8_0") == (data, "Q8_0")


def _write_model(path, kinds: dict[str, str]) -> dict[str, tuple[np.ndarray, str]]:  # noqa: ANN001
    """A one-layer llama GGUF (hidden 256: whole k-quant super-blocks) whose projections are stored in `kinds`
    (GGUF leaf → block type, random valid blocks); returns GGUF name → (raw blocks, type)."""
    import gguf

    from specserve.tokenizer.tokenizer import _bytes_to_unicode

    rng = np.random.default_rng(1)
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(_bytes_to_unicode().values()) + ["Ġt"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(128); w.add_embedding_length(256)  # noqa: E702
    w.add_feed_forward_length(512); w.add_head_count(4); w.add_head_count_kv(2)  # noqa: E702
    w.add_layer_norm_rms_eps(1e-6); w.add_rope_freq_base(10000.0); w.add_tokenizer_model("gpt2")  # noqa: E702
    w.add_tokenizer_pre("qwen2"); w.add_token_list(tokens); w.add_token_merges(["Ġ t"])  # noqa: E702
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3)); w.add_eos_token_id(2)  # noqa: E702
    w.add_tensor("token_embd.weight", (rng.standard_normal((len(tokens), 256)) * 0.5).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    raw = {}
    for leaf, (n, k) in shapes.items():
        kind = kinds.get(leaf, "Q8_0")
        if kind == "Q8_0":
            data = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), T.Q8_0)
        else:
            per = 256 if kind in ("Q3_K", "Q2_K", "IQ4_XS") else 32
            size = {"Q3_K": 110, "IQ4_NL": 18, "Q2_K": 84, "IQ4_XS": 136}[kind]
            data = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
            at = {"Q3_K": 108, "IQ4_NL": 0, "Q2_K": 80, "IQ4_XS": 0}[kind]
            data[..., at:at + 2] = (rng.standard_normal((n, k // per, 1)) * 2e-3).astype(np.float16).view(np.uint8)
            if kind == "Q2_K":  # dmin
                data[..., 82:84] = (rng.standard_normal((n, k // per, 1)) * 2e-3).astype(np.float16).view(np.uint8)
            data = data.reshape(n, -1)
        raw[f"blk.0.{leaf}.weight"] = (data, kind)
        w.add_tensor(f"blk.0.{leaf}.weight", data, raw_dtype=T[kind])
    for leaf in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{leaf}.weight", np.ones(256, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return raw


def test_q3_k_and_iq4_nl_files_serve_their_exact_values_on_the_integer_kernels(tmp_path) -> None:  # noqa: ANN001
    """Served by default (w4a8): Q3_K and IQ4_NL projections keep the file's values exactly (the packed weight the
    kernel multiplies equals gguf-py's dequantization); Q2_K and IQ4_XS load too, re-quantized; the model decodes
    close to the same file dequantized into fp32."""
    import torch

    from specserve.engine.llm import LLM
    from specserve.formats.gguf_file import GGUFFile
    from specserve.formats.quant import BlockQuantWeight
    from specserve.formats.quant_ref import K6
    from specserve.loading.gguf import unpermute_rotary
    from specserve.loading.gguf_stream import GGUFTensors
    from tests.tiny import ref_logits

    kinds = {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q3_K", "attn_output": "IQ4_NL", "ffn_gate": "Q2_K",
             "ffn_up": "IQ4_XS", "ffn_down": "Q3_K"}
    raw = _write_model(tmp_path / "m.gguf", kinds)
    fast = LLM(str(tmp_path / "m.gguf")).engine.model
    layer = fast.layers[0]
    assert isinstance(layer.qkv_w, BlockQuantWeight) and fast.cfg.architecture == "llama"

    # the file's Q3_K rows reach the kernel as Q6_K blocks, its IQ4_NL rows as Q8_0 ones, holding the same values
    assert {seg[4] for seg in layer.qkv_w.segments} == {seg[4] for seg in layer.down_w.segments} == {K6}
    assert {seg[4] for seg in layer.o_w.segments} == {8}
    tensors = GGUFTensors(GGUFFile(tmp_path / "m.gguf"), fast.cfg)
    for leaf, hf in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.o_proj"), ("ffn_down", "mlp.down_proj")):
        data, kind = raw[f"blk.0.{leaf}.weight"]
        want = torch.from_numpy(dequantize(data, T[kind]).reshape(data.shape[0], -1))
        heads = {"attn_q": 4, "attn_k": 2}.get(leaf)
        want = want if heads is None else unpermute_rotary(want, heads)
        codes = tensors.codes(f"model.layers.0.{hf}.weight")
        assert codes.qtype == TRANSCODED[kind][0] and torch.equal(codes.codes().dequantize(), want), leaf
    assert tensors.codes("model.layers.0.mlp.gate_proj.weight") is None  # Q2_K: re-quantized from its values
    exact = LLM(str(tmp_path / "m.gguf"), dtype="float32").engine.model
    ids = list(range(3, 40))
    # int8 activations, and Q2_K/IQ4_XS re-quantized to 4 bits: close, not equal (garbage would be near 0)
    assert torch.nn.functional.cosine_similarity(ref_logits(fast, ids), ref_logits(exact, ids), dim=-1).min() > 0.97
