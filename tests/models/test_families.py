"""Mistral, Phi-3, Gemma 2 and Gemma 3 on tiny random models: specserve's greedy tokens equal transformers' (HF
directory, fp32); the same directory converted by llama.cpp's own convert_hf_to_gguf.py loads through the GGUF
path with equal tokens (and through the integer kernels from a Q8_0 conversion); NGRAM, STANDALONE and EAGLE-3
speculation equal plain decoding; a sliding window's prefix-cache hits equal a cold run while its pages behind
the window are freed.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine.llm import LLM
from specserve.models.config import ModelConfig
from tests.families_setup import FAMILIES, PROMPTS, VOCAB, WINDOW, hf_greedy, hf_model, save_family_dir

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
CONVERTER = Path(__file__).resolve().parents[2] / ".venv" / "llama.cpp" / "convert_hf_to_gguf.py"
# small pages, chunked prefill: requests cross page and chunk boundaries inside and behind the window
ENGINE = dict(kv_cache_memory="1MiB", page_size=4, max_prefill_tokens=5)


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_family_dir(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece model of exactly VOCAB pieces (the converter reads the vocabulary from it)."""
    spm = pytest.importorskip("sentencepiece")
    import random

    root = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 6))) for _ in range(300)]
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)))
    spm.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "tiny"), vocab_size=VOCAB,
                                   model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    return root / "tiny.model"


def _convert(hf_dir: str, spm_model: Path, out: Path, outtype: str) -> str:
    """llama.cpp's convert_hf_to_gguf.py over a copy of the directory with the SentencePiece tokenizer."""
    if not CONVERTER.is_file():
        pytest.skip(f"{CONVERTER} is missing: `scripts/setup.sh test` unpacks llama.cpp's converter there")
    src = out.with_suffix("")
    shutil.copytree(hf_dir, src)
    shutil.copy(spm_model, src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    gguf = out.with_suffix(f".{outtype}.gguf")
    env = {"PYTHONPATH": str(CONVERTER.parent / "gguf-py"), "PATH": ""}
    run = subprocess.run([sys.executable, str(CONVERTER), str(src), "--outfile", str(gguf), "--outtype", outtype],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return str(gguf)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers(dirs: dict[str, str], family: str) -> None:
    llm = LLM(dirs[family], dtype="float32", **ENGINE)
    assert llm.engine.model.cfg.architecture == family
    for p, got in zip(PROMPTS, _tokens(llm)):
        assert got == hf_greedy(family, p, 20, torch.float32), (family, p)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_greedy_equals_transformers_fp64(dirs: dict[str, str], family: str) -> None:
    """fp64 on the reference layer loop (gemma2's soft-capped scores) and the fused one (mistral's window)."""
    llm = LLM(dirs[family], dtype="float64", **ENGINE)
    for p, got in zip(PROMPTS, _tokens(llm)):
        assert got == hf_greedy(family, p, 20, torch.float64), (family, p)


def test_configs_read_each_familys_switches() -> None:
    cfg = {f: ModelConfig.from_hf_dict(hf_model(f).config.to_dict()) for f in FAMILIES}
    assert cfg["mistral"].kv_window == WINDOW and cfg["mistral"].attention_layers == (0, 1)
    assert cfg["phi3"].rope_scaling["rope_type"] == "longrope" and cfg["phi3"].max_position_embeddings == 64
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2 and g2.kv_window is None
    assert (g2.attn_softcap, g2.final_softcap, g2.norm_offset, g2.hidden_act) == (3.0, 5.0, 1.0, "gelu_tanh")
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and g3.qk_norm
    assert (g3.rope_local_theta, g3.rope_theta, g3.rope_scaling["factor"]) == (10.0, 1000.0, 4.0)
    with pytest.raises(ValueError, match="unsupported model architecture 'Starcoder2ForCausalLM'.*gemma3"):
        ModelConfig.from_hf_dict({"architectures": ["Starcoder2ForCausalLM"]})


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_conversion_loads_with_equal_tokens(dirs: dict[str, str], spm_model: Path, tmp_path: Path,
                                                      family: str) -> None:
    """An f32 GGUF from llama.cpp's converter gives transformers' tokens. Its Mistral carries no window (the
    converter drops it and llama.cpp attends to the whole context): it equals transformers without one."""
    llm = LLM(_convert(dirs[family], spm_model, tmp_path / family, "f32"), **ENGINE)
    assert llm.engine.model.cfg.architecture == ("llama" if family == "mistral" else family)
    for p, got in zip(PROMPTS, _tokens(llm)):
        assert got == hf_greedy(family, p, 20, torch.float32, window=family != "mistral"), (family, p)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_conversion_serves_on_the_integer_kernels(dirs: dict[str, str], spm_model: Path, tmp_path: Path,
                                                       family: str) -> None:
    """A Q8_0 GGUF defaults to w8a8 (the file's blocks in the integer GEMMs, activations rounded to int8); its
    logits stay close to the same blocks dequantized into fp32, and their top-1 mostly agrees (a tiny random
    model's margins are thin, so not every row)."""
    from specserve.formats.quant import BlockQuantWeight
    from tests.tiny import ref_logits

    path = _convert(dirs[family], spm_model, tmp_path / family, "q8_0")
    fast, exact = LLM(path, **ENGINE).engine.model, LLM(path, dtype="float32", **ENGINE).engine.model
    assert isinstance(fast.layers[0].qkv_w, BlockQuantWeight)
    ids = [t for p in PROMPTS for t in p]
    a, b = ref_logits(fast, ids), ref_logits(exact, ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def _eagle3_dir(target_dir: str, out: Path) -> str:
    """A randomly initialised EAGLE-3 drafter for a target (its drafts are mostly rejected: verify's
    rejection path runs every step)."""
    from specserve.drafters.artifact import build_net, save_drafter
    from specserve.drafters.nets import DrafterConfig
    from specserve.loading.checkpoint import open_checkpoint

    torch.manual_seed(3)
    net = build_net(DrafterConfig.for_target("eagle3", open_checkpoint(target_dir).cfg))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_drafter(net, out, "", torch.float32)
    return str(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_speculation_equals_plain(dirs: dict[str, str], tmp_path: Path, family: str, algo: str) -> None:
    plain = _tokens(LLM(dirs[family], dtype="float32", **ENGINE))
    draft = {"NGRAM": {}, "STANDALONE": {"speculative_draft_model_path": dirs[family]},
             "EAGLE3": {"speculative_draft_model_path": _eagle3_dir(dirs[family], tmp_path / "e3")}}[algo]
    llm = LLM(dirs[family], dtype="float32", speculative_algorithm=algo, speculative_num_draft_tokens=3,
              speculative_window="fixed", **draft, **ENGINE)
    assert _tokens(llm) == plain
    if algo == "STANDALONE":  # the target drafting for itself: most drafts are accepted
        assert llm.engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_prefix_cache_under_a_sliding_window_equals_cold(dirs: dict[str, str], family: str) -> None:
    """A shared prefix longer than the window: the warm request hits cached pages (Mistral's were freed from
    its first owner behind the window, yet stay cached whole) and decodes exactly as with no cache."""
    shared = [(7 * i + 3) % VOCAB for i in range(23)]
    prompts = [shared + [1, 2, 3], shared + [4, 5]]
    cold = _tokens(LLM(dirs[family], dtype="float32", disable_prefix_cache=True, **ENGINE), prompts)
    warm = LLM(dirs[family], dtype="float32", **ENGINE)
    first = _tokens(warm, prompts[:1])
    assert warm.engine.kv.prefix_cache.num_evictable >= len(shared) // 4  # its full pages stay cached
    second = _tokens(warm, prompts[1:])
    assert warm.engine.kv.prefix_cache.stats.hit_tokens >= 20
    assert first + second == cold


def test_mistral_frees_pages_behind_the_window(dirs: dict[str, str]) -> None:
    """While a long request decodes, it holds only the pages its window reads (plus the one being filled)."""
    llm = LLM(dirs["mistral"], dtype="float32", disable_prefix_cache=True, **ENGINE)
    held: list[int] = []
    engine = llm.engine
    step = engine.step

    def watch():  # noqa: ANN202
        out = step()
        held.extend(sum(p >= 0 for p in r.page_table) for r in engine.requests.values())
        return out

    engine.step = watch
    llm.generate([list(range(1, 30))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert held and max(held) <= -(-WINDOW // 4) + 2, held


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_tensor_parallel_equals_one_rank(dirs: dict[str, str], family: str) -> None:
    """Phi-3's fused tensors split into llama's before sharding; Gemma 2's sandwich norms and soft-caps run
    after the all-reduce and the vocabulary gather."""
    plain = _tokens(LLM(dirs[family], dtype="float64", **ENGINE))
    llm = LLM(dirs[family], dtype="float64", tp_size=2, **ENGINE)
    try:
        assert _tokens(llm) == plain
    finally:
        llm.close()
