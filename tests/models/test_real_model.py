"""End-to-end on the embedded default SmolLM2-135M-Instruct (fp32): equality with HF transformers
and speculative == plain. Slow: loads the real model."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.loading.checkpoint import resolve_model_path

from tests.prompts import PROMPTS

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
    rate = {"speculative_synthetic_accept_rate": 0.6} if algo == "SYNTHETIC" else {}
    spec = LLM("smollm2-135m", dtype="float32", speculative_algorithm=algo, speculative_num_draft_tokens=5, **rate)
    outs = spec.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0


@pytest.fixture(scope="module")
def smollm2_drafters(tmp_path_factory, llm: LLM) -> dict[str, str]:  # noqa: ANN001
    """The shipped DSpark and EAGLE-3 drafters; a DFlash made from the shipped DSpark by dropping its
    Markov and confidence heads (a DFlash net is exactly that); an untrained MTP module."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from specserve.drafters.artifact import build_net, read_config, save_drafter, shipped_drafter
    from specserve.drafters.nets import DrafterConfig

    cfg = llm.engine.model.cfg
    out = {a: str(shipped_drafter(cfg, a.lower())) for a in ("DSPARK", "EAGLE3")}
    tmp = tmp_path_factory.mktemp("smollm2-drafters")
    src = shipped_drafter(cfg, "dspark")
    dcfg = replace(read_config(src), algorithm="dflash", markov_rank=0)
    sd = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith(("markov", "conf"))}
    (tmp / "dflash").mkdir()
    save_file(sd, str(tmp / "dflash" / "model.safetensors"))
    (tmp / "dflash" / "config.json").write_text(dcfg.to_json())
    torch.manual_seed(0)
    save_drafter(build_net(DrafterConfig.for_target("mtp", cfg)), tmp / "mtp", "untrained, for tests")
    out.update(DFLASH=str(tmp / "dflash"), MTP=str(tmp / "mtp"))
    return out


@pytest.mark.parametrize("algo", ["DSPARK", "EAGLE3", "DFLASH", "MTP"])
def test_learned_drafters_equal_plain_on_smollm2(algo: str, smollm2_drafters: dict[str, str],
                                                 prompt_ids: list[list[int]], plain: list[list[int]]) -> None:
    spec = LLM("smollm2-135m", dtype="float32", speculative_algorithm=algo,
               speculative_draft_model_path=smollm2_drafters[algo])
    outs = spec.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    if algo != "MTP":  # trained drafters get real acceptance
        assert sum(o.meta_info["spec_accepted_tokens"] for o in outs) > 0
    if algo in ("DSPARK", "EAGLE3"):  # the shipped ones: τ ≈ 1.3 measured (docs/benchmarks.md)
        tau = sum(o.meta_info["spec_accept_length"] for o in outs) / len(outs)
        assert tau > 1.1, tau


def test_shipped_ngram_table_is_the_cli_default() -> None:
    """AUTO: NGRAM over the table shipped for SmolLM2 (cost windows); a learned-drafter flag picks HYBRID over
    the shipped DSpark."""
    from specserve.cli import _default_drafter, build_parser

    a = build_parser().parse_args(["generate", "--prompt", "x"])
    _default_drafter(a)
    llm = LLM("smollm2-135m", speculative_algorithm=a.speculative_algorithm)
    assert a.speculative_algorithm == "AUTO" and llm.engine.drafter.label == "NGRAM(table)"
    assert llm.config.speculative_algorithm == "NGRAM" and llm.config.speculative_window == "cost"
    assert llm.engine.drafter.table.meta.vocab_size == 49152 and llm.engine.drafter.lookups.own.min_match == 2
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    plain = LLM("smollm2-135m", speculative_algorithm="none")
    assert plain.engine.drafter is None
    assert out.token_ids == plain.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].token_ids
    hybrid = LLM("smollm2-135m", speculative_algorithm="AUTO", speculative_block_size=4)
    assert hybrid.engine.drafter.label == "HYBRID(NGRAM+DSPARK)" and hybrid.config.speculative_window == "cost"
    # the table flag is HYBRID's too (it drafts where a draft model is off): with a block flag, HYBRID takes both
    both = LLM("smollm2-135m", speculative_algorithm="AUTO", speculative_block_size=4, speculative_ngram_table="none")
    assert both.config.speculative_algorithm == "HYBRID" and both.engine.drafter.table is None



@pytest.fixture(scope="module")
def plain_logprobs(llm: LLM, prompt_ids: list[list[int]]) -> list:
    return llm.generate(prompt_ids[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))


@pytest.mark.parametrize("algo,opts", [("DSPARK", {}), ("EAGLE3", {}),
                                       ("EAGLE3", {"speculative_eagle_topk": 4, "speculative_num_steps": 4})],
                         ids=["dspark", "eagle3", "eagle3-tree"])
def test_shipped_drafters_logprobs_equal_plain(algo: str, opts: dict, prompt_ids: list[list[int]], plain_logprobs: list,
                                               smollm2_drafters: dict[str, str]) -> None:
    """The shipped drafters on the real target: greedy logprobs (chosen token, top-5 ids and values) of
    every emitted token equal plain decoding's; fp32, so values agree up to batch-shape rounding.
    Catches logprobs read from the wrong verify row (or a tree's node order) on a real vocabulary."""
    spec = LLM("smollm2-135m", dtype="float32", speculative_algorithm=algo,
               speculative_draft_model_path=smollm2_drafters[algo], **opts)
    outs = spec.generate(prompt_ids[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5))
    assert spec.engine.stats.num_accepted_tokens > 0
    for a, b in zip(plain_logprobs, outs):
        assert b.token_ids == a.token_ids and len(b.logprobs) == 16
        for la, lb in zip(a.logprobs, b.logprobs):
            assert lb.token_id == la.token_id and abs(lb.logprob - la.logprob) <= 2e-4
            assert [i for i, _ in lb.top[:3]] == [i for i, _ in la.top[:3]]  # (near-ties further down may swap)
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) <= 2e-4
