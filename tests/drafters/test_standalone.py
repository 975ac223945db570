"""STANDALONE drafter on tiny same-vocabulary fp64 models: greedy equality, draft-side commit,
vocabulary refusal."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from tests.dist import engine_vs_exact_joint
from tests.engine_helpers import fixed_curves
from tests.tiny import reference_greedy, save_tiny_hf_dir, tiny_config, tiny_state_dict


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    cfg = tiny_config("llama")
    out = {"target": save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=1), root / "target")}
    out["self"] = out["target"]  # draft == target: every draft accepted
    dcfg = tiny_config("qwen2", layers=1)  # a different, smaller architecture with the same vocab
    out["small"] = save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=2), root / "small")
    for name, vocab in (("padded", 97 + 9), ("short", 97 - 11)):  # padded pairs: trailing ids differ
        pcfg = tiny_config("qwen2", layers=1, vocab=vocab)
        out[name] = save_tiny_hf_dir(pcfg, tiny_state_dict(pcfg, seed=4), root / name)
    big = tiny_config("llama", vocab=97 + 129)
    out["bigvocab"] = save_tiny_hf_dir(big, tiny_state_dict(big, seed=3), root / "bigvocab")
    out["othertok"] = save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=2), root / "othertok")
    tok = root / "othertok" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"w5"', '"x5"'))  # one piece differs
    return out


def _llm(dirs: dict[str, str], draft: str, k: int, **kw) -> LLM:
    return LLM(dirs["target"], dtype="float64", speculative_algorithm="STANDALONE",
               speculative_draft_model_path=dirs[draft], speculative_num_draft_tokens=k, **kw)


@pytest.mark.parametrize("draft", ["self", "small"])
@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_standalone_greedy_equals_plain(dirs: dict[str, str], draft: str, k: int) -> None:
    llm = _llm(dirs, draft, k, page_size=4, max_prefill_tokens=9)
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (6,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    target = llm.engine.model
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(target, p, 24)
    if draft == "self":  # the draft is the target: all drafts accepted, except where max_tokens cuts
        assert all(o.meta_info["spec_accept_length"] > min(k + 1, 24) / 2 for o in outs)


def test_standalone_requests_join_midway(dirs: dict[str, str]) -> None:
    llm = _llm(dirs, "small", 4)
    eng = llm.engine
    prompts = [[5, 6, 7], [1] * 17, [3, 9, 27, 81], [2, 4]]
    reqs = []
    for p in prompts:  # a new request every two steps
        reqs.append(eng.add_request(p, SamplingParams(temperature=0, max_tokens=20)))
        eng.step()
        eng.step()
    while eng.has_unfinished():
        eng.step()
    for p, r in zip(prompts, reqs):
        assert r.output_ids == reference_greedy(eng.model, p, 20)
    drafter = eng.drafter
    assert drafter.state == {} and drafter.kv.allocator.num_free == drafter.kv.allocator.num_pages


def _assert_draft_kv_fresh(d, req) -> None:  # noqa: ANN001
    """The draft's valid KV of `req` (positions < done) equals a fresh forward of its tokens."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    st = d.state[req.request_id]
    ids = req.all_ids[: st.done]
    kv = KVPool(d.runner.model.cfg, 8, 16, torch.float64)
    pt: list[int] = []
    kv.ensure(pt, len(ids))
    ModelRunner(d.runner.model, kv).forward([pt], [0], [ids], [[]])
    slots = d.runner.kv.slots(st.page_table, 0, st.done)
    for layer in range(len(kv.k)):
        assert torch.allclose(d.kv.k[layer][slots], kv.k[layer][: len(ids)], atol=1e-10), layer
        assert torch.allclose(d.kv.v[layer][slots], kv.v[layer][: len(ids)], atol=1e-10), layer


def test_draft_kv_matches_committed_tokens(dirs: dict[str, str]) -> None:
    """After each step, the draft's valid KV (positions < done) equals a fresh forward of the tokens."""
    llm = _llm(dirs, "small", 5)
    eng = llm.engine
    req = eng.add_request([4, 8, 15, 16, 23, 42], SamplingParams(temperature=0, max_tokens=30))
    for _ in range(6):
        eng.step()
        _assert_draft_kv_fresh(eng.drafter, req)


def test_vocab_mismatch_refused(dirs: dict[str, str]) -> None:
    """More than 128 trailing ids apart, or one token's string differs: not the target's tokenizer."""
    with pytest.raises(ValueError, match="vocabulary differs: target logits have 226 entries, draft 97"):
        LLM(dirs["bigvocab"], dtype="float64", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=dirs["small"])
    with pytest.raises(ValueError, match="draft tokenizer differs from the target's at id 5: 'w5' vs 'x5'"):
        _llm(dirs, "othertok", 4)


@pytest.mark.parametrize("draft", ["padded", "short"])
@pytest.mark.parametrize("k", [1, 4])
def test_padded_vocab_pair_greedy_equals_plain(dirs: dict[str, str], draft: str, k: int) -> None:
    """A draft with 9 more or 11 fewer trailing ids than the target: it drafts only the shared ids (a target token
    it has no row for is fed to it as a stand-in), and the output is the target's."""
    llm = _llm(dirs, draft, k, page_size=4)
    shared = 97 if draft == "padded" else 86
    d, drafted = llm.engine.drafter, []
    propose = d.propose
    d.propose = lambda reqs, plan: (p := propose(reqs, plan)) and drafted.extend(t for ts in p.tokens for t in ts) or p
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (6,), generator=g)]
    prompts.append([90, 91, 92, 93] * 3)  # ids the short draft has no row for
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm.engine.model, p, 24)
    assert drafted and max(drafted) < shared
    assert d.runner.model.logits_vocab == 97


def test_padded_vocab_pair_sampling_matches_target_distribution(tmp_path) -> None:  # noqa: ANN001
    """Target of 4 tokens, draft of 3: sampled drafts (q over the 3 shared ids) keep the exact target joint,
    token 3 included, which the draft can neither propose nor embed."""
    V, L, N = 4, 5, 2500
    cfg, dcfg = tiny_config("llama", vocab=V), tiny_config("llama", vocab=V - 1)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    draft = save_tiny_hf_dir(dcfg, tiny_state_dict(dcfg, seed=12), tmp_path / "d")
    llm = LLM(target, dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=3, max_running_requests=256)
    fit = engine_vs_exact_joint(llm, [1, 3], L, SamplingParams(temperature=6.0, max_tokens=L, top_p=0.95), N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0
    assert any(3 in o.token_ids for o in fit.outs)


def test_block_refused_for_deterministic_drafts(dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="block needs draft distributions"):
        LLM(dirs["target"], dtype="float64", speculative_algorithm="NGRAM", speculative_accept="block")


def test_standalone_needs_path() -> None:
    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        LLM("x", speculative_algorithm="STANDALONE")


@pytest.mark.parametrize("rule", ["sample", "block", "onehot"])
def test_standalone_sampling_matches_target_distribution(tmp_path, rule: str) -> None:  # noqa: ANN001
    """Sampled drafts with real q through the whole engine reproduce the exact target joint."""
    V, L, N = 3, 5, 2500  # first token from prefill, then a window of 3 drafts: γ up to 3 is exercised
    cfg = tiny_config("llama", vocab=V)
    target = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=11), tmp_path / "t")
    draft = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=12), tmp_path / "d")  # different q
    llm = LLM(target, dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
              speculative_num_draft_tokens=3, speculative_accept=rule, max_running_requests=256)
    base = SamplingParams(temperature=6.0, max_tokens=L, top_p=0.95)  # tiny models are peaked: flatten
    fit = engine_vs_exact_joint(llm, [1, 2], L, base, N)
    assert fit.ok, fit
    assert sum(o.meta_info["spec_accepted_tokens"] for o in fit.outs) > 0


def test_standalone_draft_bigger_than_target_refused(dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="the draft .* is bigger than the target"):
        LLM(dirs["small"], dtype="float64", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=dirs["target"])


@pytest.mark.parametrize("k", [1, 4])
def test_standalone_reduced_draft_vocab_greedy_equals_plain(dirs: dict[str, str], tmp_path, k: int) -> None:  # noqa: ANN001
    """A draft head cut to 40 of 97 tokens: drafts come from those 40 only, the output stays the target's."""
    import json

    import numpy as np

    from specserve.drafters.draft_vocab import FILE, tokenizer_fingerprint
    from specserve.loading.checkpoint import open_checkpoint

    tok = open_checkpoint(dirs["small"]).tokenizer
    keep = np.arange(0, 97, 2)[:40]
    np.savez(tmp_path / FILE, ids=keep)
    (tmp_path / "config.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tok), "tokenizer_name": "t"}))
    llm = _llm(dirs, "small", k, speculative_draft_vocab=str(tmp_path))
    draft = llm.engine.drafter.runner.model
    assert torch.equal(draft.head_ids, torch.from_numpy(keep)) and draft.lm_head.shape[0] == 40
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 97, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (4,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm.engine.model, p, 16)
    logits = draft.compute_logits(torch.randn(2, draft.cfg.hidden_size, dtype=draft.dtype))
    outside = torch.ones(97, dtype=torch.bool)
    outside[keep] = False
    assert logits.shape == (2, 97) and torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, keep]).all()


def test_standalone_draft_vocab_of_another_tokenizer_refused(dirs: dict[str, str], tmp_path) -> None:  # noqa: ANN001
    import json

    import numpy as np

    np.savez(tmp_path / "draft_vocab.npz", ids=np.arange(10))
    (tmp_path / "config.json").write_text(json.dumps({"tokenizer": "0" * 16, "tokenizer_name": "other"}))
    with pytest.raises(ValueError, match="built for another tokenizer"):
        _llm(dirs, "small", 2, speculative_draft_vocab=str(tmp_path))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_allowing_only_tokens_outside_the_reduced_head(tmp_path, temperature: float) -> None:  # noqa: ANN001
    """The grammar allows only a, c, e (tokens 65, 67, 69: several, so no draft is forced), which the draft's
    reduced head (even ids) lacks: the draft drafts nothing for that row instead of failing the request (sampled:
    an all −inf row) or drafting token 0 (greedy)."""
    import json

    import numpy as np

    from specserve.drafters.draft_vocab import FILE, tokenizer_fingerprint
    from tests.grammar_setup import tiny_tokenizer

    tok = tiny_tokenizer()
    dirs = {}
    for name, layers, seed in (("t", 2, 1), ("d", 1, 2)):
        cfg = tiny_config("llama", layers=layers)
        dirs[name] = save_tiny_hf_dir(cfg, tiny_state_dict(cfg, seed=seed), tmp_path / name)
        tok.backend.save(f"{dirs[name]}/tokenizer.json")
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.savez(vocab / FILE, ids=np.arange(0, 80, 2))
    (vocab / "config.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(tok), "tokenizer_name": "t"}))
    llm = LLM(dirs["t"], dtype="float64", speculative_algorithm="STANDALONE", speculative_draft_model_path=dirs["d"],
              speculative_draft_vocab=str(vocab), speculative_num_draft_tokens=4)
    assert tok.encode("ace", add_special_tokens=False) == [65, 67, 69]
    out = llm.generate([[33, 34, 35]], SamplingParams(temperature=temperature, max_tokens=8, regex="[ace]{6}", seed=1))[0]
    assert out.finish_reason == "stop" and set(out.token_ids[:6]) <= {65, 67, 69} and len(out.token_ids) >= 6
    assert llm.engine.stats.num_draft_tokens == 0  # nothing the grammar allows was draftable


def test_draft_prefix_cache_holds_only_committed_rows(dirs: dict[str, str]) -> None:
    """A request that finishes inside a step (a stop cuts its accepted run) leaves draft rows past its last
    committed token, one of them a rejected draft's: none of them may enter the draft's prefix cache. The next
    turn's hit must be the fresh forward of its tokens."""
    llm = _llm(dirs, "small", 5, page_size=4)
    eng, d = llm.engine, llm.engine.drafter
    prompt = [4, 8, 15, 16, 23, 42, 7, 9, 11]
    full = reference_greedy(eng.model, prompt, 40)
    for j in range(2, 40):  # stop at output j (a stop id finishes the run at its correction token)
        if full[j] in full[:j]:
            continue
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[full[j]]))[0]
        assert out.token_ids == full[:j + 1] or out.token_ids == full[:j], (j, out.token_ids)
        req = eng.add_request(prompt + full[:j + 1] + [5], SamplingParams(temperature=0, max_tokens=2))
        eng.step()  # admitted onto the cached pages (target and draft), prefilled, first token
        _assert_draft_kv_fresh(d, req)
        while eng.requests:
            eng.step()


def test_one_memory_check_covers_target_draft_and_kv(dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked once before anything loads: room for the target and the KV pools, but not for the draft model too,
    is refused naming all three (the target alone, then the draft alone, each fitted)."""
    from specserve import memory
    from specserve.loading.checkpoint import open_checkpoint
    from specserve.loading.pipeline import resident_bytes

    target, draft = (resident_bytes(open_checkpoint(dirs[n]), torch.float64, None) for n in ("target", "small"))
    kv = 2**20
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: target + kv + draft // 2)
    with pytest.raises(MemoryError, match=r"target \(float64\) with 0\.\d\d GiB of draft model and 0\.00 GiB of KV "
                                          r"cache needs about"):
        _llm(dirs, "small", 4, kv_cache_memory="1MiB")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: target + kv + draft)
    _llm(dirs, "small", 4, kv_cache_memory="1MiB")


def test_draft_model_skips_a_long_prompt_with_a_short_answer(dirs: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `cost`, admission prices the draft model's prefill against the output a request may still ask for:
    at batch 1, a prompt whose prefill costs the draft more than its max_tokens can save is neither prefilled nor
    drafted for by the draft model (its text is plain decoding's), while a short prompt is. Here a prompt token
    costs the draft 0.05 of a target step and a generated token saves 0.2 of one: it pays from a quarter."""
    from specserve.cost.curve import CostModel
    from specserve.cost.gate import DraftGate

    fixed_curves(monkeypatch, CostModel([(1, 1.0), (64, 1.5)]), CostModel([(1, 0.05), (64, 3.2)]))
    monkeypatch.setattr(DraftGate, "allow", lambda self, batch, source="draft": "open")
    llm = _llm(dirs, "self", 4, speculative_window="cost")  # the draft is the target: every draft is accepted
    eng, target = llm.engine, llm.engine.model
    for prompt, max_tokens, off in ((list(range(3, 43)), 8, True), (list(range(3, 43)), 12, False),
                                    ([5, 6, 7], 8, False)):
        req = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        eng.step()  # the prefill
        assert (req.request_id in eng.draft_stage.model_off) is off
        while not req.finished:
            eng.step()
        assert req.output_ids == reference_greedy(target, prompt, max_tokens)
        assert (req.spec_accepted_tokens == 0) is off
