"""Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE on tiny random models: specserve's greedy tokens equal transformers'
(HF directory, fp32, and the same directory converted by llama.cpp's convert_hf_to_gguf.py); a Q8_0 conversion
runs every expert on the integer kernels, bit-equal whether a token runs alone, in a verify window or in a batch
of 16; routing ties go as torch.topk (the reference) breaks them; a router wired to a wrong expert fails the
equality; TP is refused. Speculation on these targets: test_moe_speculation.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specserve.bench.real import file_weight_bytes, streamed_weight_bytes
from specserve.engine.llm import LLM
from specserve.formats.quant import BlockQuantWeight, StackedQuantWeight
from specserve.models import moe
from specserve.models.config import ModelConfig
from tests.families_setup import PROMPTS
from tests.models.test_families import CONVERTER, ENGINE, GREEDY, spm_model  # noqa: F401  (the fixture)
from tests.moe_setup import EXPERTS, MOE_FAMILIES, TOP_K, moe_greedy, moe_model, save_moe_dir

# llama.cpp's converter reads a BPE vocabulary for these through AutoTokenizer (which a tiny word-level one does
# not pass); they take the SentencePiece vocabulary as test_families' do. Tensors and metadata are the converter's.
_CONVERT = ("import runpy, sys; sys.path.insert(0, sys.argv[1])\n"
            "from conversion.qwen import Qwen2MoeModel; from conversion.olmo import OlmoeModel\n"
            "for c in (Qwen2MoeModel, OlmoeModel): c.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _reference(family: str) -> list[list[int]]:
    """transformers' greedy tokens of PROMPTS (moe_setup's model, whatever it is now)."""
    return [moe_greedy(family, p, GREEDY.max_tokens) for p in PROMPTS]


_REFERENCE: dict[str, list[list[int]]] = {}


def _reference_of(family: str) -> list[list[int]]:
    """`_reference` of the family's unmodified model, computed once."""
    if family not in _REFERENCE:
        _REFERENCE[family] = _reference(family)
    return _REFERENCE[family]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {f: save_moe_dir(root / f, f) for f in MOE_FAMILIES}


@pytest.fixture(scope="module")
def ggufs(dirs: dict[str, str], spm_model: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201, F811
    """(family, outtype) → a GGUF from llama.cpp's convert_hf_to_gguf.py, converted on first use."""
    if not CONVERTER.is_file():
        pytest.skip(f"{CONVERTER} is missing: `scripts/setup.sh test` unpacks llama.cpp's converter there")
    root, made = tmp_path_factory.mktemp("moe_gguf"), {}

    def get(family: str, outtype: str) -> str:
        if (family, outtype) not in made:
            src = root / f"{family}.{outtype}"
            shutil.copytree(dirs[family], src)
            shutil.copy(spm_model, src / "tokenizer.model")
            (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
            out = root / f"{family}.{outtype}.gguf"
            env = {"PYTHONPATH": str(CONVERTER.parent / "gguf-py"), "PATH": ""}
            run = subprocess.run([sys.executable, "-c", _CONVERT, str(CONVERTER.parent), str(CONVERTER), str(src),
                                  "--outfile", str(out), "--outtype", outtype],
                                 capture_output=True, text=True, env=env, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            made[family, outtype] = str(out)
        return made[family, outtype]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_equals_transformers(dirs: dict[str, str], family: str) -> None:
    llm = LLM(dirs[family], dtype="float32", **ENGINE)
    assert llm.engine.model.cfg.architecture == family
    assert _tokens(llm) == _reference_of(family)


def test_configs_read_each_familys_switches() -> None:
    cfg = {f: ModelConfig.from_hf_dict(moe_model(f).config.to_dict()) for f in MOE_FAMILIES}
    assert all((c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (EXPERTS, TOP_K, 32)
               for c in cfg.values())
    q3, q2, mx, ol = (cfg[f] for f in MOE_FAMILIES)
    assert q3.norm_topk_prob and q3.qk_norm and not q3.qk_norm_whole and not q3.shared_expert_intermediate_size
    assert not q2.norm_topk_prob and q2.attention_bias and q2.shared_expert_intermediate_size == 64
    assert mx.norm_topk_prob and not mx.qk_norm
    assert not ol.norm_topk_prob and ol.qk_norm and ol.qk_norm_whole
    dense = moe_model("qwen3_moe").config.to_dict() | {"mlp_only_layers": [0]}
    with pytest.raises(ValueError, match="dense MLP layers"):
        ModelConfig.from_hf_dict(dense)


def test_tensor_parallel_refused_by_name(dirs: dict[str, str]) -> None:
    """Before any process starts."""
    with pytest.raises(ValueError, match="mixture-of-experts targets \\(mixtral\\)"):
        LLM(dirs["mixtral"], dtype="float32", tp_size=2, **ENGINE)


# each conversion runs llama.cpp's converter (seconds): the families whose GGUF layout is their own (qwen2_moe's
# shared expert, Mixtral's `llama` with interleaved q/k) always, the other two with the slow tests
CONVERTED = [pytest.param(f, marks=[] if f in ("qwen2_moe", "mixtral") else [pytest.mark.slow]) for f in MOE_FAMILIES]


@pytest.mark.parametrize("family", CONVERTED)
def test_llama_cpp_conversion_loads_with_equal_tokens(ggufs, family: str) -> None:  # noqa: ANN001
    """An f32 GGUF (stacked `ffn_*_exps`, `ffn_gate_inp`, qwen2_moe's `*_shexp`; Mixtral's says `llama` with
    interleaved q/k rows) gives transformers' tokens."""
    llm = LLM(ggufs(family, "f32"), **ENGINE)
    assert llm.engine.model.cfg.architecture == family
    assert _tokens(llm) == _reference_of(family)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_f32_gguf_streamed_into_w8a8_equals_the_hf_directory_quantized(dirs: dict[str, str], ggufs,  # noqa: ANN001
                                                                        family: str) -> None:
    """The streaming GGUF load re-quantizes each expert of a stacked float tensor (and un-permutes Mixtral's q/k)
    into the packed weights quantizing the HF directory gives: the same logits, bit for bit."""
    from tests.tiny import ref_logits

    a = LLM(ggufs(family, "f32"), quantization="w8a8", **ENGINE).engine.model
    b = LLM(dirs[family], quantization="w8a8", **ENGINE).engine.model
    assert isinstance(a.layers[0].experts_gate_up[0], BlockQuantWeight)
    ids = list(range(3, 40, 3))
    assert torch.equal(ref_logits(a, ids), ref_logits(b, ids))


def _logits_each_way(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """Logits after each prefix of `ids`: all rows in one forward, one row per forward (decode), four rows per
    forward (a verify window of K = 4); and the last row of 16 requests in one step against each alone."""
    from specserve.cache.kv_pool import KVPool
    from specserve.runtime.runner import ModelRunner

    def run(width: int) -> torch.Tensor:
        kv = KVPool(model.cfg, num_pages=8, page_size=16, dtype=model.dtype)
        pt: list[int] = []
        kv.ensure(pt, len(ids))
        runner, out = ModelRunner(model, kv), []
        for s in range(0, len(ids), width):
            chunk = ids[s:s + width]
            out.append(runner.forward([pt], [s], [chunk], [list(range(len(chunk)))])[0][0])
        return torch.cat(out)

    kv = KVPool(model.cfg, num_pages=32, page_size=16, dtype=model.dtype)
    tables = [[] for _ in range(16)]
    for pt in tables:
        kv.ensure(pt, 3)
    runner = ModelRunner(model, kv)
    reqs = [[ids[i], ids[(i + 5) % len(ids)], ids[(i + 9) % len(ids)]] for i in range(16)]
    batch = torch.cat(runner.forward(tables, [0] * 16, reqs, [[2]] * 16)[0])
    alone = torch.cat([runner.forward([pt], [0], [r], [[2]])[0][0] for pt, r in zip(tables, reqs)])
    return {"prefill": run(len(ids)), "decode": run(1), "verify": run(4), "batch16": batch, "alone16": alone}


@pytest.mark.parametrize("family", CONVERTED)
def test_q8_0_conversion_serves_bit_equal_on_the_integer_kernels(ggufs, family: str) -> None:  # noqa: ANN001
    """A Q8_0 GGUF defaults to w8a8: every expert its own packed weight from the file's blocks. A token's logits
    are the same bits in a prefill, a decode, a verify window and a batch of 16 requests; they stay close to the
    same blocks dequantized into fp32."""
    from tests.tiny import ref_logits

    path = ggufs(family, "q8_0")
    fast, exact = LLM(path, **ENGINE).engine.model, LLM(path, dtype="float32", **ENGINE).engine.model
    assert fast._layer_stack() is not None  # the whole layer loop is one C++ op, the MoE blocks in it
    experts = fast.layers[0].experts_down
    assert isinstance(experts, StackedQuantWeight) and len(experts) == EXPERTS and isinstance(experts[0], BlockQuantWeight)
    ids = [t for p in PROMPTS for t in p][:16]
    ways = _logits_each_way(fast, ids)
    for way in ("decode", "verify"):
        assert torch.equal(ways[way], ways["prefill"]), way
    assert torch.equal(ways["batch16"], ways["alone16"])
    a, b = ref_logits(fast, ids), ref_logits(exact, ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
    # bench real's bytes a decode step reads, packed and in the file: a token's k experts of E, both
    assert 0.8 < streamed_weight_bytes(fast) / file_weight_bytes(path) < 1.2


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cpp_layer_loop_gives_the_python_loops_bits(dirs: dict[str, str], family: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole layer loop as one C++ op with the MoE blocks in it (q/k norms per head in qwen3_moe, over the
    projection in olmoe; qwen2_moe's shared expert) gives the Python loop's logits, expert by expert, bit for bit:
    in a prefill, decode, verify windows and a batch of 16."""
    model = LLM(dirs[family], quantization="w8a8", **ENGINE).engine.model
    assert model._layer_stack() is not None
    ids = [t for p in PROMPTS for t in p][:16]
    cpp = _logits_each_way(model, ids)
    monkeypatch.setattr(moe.MoEDecoderLayer, "mlp_stackable", lambda self: False)
    model._stack = None
    assert model._layer_stack() is None
    py = _logits_each_way(model, ids)
    assert cpp.keys() == py.keys() and all(torch.equal(cpp[k], py[k]) for k in cpp)


def _reference_moe(layer: moe.MoEDecoderLayer, h: torch.Tensor) -> torch.Tensor:
    """One token at a time, each of its k experts in top-k order, straight from the layer's weights."""
    rows = []
    for x in h.split(1):
        logits = torch.ops.specserve.router_logits(x, layer.router_w)
        probs = F.softmax(logits[:, :layer.num_experts], dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, layer.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) if layer.norm_topk else w
        out = torch.zeros_like(x)
        for j, e in enumerate(idx[0].tolist()):
            gate, up = layer.experts_gate_up[e](x).chunk(2, dim=-1)
            out = out + layer.experts_down[e](F.silu(gate) * up) * w[0, j]
        if layer.gate_up_w is not None:
            gate, up = layer.gate_up_w(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(logits[:, layer.num_experts:]) * layer.down_w(F.silu(gate) * up)
        rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_expert_kernel_bit_equal_to_reference(dirs: dict[str, str], family: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE block on w8a8 weights (HF weights quantized here): batch 16, verify windows of 4 and single rows
    give the per-token reference's bits; a step runs only the experts its rows route to, and counts them. The
    one-op block (kernels/csrc/moe.cpp, on the stacked experts) gives the Python loop's bits."""
    model = LLM(dirs[family], quantization="w8a8", **ENGINE).engine.model
    layer = model.layers[1]
    h = torch.randn(16, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = _reference_moe(layer, h)
    assert torch.equal(layer._mlp(h), ref)
    assert torch.equal(torch.cat([layer._mlp(c) for c in h.split(4)]), ref)
    assert torch.equal(torch.cat([layer._mlp(c) for c in h.split(1)]), ref)
    fused = layer._mlp_fused(h)  # the lean loop's (the activation one op): batch-invariant too
    assert torch.equal(torch.cat([layer._mlp_fused(c) for c in h.split(4)]), fused)
    assert torch.equal(torch.cat([layer._mlp_fused(c) for c in h.split(1)]), fused)
    assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5)
    assert layer.mlp_stackable() and layer.touched == sorted(set(moe.route(
        torch.ops.specserve.router_logits(h[-1:], layer.router_w)[:, :EXPERTS], TOP_K, layer.norm_topk)[1][0].tolist()))
    monkeypatch.setattr(moe.MoEDecoderLayer, "mlp_stackable", lambda self: False)  # the Python loop, expert by expert
    assert torch.equal(layer._mlp_fused(h), fused)
    assert torch.equal(torch.cat([layer._mlp_fused(c) for c in h.split(1)]), fused)
    monkeypatch.undo()
    routed = moe.route(torch.ops.specserve.router_logits(h[:1], layer.router_w)[:, :EXPERTS], TOP_K,
                       layer.norm_topk)[1]
    layer._mlp(h[:1])
    assert layer.touched == sorted(routed[0].tolist())  # the others are not run
    per_expert = layer.expert_nbytes(0)
    assert per_expert == sum(t.numel() * t.element_size() for w in (layer.experts_gate_up[0], layer.experts_down[0])
                             for t in (w.wp, w.wd, w.wm) if t is not None)
    model.layers[0]._mlp(h)
    assert model.expert_reads() == [len(model.layers[0].touched), TOP_K]
    assert model.expert_bytes_read() == sum(model.expert_reads()) * per_expert


def _tied(family: str) -> torch.nn.Module:
    """The family's model with every router's rows equal in quads (experts 0-3, 4-7): a route's top 2 are two of
    four experts of exactly equal probability, so the tie-break picks them (and the experts' weights differ)."""
    import copy

    m = copy.deepcopy(moe_model(family))
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.mlp.gate.weight
            w[1:4], w[5:8] = w[0], w[4]
    return m


def _ties_reversed(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` breaking ties the other way: top-k over the experts in reverse order."""
    w, idx = moe.route(logits.flip(-1), k, norm)
    return w, logits.shape[-1] - 1 - idx


def test_routing_ties_broken_as_the_reference_breaks_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact ties between experts whose weights differ: our route picks the experts (and weights) transformers'
    router picks, row by row, and a whole model of tied routers decodes transformers' tokens; breaking the ties
    the other way does not."""
    from tests import moe_setup

    tied = _tied("qwen3_moe")
    router = tied.model.layers[0].mlp.gate
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    _, ref_w, ref_idx = router(h)
    w, idx = moe.route(F.linear(h, router.weight), TOP_K, True)
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    assert (idx[:, 0] // 4 == idx[:, 1] // 4).all()  # two of a tied quad: the tie-break chose them
    assert not torch.equal(_ties_reversed(F.linear(h, router.weight), TOP_K, True)[1].sort(-1)[0], idx.sort(-1)[0])
    monkeypatch.setattr(moe_setup, "moe_model", lambda family, seed=0, vocab=0: tied)
    path = moe_setup.save_moe_dir(tmp_path / "tied", "qwen3_moe")
    reference = _reference("qwen3_moe")
    assert _tokens(LLM(path, dtype="float32", **ENGINE)) == reference
    monkeypatch.setattr(moe, "route", _ties_reversed)
    assert _tokens(LLM(path, dtype="float32", **ENGINE)) != reference


def test_a_router_wired_to_a_wrong_expert_fails_the_equality(dirs: dict[str, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: route each token's second choice to the next expert, and the tokens leave transformers'."""
    route = moe.route

    def wrong(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        w, idx = route(logits, k, norm)
        idx = idx.clone()
        idx[:, 1] = (idx[:, 1] + 1) % logits.shape[-1]
        idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 1] + 1) % logits.shape[-1], idx[:, 1])
        return w, idx

    monkeypatch.setattr(moe, "route", wrong)
    assert _tokens(LLM(dirs["mixtral"], dtype="float32", **ENGINE)) != _reference_of("mixtral")
