"""NaN/Inf isolation at forward level: one request's hidden state (a target layer's output rows) or its
cached K/V rows become NaN or +Inf. That request alone fails (finish_reason "error", the error names
NaN/Inf); its neighbours in the same batches, and a request that joins afterwards and reuses the
victim's (still poisoned) pages, finish exactly as they would alone, and nothing leaks.

Regressions caught: a masked attention entry read from another request's slot (masked scores still
enter SDPA as 0·V, and 0·NaN = NaN), context padding that points at a slot the request did not write
this step, a stale page read after reuse, a batch-wide reduction (norm, top-k, early stop) over rows of
several requests, and a NaN check that fails the whole batch instead of the request.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from tests.drafter_setup import _spec_llm
from specserve.models import fused
from specserve.models.llama import DecoderLayer
from specserve.formats.quant import quantize_model
from tests.poison_helpers import EmbedPoison, HiddenPoison, drive_poisoned, poison_kv
from tests.spec_helpers import NGRAM, assert_no_leak, make_llm
from tests.tiny import reference_greedy, tiny_model

NAN, INF = float("nan"), float("inf")
VICTIM, POISON_STEP, JOIN_LATE = 1, 4, 7
N_TOK = 14


def _plan(sampled: SamplingParams | None = None) -> list[tuple[int, list[int], SamplingParams]]:
    """Three requests from step 0 (the victim is the second), one sampled (seeded) neighbour, and a
    late joiner that arrives after the victim failed (it gets the victim's freed pages)."""
    g = SamplingParams(temperature=0, max_tokens=N_TOK)
    return [(0, [1, 2, 3, 1, 2, 3, 1], g), (0, [5, 9, 11, 5, 9, 11, 5, 9], g), (1, [7] * 10, g),
            (0, [40, 41, 42, 40, 41], sampled or SamplingParams(temperature=0.8, seed=3, max_tokens=N_TOK)),
            (JOIN_LATE, [2, 5, 2, 5, 2, 5, 2, 5, 2], g)]


def _poison(where: str, value: float, llm):  # noqa: ANN001, ANN202
    # layer 0's output: the NaN/Inf then runs through every later layer and the victim's K/V there
    return HiddenPoison(llm.engine, 0, value) if where == "hidden" else poison_kv(value)


def _check(llm, plan, clean, reqs, pages, hits=None) -> None:  # noqa: ANN001
    if hits is not None:
        assert hits, "the poison never found the victim's rows"
    _check_neighbours(llm, plan, clean, reqs)
    _check_victim(reqs, clean, pages)


def _check_victim(reqs, clean, pages) -> None:  # noqa: ANN001
    v = reqs[VICTIM]
    assert v.finish_reason == "error" and v.error and ("NaN" in v.error or "Inf" in v.error), (v.finish_reason, v.error)
    assert v.output_ids == clean[VICTIM].output_ids[: len(v.output_ids)]  # nothing emitted from the poisoned step
    # the victim's pages (poisoned K/V still in them) went to another request after it failed
    assert any(set(p) & set(pages[VICTIM]) for i, p in enumerate(pages) if i != VICTIM), "no page of the victim reused"


def _check_neighbours(llm, plan, clean, reqs) -> None:  # noqa: ANN001
    model = llm.engine.model
    for i, ((_, prompt, sp), r) in enumerate(zip(plan, reqs)):
        if i == VICTIM:
            continue
        assert r.error is None and r.finish_reason == "length", (i, r.error)
        if sp.greedy:
            assert r.output_ids == reference_greedy(model, prompt, N_TOK), i
        else:  # seeded sampling: the same tokens as in the run without the fault
            assert r.output_ids == clean[i].output_ids, i
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("where", ["hidden", "kv"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("algo,mode", [(None, "compact"), (NGRAM, "compact"), (NGRAM, "padded")])
def test_forward_poison_fails_only_its_request(where: str, value: float, algo: str | None, mode: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_SPECULATIVE_VERIFY_PACKING", mode)
    model = tiny_model("qwen2", seed=6)
    plan = _plan()
    clean, _ = drive_poisoned(make_llm(model, algo, 4, page_size=4), plan, VICTIM, POISON_STEP)
    llm = make_llm(model, algo, 4, page_size=4)
    poison = _poison(where, value, llm)
    reqs, pages = drive_poisoned(llm, plan, VICTIM, POISON_STEP, poison)
    _check(llm, plan, clean, reqs, pages, poison.hits if where == "hidden" else None)
    if algo:
        assert sum(r.spec_accepted_tokens for r in reqs) > 0


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("algo", [None, NGRAM])
@pytest.mark.parametrize("path,where", [("fused", "embed"), ("decoder_layers", "embed"), ("decoder_layers", "kv"),
                                        ("decoder_layers+dense_head", "embed")])
def test_poison_on_the_fused_path_fails_only_its_request(path: str, where: str, algo: str | None, value: float,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The default layer loop (no hooks): the Python fused loop (qwen2, fp64) and the C++ decoder_layers
    op (w4a8 llama, fp32; with its dense LM head restored the residual's NaN/Inf reaches the logits).
    The fault enters at the victim's embedding rows (its K/V at later layers follow) or in its cached
    K/V, which the fused attention kernels read beside its neighbours' rows."""
    quantized = path.startswith("decoder_layers")
    if not quantized:
        model = tiny_model("qwen2", seed=6)
    else:
        model = tiny_model("llama", dtype=torch.float32, seed=6)
        head = model.lm_head
        quantize_model(model, "w4a8")
        if path.endswith("dense_head"):
            model.lm_head = head
        assert model._layer_stack() is not None
    assert fused.enabled()
    calls = {"reference": 0, "fused": 0, "decoder_layers": 0}
    monkeypatch.setattr(DecoderLayer, "forward", lambda *a, **k: calls.__setitem__("reference", calls["reference"] + 1))
    forward_fused = DecoderLayer.forward_fused

    def counted_fused(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["fused"] += 1
        return forward_fused(self, *a, **k)

    monkeypatch.setattr(DecoderLayer, "forward_fused", counted_fused)
    decoder_layers = torch.ops.specserve.decoder_layers

    def counted_stack(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["decoder_layers"] += 1
        return decoder_layers(*a, **k)

    monkeypatch.setattr(torch.ops.specserve, "decoder_layers", counted_stack)
    plan = _plan()
    clean, _ = drive_poisoned(make_llm(model, algo, 4, page_size=4), plan, VICTIM, POISON_STEP)
    llm = make_llm(model, algo, 4, page_size=4)
    poison = EmbedPoison(llm.engine, value) if where == "embed" else poison_kv(value)
    reqs, pages = drive_poisoned(llm, plan, VICTIM, POISON_STEP, poison)
    named = "decoder_layers" if quantized else "fused"
    assert calls["reference"] == 0 and calls[named] > 0, calls  # the path named, never the reference loop
    assert where == "kv" or poison.hits, "the poison never found the victim's rows"
    if algo:
        assert sum(r.spec_accepted_tokens for r in reqs) > 0
    _check_neighbours(llm, plan, clean, reqs)
    _check_victim(reqs, clean, pages)


def test_poisoned_prefill_fails_only_its_request() -> None:
    """Poisoned in its prefill (chunked: the fault sits in K/V a later chunk reads), the victim fails
    before emitting anything."""
    model = tiny_model("llama", seed=6)
    plan = _plan()
    llm = make_llm(model, NGRAM, 4, page_size=4, max_prefill_tokens=4)
    poison = HiddenPoison(llm.engine, 0, NAN)  # layer 0: layer 1 then caches NaN K/V
    reqs, pages = drive_poisoned(llm, plan, VICTIM, 0, poison)
    clean, _ = drive_poisoned(make_llm(model, NGRAM, 4, page_size=4, max_prefill_tokens=4), plan, VICTIM, 0)
    assert reqs[VICTIM].output_ids == []
    _check(llm, plan, clean, reqs, pages, poison.hits)


LEARNED = [("eagle3", {}), ("dspark", {}), ("eagle3", {"speculative_eagle_topk": 3, "speculative_num_steps": 3})]


@pytest.mark.parametrize("where,value", [("hidden", NAN), ("kv", INF)], ids=["hidden-nan", "kv-inf"])
@pytest.mark.parametrize("algo,opts", LEARNED, ids=["eagle3", "dspark", "eagle3-tree"])
def test_forward_poison_under_learned_drafters(trained: dict, algo: str, opts: dict, where: str, value: float) -> None:
    """The learned drafters consume the victim's (poisoned) target features and keep their own KV pool:
    neither may carry the fault to a neighbour or to the late joiner that reuses the victim's pages."""
    plan = _plan()
    clean, _ = drive_poisoned(_spec_llm(trained, algo, page_size=4, **opts), plan, VICTIM, POISON_STEP)
    llm = _spec_llm(trained, algo, page_size=4, **opts)
    poison = _poison(where, value, llm)
    reqs, pages = drive_poisoned(llm, plan, VICTIM, POISON_STEP, poison)
    _check(llm, plan, clean, reqs, pages, poison.hits if where == "hidden" else None)
    dr = llm.engine.drafter
    assert dr.state == {} and dr.kv.allocator.num_free == dr.kv.allocator.num_pages


@pytest.mark.parametrize("algo", ["eagle3", "dspark"])
def test_nonfinite_draft_distribution_fails_at_most_its_request(trained: dict, algo: str) -> None:
    s = SamplingParams(temperature=0.8, seed=1, max_tokens=N_TOK)
    plan = [(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], s), (0, [5, 9, 11, 5, 9, 11, 5, 9, 11, 5], s), (0, [7] * 10, s)]
    opts = dict(page_size=4, max_prefill_tokens=4)
    clean, _ = drive_poisoned(_spec_llm(trained, algo, **opts), plan, VICTIM, 0)
    llm = _spec_llm(trained, algo, **opts)
    poison = HiddenPoison(llm.engine, llm.engine.model.cfg.num_layers - 1, NAN)
    reqs, _ = drive_poisoned(llm, plan, VICTIM, 0, poison)
    assert poison.hits
    v = reqs[VICTIM]
    assert v.error is None or ("NaN" in v.error or "Inf" in v.error)
    for i, r in enumerate(reqs):
        if i != VICTIM:
            assert r.error is None and r.output_ids == clean[i].output_ids
    assert_no_leak(llm.engine)
