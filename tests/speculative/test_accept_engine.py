"""Acceptance is lossless inside the engine: on a tiny fp64 model with a 5-token vocabulary, the first
tokens emitted with SYNTHETIC, NGRAM and STANDALONE (sample and block rules) speculation, at
temperature 1 and with top-k/top-p, follow the exact target joint computed by enumeration through an
independent reference of temperature → top-k → top-p; the same threshold rejects a nearby wrong target.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.accept_helpers import encode, reference_tv, threshold, tv
from tests.tiny import tiny_model
from tests.accept_helpers import _one_thread  # noqa: F401  (autouse: one intra-op thread)


VOCAB = 5
PROMPT = [4, 0, 2, 4, 0]  # repeats, so NGRAM finds drafts
L_ENGINE = 3


@pytest.fixture(scope="module")
def tiny5():
    return tiny_model(vocab=VOCAB, seed=9)  # seed 9: a fairly flat joint (perplexity ≈ 10 of 125)


def model_last_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Raw next-token logits after `ids`, by a plain full-recompute forward (as tests/tiny.py)."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    kv = KVPool(model.cfg, num_pages=(len(ids) + 15) // 16, page_size=16, dtype=model.dtype)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    logits, _ = ModelRunner(model, kv).forward([pt], [0], [ids], [[len(ids) - 1]])
    return logits[0][0].double()


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Independent reference for temperature → top-k → top-p (keep the token crossing top_p)."""
    probs = torch.softmax(logits / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in keep)
    kept, cum = [], 0.0
    for i in keep:
        if cum >= top_p:
            break
        kept.append(i)
        cum += float(probs[i]) / mass
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def exact_engine_joint(model, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:  # noqa: ANN001
    joint = torch.zeros(VOCAB**L_ENGINE, dtype=torch.float64)
    cond: dict[tuple[int, ...], torch.Tensor] = {}
    for prefix_len in range(L_ENGINE):
        for prefix in itertools.product(range(VOCAB), repeat=prefix_len):
            cond[prefix] = reference_probs(model_last_logits(model, PROMPT + list(prefix)), temperature, top_k, top_p)
    for seq in itertools.product(range(VOCAB), repeat=L_ENGINE):
        prob = 1.0
        for j in range(L_ENGINE):
            prob *= float(cond[seq[:j]][seq[j]])
        joint[encode(torch.tensor([seq]), VOCAB)] = prob
    return joint


SYNTH = dict(speculative_algorithm="SYNTHETIC", speculative_num_draft_tokens=3, speculative_synthetic_accept_rate=0.5)
STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="(in-memory tiny draft)",
                  speculative_num_draft_tokens=3)
ENGINE_N = 3000
ENGINE_CASES = {
    # name: (engine options, sampling kwargs, max_tokens, seed base). max_tokens sets the first
    # verify window (max_tokens − 2 drafts; the first token comes from prefill), so across cases
    # the first 3 tokens cover draft, correction and bonus positions.
    "synthetic_t1": (SYNTH, dict(temperature=1.0), 4, 10_000),
    "ngram_t1": (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3), dict(temperature=1.0), 3, 20_000),
    # table drafts (prompt lookup off: no 4-token suffix of PROMPT recurs), one-hot verified at T = 1
    "ngram_table_t1": (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3, speculative_ngram_min_match=4,
                            speculative_ngram_table="(tiny table)"), dict(temperature=1.0), 3, 25_000),
    "synthetic_topk_topp": (SYNTH, dict(temperature=1.0, top_k=4, top_p=0.9), 5, 30_000),
    # a sampled model draft carries q, so these run accept_sample / accept_block inside the engine
    "standalone_sample_t1": ({**STANDALONE, "speculative_accept": "sample"}, dict(temperature=1.0), 4, 40_000),
    "standalone_block_topk": ({**STANDALONE, "speculative_accept": "block"}, dict(temperature=1.0, top_k=3), 5, 50_000),
}


@pytest.fixture
def in_memory_standalone(monkeypatch):  # noqa: ANN001
    """Make STANDALONE draft with an in-memory tiny model (a different one than the target)."""
    from specserve.drafters import base, standalone

    monkeypatch.delenv("SPECSERVE_SPECULATIVE_GREEDY_DRAFT", raising=False)
    draft = tiny_model(vocab=VOCAB, seed=11, layers=1)
    entry = base.registry()["STANDALONE"]
    monkeypatch.setitem(base._REGISTRY, "STANDALONE", dataclasses.replace(
        entry, factory=lambda ctx: standalone.StandaloneDrafter(standalone.build_draft_runner(ctx, draft))))


@pytest.fixture(scope="module")
def tiny5_table(tmp_path_factory):  # noqa: ANN001
    """An n-gram table over the 5-token vocabulary (random text with repeats), so table drafts happen."""
    import numpy as np

    from specserve.drafters.ngram_table import NgramTable

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (400,), generator=g).numpy()
    table, _ = NgramTable.build([(ids, np.ones(len(ids), bool))], vocab_size=VOCAB, max_n=2, min_count=2)
    path = tmp_path_factory.mktemp("tiny5") / "table"
    table.save(path)
    return str(path)


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_first_tokens_match_target_joint(tiny5, tiny5_table, in_memory_standalone, case: str) -> None:  # noqa: ANN001
    from specserve.core import SamplingParams
    from specserve.engine.llm import LLM

    opts, sp_kw, max_tokens, seed0 = ENGINE_CASES[case]
    if "speculative_ngram_table" in opts:
        opts = {**opts, "speculative_ngram_table": tiny5_table}
    n = ENGINE_N
    proc = (sp_kw["temperature"], sp_kw.get("top_k", -1), sp_kw.get("top_p", 1.0))
    exact = exact_engine_joint(tiny5, *proc)
    llm = LLM.from_model(tiny5, seed=0, **opts)
    outs = llm.generate([list(PROMPT)] * n, [SamplingParams(max_tokens=max_tokens, seed=seed0 + i, **sp_kw)
                                             for i in range(n)])
    seqs = torch.tensor([o.outputs[0].token_ids[:L_ENGINE] for o in outs])
    assert seqs.shape == (n, L_ENGINE)
    counts = torch.bincount(encode(seqs, VOCAB), minlength=exact.numel())
    assert float(exact[counts > 0].min()) > 0, "engine emitted a sequence the target cannot produce"
    drafted = sum(o.outputs[0].meta_info["spec_draft_tokens"] for o in outs)
    accepted = sum(o.outputs[0].meta_info["spec_accepted_tokens"] for o in outs)
    assert drafted > 0 and 0 < accepted < drafted  # speculation really ran, with both outcomes
    t_eng = tv(counts, exact)
    t_ref = reference_tv(exact, n, seed=seed0)
    # power check: the same threshold rejects a nearby wrong target (temperature off by 0.3, and
    # top-k/top-p not applied)
    t_wrong = tv(counts, exact_engine_joint(tiny5, proc[0] + 0.3))
    print(f"engine {case}: TV={t_eng:.4f} ref={t_ref:.4f} thr={threshold(t_ref):.4f} "
          f"vs-wrong-target={t_wrong:.4f} accepted {accepted}/{drafted}")
    assert t_eng <= threshold(t_ref), (case, t_eng, t_ref)
    assert t_wrong > threshold(t_ref), (case, t_wrong, t_ref)
