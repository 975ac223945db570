"""--quantization int4: 4-bit group weights (CPU kernel), bf16 activations."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.quant import GROUP, Int4Weight

from .tiny import ref_logits, tiny_model


def test_int4_weight_roundtrip_within_half_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    q = Int4Weight(w)
    g = w.reshape(64, -1, GROUP)
    half_step = ((g.amax(-1) - g.amin(-1)) / 15 / 2).repeat_interleave(GROUP, dim=1)
    err = (q.dequantize() - w).abs()
    assert bool((err <= half_step * 1.05 + 2e-3).all())  # + bf16 rounding of scale/zero
    x = torch.randn(5, 96)
    assert torch.allclose(q(x).float(), x @ q.dequantize().T, atol=0.05, rtol=0.02)


def test_int4_model_generates_and_speculates() -> None:
    m = tiny_model("llama", dtype=torch.bfloat16)
    m.quantize_int4()
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
    tol = 0.25  # two bf16 ulps at |logit| ≈ 16-32
    for p, a, b in zip(prompts, plain, spec):
        for out in (a.token_ids, b.token_ids):
            rows = ref_logits(m, p + out[:-1])[len(p) - 1 :]
            assert all(float(r.max() - r[t]) <= tol for r, t in zip(rows, out)), out
        rows = ref_logits(m, p + a.token_ids[:-1])[len(p) - 1 :]
        top2 = rows.topk(2, dim=-1).values
        tie = next((j for j, (x, y) in enumerate(top2.tolist()) if x - y <= tol), len(rows))
        assert b.token_ids[:tie] == a.token_ids[:tie]


def test_int4_needs_bf16() -> None:
    m = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        m.quantize_int4()
