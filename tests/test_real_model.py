"""End-to-end on the embedded default SmolLM2-135M-Instruct (fp32): equality with HF transformers
and speculative == plain. Slow: loads the real model."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model_path

from .prompts import PROMPTS

pytestmark = pytest.mark.slow
NEW = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_greedy_matches_hf_transformers(plain: list[list[int]], prompt_ids: list[list[int]]) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = resolve_model_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    mismatches = 0
    for ids, ours in zip(prompt_ids, plain):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0, min_new_tokens=NEW)
        mismatches += out[0, len(ids):].tolist() != ours
    assert mismatches == 0, f"{mismatches}/{len(plain)} prompts differ from HF transformers"


@pytest.mark.parametrize("algo", ["NGRAM", "SYNTHETIC"])
def test_spec_equals_plain_on_smollm2(algo: str, prompt_ids: list[list[int]], plain: list[list[int]]) -> None:
    spec = LLM("smollm2-135m", dtype="float32", speculative_algorithm=algo, speculative_num_draft_tokens=5,
               speculative_synthetic_accept_rate=0.6)
    outs = spec.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0
