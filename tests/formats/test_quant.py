"""--quantization int4 / w4a8 / w8a8 on models: conversion, speculation lossless, batch invariance."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.formats.quant import GROUP, BlockQuantWeight, Int4Weight, quantize_blocks, quantize_model

from tests.tiny import ref_logits, tiny_model

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_quantize_blocks_within_half_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    g = w.reshape(64, -1, GROUP)
    for bits, step in ((4, (g.amax(-1) - g.amin(-1)) / 15), (8, g.abs().amax(-1) / 127)):
        err = (quantize_blocks(w, bits).dequantize() - w).abs()
        assert bool((err <= step.repeat_interleave(GROUP, dim=1) / 2 * 1.001 + 1e-7).all())


def test_int4_weight_is_the_blocks_in_fp32() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    codes = quantize_blocks(w, 4)
    q = Int4Weight(codes, torch.float32)
    assert torch.allclose(q.dequantize(), codes.dequantize(), atol=1e-6)  # fp32 scales: no bf16 drift
    x = torch.randn(5, 96)
    assert torch.allclose(q(x), x @ codes.dequantize().T, atol=1e-4)


def test_int4_model_generates_and_speculates() -> None:
    m = tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(m, "int4")
    assert isinstance(m.layers[0].qkv_w, Int4Weight)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM.from_model(m).generate(prompts, sp)
    spec_llm = LLM.from_model(m, speculative_algorithm="SYNTHETIC", speculative_synthetic_accept_rate=1.0)
    spec = spec_llm.generate(prompts, sp)
    assert all(len(o.token_ids) == 12 for o in plain + spec)
    assert spec_llm.engine.stats.num_accepted_tokens > 0
    # bf16 kernels see different shapes in verify than in decode, so equality holds up to near-ties:
    # every token (plain and speculative) is within bf16 rounding of the argmax of a from-scratch forward
    # of the same int4 model, and the two runs agree up to the first position whose top-2 logits are
    # that close. Fails on a wrong int4 matmul for multi-row (verify-shaped) inputs, a KV slot written
    # or read wrongly under speculation, or an accepted draft that was not the target's choice.
    _assert_same_up_to_ties(m, prompts, plain, spec, tol=0.25)  # two bf16 ulps at |logit| ≈ 16-32


def _assert_same_up_to_ties(m, prompts: list[list[int]], plain: list, spec: list, tol: float) -> None:  # noqa: ANN001
    """Every token (plain and speculative) is within `tol` of the argmax of a from-scratch forward of m,
    and the two runs agree up to the first position whose top-2 logits are that close."""
    for p, a, b in zip(prompts, plain, spec):
        for out in (a.token_ids, b.token_ids):
            rows = ref_logits(m, p + out[:-1])[len(p) - 1 :]
            assert all(float(r.max() - r[t]) <= tol for r, t in zip(rows, out)), out
        rows = ref_logits(m, p + a.token_ids[:-1])[len(p) - 1 :]
        top2 = rows.topk(2, dim=-1).values
        tie = next((j for j, (x, y) in enumerate(top2.tolist()) if x - y <= tol), len(rows))
        assert b.token_ids[:tie] == a.token_ids[:tie]


def _int4_rows_independent(m) -> bool:  # noqa: ANN001
    """Whether torch's int4 kernel gives a row the same bits in a 20-row call (verify) as alone (decode),
    for every int4 weight of m: true on the CPUs measured (AVX512, fp32), not promised by torch."""
    ws = [w for layer in m.layers for w in vars(layer).values() if isinstance(w, Int4Weight)]
    assert ws
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(20, w.shape[1], generator=g).to(w.dtype) for w in ws]
    return all(torch.equal(w(x), torch.cat([w(r) for r in x.split(1)])) for w, x in zip(ws, xs))


@pytest.mark.parametrize("mode", ["w4a8", "w8a8", "int4"])
def test_quantized_model_speculation_equals_plain(mode: str) -> None:
    """Greedy speculation == plain decoding of the same quantized model, token for token (int4: where the
    kernel is row-independent, else up to near-ties of a from-scratch forward)."""
    m = tiny_model("llama", dtype=torch.float32)
    quantize_model(m, mode)
    kind = Int4Weight if mode == "int4" else BlockQuantWeight
    assert isinstance(m.layers[0].qkv_w, kind)
    assert isinstance(m.lm_head, kind) or mode == "int4"  # int4 needs N % 16 == 0: vocab 97 stays dense
    plain = LLM.from_model(m).generate(PROMPTS, SP)
    assert all(len(o.token_ids) == 12 for o in plain)
    exact = mode != "int4" or _int4_rows_independent(m)
    for algo in ("SYNTHETIC", "NGRAM"):
        extra = {"speculative_synthetic_accept_rate": 0.7} if algo == "SYNTHETIC" else {}
        llm = LLM.from_model(m, speculative_algorithm=algo, **extra)
        spec = llm.generate(PROMPTS, SP)
        assert llm.engine.stats.num_accepted_tokens > 0, algo  # verify really ran multi-row and accepted
        if exact:
            assert [o.token_ids for o in spec] == [o.token_ids for o in plain], algo
        else:
            _assert_same_up_to_ties(m, PROMPTS, plain, spec, tol=1e-4)


@pytest.mark.parametrize("mode", ["w4a8", "w8a8"])
def test_quantized_model_is_batch_invariant(mode: str) -> None:
    """A request's greedy tokens do not depend on which requests share its batch (tiny qwen2: with bias)."""
    m = tiny_model("qwen2", dtype=torch.float32)
    quantize_model(m, mode)
    llm = LLM.from_model(m)
    together = [o.token_ids for o in llm.generate(PROMPTS, SP)]
    alone = [llm.generate([p], SP)[0].token_ids for p in PROMPTS]
    assert together == alone


def test_quantization_dtype_errors_name_the_flag() -> None:
    m = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(ValueError, match="--quantization w4a8.*float32"):
        quantize_model(m, "w4a8")
    with pytest.raises(ValueError, match="--quantization: unknown"):
        quantize_model(tiny_model("llama", dtype=torch.float32), "int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_keeps_an_8bit_file_head(dtype: torch.dtype) -> None:
    """A GGUF's Q8_0 head stays 8-bit under int4 (4-bit re-quantization of it was int4's drift)."""
    m = tiny_model("llama", dtype=dtype)
    codes = quantize_blocks(m.embed.float(), 8)
    quantize_model(m, "int4", {"model.embed_tokens.weight": codes})
    assert isinstance(m.lm_head, BlockQuantWeight) and m.lm_head.bits == 8
    h = torch.randn(3, m.cfg.hidden_size).to(dtype)
    assert torch.equal(m.compute_logits(h), m.lm_head(h))
    assert torch.allclose(m.compute_logits(h), h.float() @ codes.dequantize().T, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("mode", ["w4a8", "w8a8"])
def test_quantized_model_same_tokens_and_logits_on_every_kernel_path(mode: str, monkeypatch) -> None:  # noqa: ANN001
    """SPECSERVE_QUANT_IMPL=amx (forced for every M) / vnni / avx2 / portable, each the CPU has: the same logits
    bit for bit and the same speculative tokens as auto (which mixes VNNI for decode with AMX for verify)."""
    m = tiny_model("llama", dtype=torch.float32)
    quantize_model(m, mode)  # loads the kernels
    isa = torch.ops.specserve.quant_isa()
    forced = [i for i, name in (("amx", "amx"), ("vnni", "avx512vnni"), ("avx2", "avx2")) if name in isa] + ["portable"]
    h = torch.randn(17, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = {}
    for impl in ["auto"] + forced:
        monkeypatch.setenv("SPECSERVE_QUANT_IMPL", impl)
        logits = m.compute_logits(h)
        rows = torch.cat([m.compute_logits(h[i:i + 1]) for i in range(17)])
        assert torch.equal(logits, rows), impl
        spec = LLM.from_model(m, speculative_algorithm="NGRAM").generate(PROMPTS, SP)
        outs[impl] = (logits, [o.token_ids for o in spec])
    for impl in forced:
        assert torch.equal(outs[impl][0], outs["auto"][0]) and outs[impl][1] == outs["auto"][1], impl
