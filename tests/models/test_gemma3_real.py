"""Gemma-3-270M Q4_K_M as a user meets it (scripts/fetch_gemma.py; `scripts/setup.sh test` fetches it): it loads
by default onto the integer kernels, its greedy text is coherent and NGRAM speculation equals plain decoding, and
its quantized logits agree with the file dequantized into fp32. Slow: loads the real model."""
from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.formats.quant import BlockQuantWeight

pytestmark = pytest.mark.slow
GEMMA = Path.home() / ".cache" / "specserve" / "models" / "gemma-3-270m-q4_k_m.gguf"
TEXTS = ["The capital of France is", "def fibonacci(n):\n", "Water boils at a temperature of",
         "import numpy as np\n\narr = np.array([1, 2, 3])\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma() -> Path:
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} is missing: python scripts/fetch_gemma.py")
    return GEMMA


def test_serves_by_default_and_ngram_equals_plain(gemma: Path) -> None:
    plain = LLM(str(gemma))
    cfg = plain.engine.model.cfg
    assert cfg.architecture == "gemma3" and cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    assert isinstance(plain.engine.model.layers[0].qkv_w, BlockQuantWeight)  # w4a8 by default
    tok = plain.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    want = [o.outputs[0].token_ids for o in plain.generate(ids, GREEDY)]
    assert "France" in tok.decode(want[0]) and "return" in tok.decode(want[1])  # as llama.cpp continues them
    ngram = LLM(str(gemma), speculative_algorithm="NGRAM")
    assert [o.outputs[0].token_ids for o in ngram.generate(ids, GREEDY)] == want
    assert ngram.engine.stats.num_accepted_tokens > 0


def test_quantized_logits_agree_with_fp32(gemma: Path) -> None:
    """Teacher-forced top-1 agreement of the default (w4a8) model with the file's weights dequantized to fp32,
    over held-out text; `specserve bench quality` puts llama.cpp beside it (docs/benchmarks.md)."""
    from specserve.bench.quality import compare, held_out_text, teacher_forced_logits

    fast = LLM(str(gemma))
    ids = held_out_text(fast.tokenizer, 256)
    exact = LLM(str(gemma), dtype="float32")
    r = compare(teacher_forced_logits(exact.engine.model, ids), teacher_forced_logits(fast.engine.model, ids), ids)
    assert r["agreement"] >= 0.9, r
