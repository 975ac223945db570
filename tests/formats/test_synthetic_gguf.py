"""scripts/make_synthetic_gguf.py: a tiny-geometry file has Q4_K_M's names, types and shapes, sane random
weights, and loads and greedy-generates in specserve (w4a8 and fp32)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_synthetic_gguf", ROOT / "scripts" / "make_synthetic_gguf.py")
assert _spec and _spec.loader
msg = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = msg  # @dataclass looks its module up there
_spec.loader.exec_module(msg)

H, LAYERS, HEADS, KV, INTER = 256, 4, 4, 2, 512


def _write(out: Path, src: Path, *extra: str) -> int:
    """Write a tiny file; return its token (= embedding row) count."""
    specs = msg.main(["--out", str(out), "--tokenizer-from", str(src), "--hidden", str(H), "--layers", str(LAYERS),
                      "--heads", str(HEADS), "--kv-heads", str(KV), "--intermediate", str(INTER), *extra])
    return specs[0].shape[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    # SmolLM2's 49k-token tokenizer: parsing Qwen's 152k-token metadata costs seconds per GGUFReader, and this
    # module reads the file three times (the slow test below covers the Qwen tokenizer).
    from specserve.loading.checkpoint import resolve_model_path

    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return out, _write(out, resolve_model_path("smollm2-135m"), "--vocab-rows", "0")


def test_q6k_layers_match_the_real_qwen_q4_k_m_files() -> None:
    # Read off qwen2.5-coder-1.5b (28 layers) and -0.5b (24 layers) Q4_K_M: layer counter in string order.
    assert msg.more_bits_layers(28) == {0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27}
    assert msg.more_bits_layers(24) == {0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21}


def test_names_types_shapes_and_weight_statistics(tiny: tuple[Path, int]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path, n_tok = tiny
    r = GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen2"
    assert r.fields["qwen2.block_count"].contents() == LAYERS
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == n_tok
    t = {x.name: x for x in r.tensors}
    hd = H // HEADS
    want = {"token_embd.weight": ("Q4_K", (n_tok, H)), "output.weight": ("Q6_K", (n_tok, H)),
            "output_norm.weight": ("F32", (H,))}
    heavy = msg.more_bits_layers(LAYERS)
    assert heavy == {2, 3}  # both kinds of layer occur in the tiny file
    for i in range(LAYERS):
        v = "Q6_K" if i in heavy else "Q4_K"
        want |= {f"blk.{i}.{k}": x for k, x in {
            "attn_norm.weight": ("F32", (H,)), "ffn_norm.weight": ("F32", (H,)),
            "attn_q.weight": ("Q4_K", (HEADS * hd, H)), "attn_q.bias": ("F32", (HEADS * hd,)),
            "attn_k.weight": ("Q4_K", (KV * hd, H)), "attn_k.bias": ("F32", (KV * hd,)),
            "attn_v.weight": (v, (KV * hd, H)), "attn_v.bias": ("F32", (KV * hd,)),
            "attn_output.weight": ("Q4_K", (H, HEADS * hd)), "ffn_gate.weight": ("Q4_K", (INTER, H)),
            "ffn_up.weight": ("Q4_K", (INTER, H)), "ffn_down.weight": (v, (H, INTER))}.items()}
    assert set(t) == set(want)
    for name, (qt, shape) in want.items():
        x = t[name]
        assert (x.tensor_type.name, tuple(reversed(x.shape.tolist()))) == (qt, shape), name
        w = np.asarray(dequantize(x.data, x.tensor_type), np.float64).reshape(shape)
        assert np.isfinite(w).all(), name
        if name.endswith("norm.weight"):
            assert abs(w.mean() - 1) < 0.01 and w.std() < 0.05, name
            continue
        fan_in = shape[-1]
        target = 0.02 if name == "token_embd.weight" or w.ndim == 1 else fan_in ** -0.5
        assert 0.8 * target < w.std() < 1.2 * target, (name, w.std(), target)
        assert abs(w.mean()) < 0.05 * target + 4 * target / w.size ** 0.5, (name, w.mean())


@pytest.mark.parametrize("kw", [{}, {"dtype": "float32"}], ids=["default-w4a8", "float32"])
def test_specserve_loads_and_generates(tiny: tuple[Path, int], kw: dict) -> None:
    from specserve import LLM, SamplingParams

    path, n_tok = tiny
    llm = LLM(str(path), speculative_algorithm="NONE", **kw)
    cfg = llm.engine.model.cfg
    assert (cfg.architecture, cfg.vocab_size, cfg.num_layers, cfg.attention_bias, cfg.tie_word_embeddings) == \
        ("qwen2", n_tok, LAYERS, True, False)
    out = llm.generate(["Hello, world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and all(0 <= t < n_tok for t in out[0].token_ids)
    assert out[0].error is None


@pytest.mark.slow
def test_qwen_tokenizer_padded_vocab_rows(tmp_path: Path) -> None:
    """With Qwen's tokenizer and 128 padding rows past its tokens (as the real 7B has): the tokenizer and chat
    template are Qwen's, the padding rows are zero (never the argmax), and it generates."""
    from specserve import LLM, SamplingParams

    src = msg.DEFAULT_TOKENIZER.expanduser()
    if not src.is_file():
        pytest.skip(f"{src} absent (scripts/fetch_qwen_pair.py)")
    out = tmp_path / "qwen-tiny.gguf"
    assert _write(out, src, "--vocab-rows", "152064") == 152064
    llm = LLM(str(out), speculative_algorithm="NONE")
    assert llm.engine.model.cfg.vocab_size == 152064
    tok = llm.engine.tokenizer
    assert tok.encode("Hello, world") == [9707, 11, 1879]  # Qwen2.5's ids
    res = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert "<|im_start|>assistant" in tok.decode(res[0].prompt_token_ids, skip_special_tokens=False)
    assert all(t < 151936 for t in res[0].token_ids)
    from gguf import GGUFReader
    from gguf.constants import TokenType

    f = GGUFReader(str(out)).fields  # padded as llama.cpp's converter pads the real 7B's token list
    toks, types = f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.token_type"].contents()
    assert len(toks) == len(types) == 152064 and toks[151936] == "[PAD151936]" and toks[-1] == "[PAD152063]"
    assert set(types[151936:]) == {TokenType.UNUSED}
    try:
        from llama_cpp import Llama
    except ImportError:
        return
    assert Llama(model_path=str(out), n_ctx=64, verbose=False).n_vocab() == 152064  # llama.cpp loads it


def test_moe_geometry_loads_on_the_integer_kernels(tmp_path: Path) -> None:
    """--experts writes qwen3moe with Q4_K_M's stacked experts (Q4_K; ffn_down_exps Q6_K in the layers with more
    bits) and an F32 router; specserve loads it on the integer kernels (Q4_K/Q6_K experts) and a request's tokens
    are the same alone and in a batch (its experts' rows gathered with other requests')."""
    from gguf import GGUFReader

    from specserve import LLM, SamplingParams
    from specserve.loading.checkpoint import resolve_model_path

    out = tmp_path / "moe.gguf"
    E, USED, EI = 8, 2, 256
    msg.main(["--out", str(out), "--tokenizer-from", str(resolve_model_path("smollm2-135m")), "--vocab-rows", "0",
              "--hidden", str(H), "--layers", str(LAYERS), "--heads", str(HEADS), "--kv-heads", str(KV),
              "--experts", str(E), "--experts-used", str(USED), "--expert-intermediate", str(EI)])
    r = GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert (r.fields["qwen3moe.expert_count"].contents(), r.fields["qwen3moe.expert_used_count"].contents()) == (E, USED)
    t = {x.name: x for x in r.tensors}
    heavy = msg.more_bits_layers(LAYERS)
    for i in range(LAYERS):
        p = f"blk.{i}."
        assert t[p + "ffn_gate_inp.weight"].tensor_type.name == "F32"
        assert t[p + "ffn_down_exps.weight"].tensor_type.name == ("Q6_K" if i in heavy else "Q4_K")
        assert tuple(reversed(t[p + "ffn_up_exps.weight"].shape.tolist())) == (E, EI, H)
        assert p + "attn_q.bias" not in t and tuple(t[p + "attn_q_norm.weight"].shape.tolist()) == (H // HEADS,)
    llm = LLM(str(out), speculative_algorithm="NONE")
    cfg = llm.engine.model.cfg
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        ("qwen3_moe", E, USED, EI)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello, world", "The experts of a layer", "1 2 3 4"]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == alone
    assert all(len(x) == 8 for x in alone)
