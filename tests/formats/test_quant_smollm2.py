"""w4a8 on the bundled SmolLM2 GGUF (Q4_1 + Q8_0): the file's blocks kept exactly, batch invariance, speculation
lossless, and teacher-forced agreement with the fp32 model on held-out text."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.bench.quality import compare, held_out_text, teacher_forced_logits
from specserve.loading.pipeline import build_model
from specserve.formats.quant import BlockQuantWeight

SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.", "import numpy as np\n"]


@pytest.fixture(scope="module")
def w4a8() -> LLM:
    return LLM("smollm2-135m", quantization="w4a8", speculative_algorithm="NONE")


def test_gguf_blocks_equal_the_loaders_dequantized_weights() -> None:
    from specserve.loading.gguf import load_gguf
    from specserve.loading.checkpoint import resolve_model_path

    blocks: dict = {}
    _, weights, _ = load_gguf(resolve_model_path("smollm2-135m"), torch.float32, blocks)
    assert {c.bits for c in blocks.values()} == {4, 8}  # Q4_1 projections, Q8_0 embedding/head
    assert blocks["model.embed_tokens.weight"].bits == 8
    for name, codes in blocks.items():  # q/k rows unpermuted exactly like the float weights
        assert torch.equal(codes.dequantize(), weights[name]), name


def test_w4a8_head_and_layers_keep_the_files_blocks(w4a8: LLM) -> None:
    m = w4a8.engine.model
    assert isinstance(m.layers[0].gate_up_w, BlockQuantWeight)
    assert m.layers[0].qkv_w.bits == 4 and m.lm_head.bits == 8  # Q4_1 layers, Q8_0 tied head


def test_w4a8_batch_invariant(w4a8: LLM) -> None:
    together = [o.token_ids for o in w4a8.generate(PROMPTS, SP)]
    alone = [w4a8.generate([p], SP)[0].token_ids for p in PROMPTS]
    assert together == alone


def test_w4a8_speculation_lossless_one_request(w4a8: LLM) -> None:
    m = w4a8.engine.model
    spec = LLM.from_model(m, tokenizer=w4a8.engine.tokenizer, speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=5)
    for p in PROMPTS:
        assert spec.generate([p], SP)[0].token_ids == w4a8.generate([p], SP)[0].token_ids, p


def test_w4a8_agrees_with_fp32_teacher_forced(w4a8: LLM) -> None:
    fp32, tok = build_model("smollm2-135m", torch.float32)
    ids = held_out_text(tok, 256)
    r = compare(teacher_forced_logits(fp32, ids), teacher_forced_logits(w4a8.engine.model, ids), ids)
    assert r["agreement"] >= 0.94, r


def test_quantized_gguf_is_served_w4a8_by_default(tmp_path) -> None:  # noqa: ANN001
    from specserve.loading.checkpoint import open_checkpoint
    from specserve.loading.pipeline import default_quantization
    from tests.tiny import save_tiny_hf_dir, tiny_config, tiny_state_dict

    assert default_quantization(open_checkpoint("smollm2-135m"), "auto", None) == "w4a8"  # Q4_1 projections
    assert default_quantization(open_checkpoint("smollm2-135m"), "float32", None) is None  # an explicit dtype: exact float
    assert default_quantization(open_checkpoint("smollm2-135m"), "auto", "none") is None
    assert default_quantization(open_checkpoint("smollm2-135m"), "auto", "int4") == "int4"
    cfg = tiny_config("llama")
    assert default_quantization(open_checkpoint(str(save_tiny_hf_dir(cfg, tiny_state_dict(cfg), tmp_path / "hf"))), "auto", None) is None
    llm = LLM("smollm2-135m", speculative_algorithm="NONE")  # what `serve`/`generate`/`LLM(...)` get
    assert llm.config.quantization == "w4a8" and isinstance(llm.engine.model.layers[0].qkv_w, BlockQuantWeight)
    assert LLM("smollm2-135m", dtype="float32", speculative_algorithm="NONE").config.quantization is None


def test_bf16_kv_cache_lossless_and_batch_invariant(w4a8: LLM) -> None:
    """--kv-cache-dtype bfloat16 (w4a8): the pool is bf16, speculation equals plain decoding, a request's tokens do
    not depend on its batch; a pool dtype the model cannot take is refused naming the flag."""
    m, tok = w4a8.engine.model, w4a8.engine.tokenizer
    plain = LLM.from_model(m, tokenizer=tok, kv_cache_dtype="bfloat16", speculative_algorithm="NONE")
    spec = LLM.from_model(m, tokenizer=tok, kv_cache_dtype="bfloat16", speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=5)
    assert plain.engine.kv.k[0].dtype == torch.bfloat16 and plain.engine.kv.k[0].stride(0) == m.cfg.head_dim
    together = [o.token_ids for o in plain.generate(PROMPTS, SP)]
    assert together == [plain.generate([p], SP)[0].token_ids for p in PROMPTS]
    assert together == [o.token_ids for o in spec.generate(PROMPTS, SP)]
    with pytest.raises(ValueError, match="--kv-cache-dtype float32"):
        LLM("smollm2-135m", dtype="bfloat16", kv_cache_dtype="float32")
