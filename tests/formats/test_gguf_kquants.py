"""GGUF Q5_0/Q5_1/Q4_K/Q5_K/Q6_K natively in the block-scaled GEMM: blocks exact against gguf-py's dequantization,
the kernel bit-equal to the torch reference (quant_ref) on every path, Q4_K bit-identical to its former fp32-scale
form, fused weights of mixed formats (one op, and the C++ layer loop)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import kernels
from specserve.formats.gguf_blocks import UnsupportedBlockType, gguf_blocks
from specserve.formats.quant import BlockQuantWeight, SegmentedCodes, cat_rows, pack_codes
from specserve.formats.quant_ref import pack, qgemm_ref

PORTABLE, VNNI, AMX, AVX2 = 1, 2, 3, 4  # quant_gemm_op.cpp: Impl (0 = auto)
SIZES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
         "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}
NEW = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module", autouse=True)
def _ops() -> None:
    kernels.load()


def raw_blocks(qtype: str, N: int, K: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Random but valid raw GGUF bytes [N, row bytes]: random codes and scale codes, finite fp16 d (and m/dmin)."""
    rng = np.random.default_rng(seed)
    size, per = SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // per * size), dtype=np.uint8)
    b = raw.reshape(N, K // per, size)
    f16 = lambda a: np.frombuffer(a.astype(np.float16).tobytes(), np.uint8).reshape(N, K // per, 2)  # noqa: E731
    at = 208 if qtype == "Q6_K" else 0
    b[..., at:at + 2] = f16(rng.standard_normal((N, K // per)) * scale)
    if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        b[..., 2:4] = f16(rng.standard_normal((N, K // per)) * scale)
    return raw


def _acts(M: int, K: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(1, K, generator=g) * 4
    x[:, 5] *= 300  # a massive-activation channel
    x[0, 32:64] = 0  # an all-zero block
    return x


def _paths() -> list[int]:
    isa = torch.ops.specserve.quant_isa()
    return [0, PORTABLE] + ([AVX2] if "avx2" in isa else []) + ([VNNI] if "avx512vnni" in isa else []) + \
        ([AMX] if "amx" in isa else [])


@pytest.mark.parametrize("qtype", list(SIZES))
def test_blocks_exact_against_gguf(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    N, K = 8, 512
    raw = raw_blocks(qtype, N, K)
    ref = dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(N, K).astype(np.float32)
    codes = gguf_blocks(raw, qtype, (N, K))
    assert np.array_equal(codes.dequantize().numpy(), ref)
    perm = torch.randperm(N)
    assert torch.equal(codes.rows(lambda t: t[perm]).dequantize(), codes.dequantize()[perm])
    assert torch.equal(codes.cols(256, 512).dequantize(), codes.dequantize()[:, 256:])


def test_unknown_block_type_names_tensor() -> None:
    with pytest.raises(UnsupportedBlockType, match=r"blk\.3\.ffn_down\.weight.*Q3_K"):
        gguf_blocks(np.zeros(110 * 4, np.uint8), "Q3_K", (4, 256), name="blk.3.ffn_down.weight")
    assert gguf_blocks(np.zeros(64, np.uint8), "F32", (4, 4), name="x") is None


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("qtype", NEW)
def test_kernel_bit_equal_to_reference(qtype: str, threads: int) -> None:
    """Every path (AMX takes Q4_K, from 32 rows under auto, and routes the others to VNNI) equals quant_ref
    bit for bit, for decode to past both AMX thresholds (33: a row past two full chunks goes to VNNI; 36: a
    zero-padded chunk), N not a multiple of 16; rows do not depend on M."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for N, K in ((40, 256), (72, 1536)):
            codes = gguf_blocks(raw_blocks(qtype, N, K, seed=N), qtype, (N, K))
            wp, wd, wm, n, fmt = pack_codes(codes)
            x = _acts(36, K)
            ref = qgemm_ref(x, *codes.blocks32())
            for impl in _paths():
                for M in (1, 3, 8, 13, 17, 33, 36):
                    assert torch.equal(torch.ops.specserve.qgemm(x[:M], wp, wd, wm, n, fmt, impl), ref[:M]), (impl, M)
            y1 = torch.cat([torch.ops.specserve.qgemm(x[i:i + 1], wp, wd, wm, n, fmt, VNNI if VNNI in _paths() else 0)
                            for i in range(36)])
            assert torch.equal(y1, ref)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("qtype", NEW)
def test_gemm_close_to_dequantized_weight(qtype: str) -> None:
    """Against x·Wᵀ with the file's exact fp32 weight: only the activations' int8 rounding differs."""
    N, K = 64, 1536
    codes = gguf_blocks(raw_blocks(qtype, N, K, seed=3), qtype, (N, K))
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(4))
    y = BlockQuantWeight(codes)(x)
    exact = x.double() @ codes.dequantize().double().T
    err = (y.double() - exact).norm() / exact.norm()
    assert float(err) < 1.5e-2, float(err)


@pytest.mark.parametrize("qtype", ("Q4_K", "Q5_K"))
def test_kquant_bits_identical_to_fp32_scale_form(qtype: str) -> None:
    """The native super-block form streams fp16 d/dmin and u8 codes yet gives the bits of the former per-block
    fp32 scales d·sc and −dmin·mn (what Q4_K used before), on every path."""
    N, K = 48, 512
    codes = gguf_blocks(raw_blocks(qtype, N, K, seed=5), qtype, (N, K))
    q, d, m = codes.blocks32()
    flat = pack(q, d, m, codes.bits)
    assert flat[1].dtype == torch.float32  # d·sc is not fp16-exact: that form streamed 6 bits/weight for Q4_K
    x = _acts(17, K)
    for impl in _paths():
        assert torch.equal(torch.ops.specserve.qgemm(x, *flat, N, codes.bits, impl),
                           torch.ops.specserve.qgemm(x, *pack_codes(codes)[:3], N, 32 | codes.bits, impl)), impl


def test_packed_sizes() -> None:
    """Bits streamed per weight: Q6_K, Q5_0, Q5_1 the file's own (6.5625, 5.5, 6); Q4_K/Q5_K 0.125 more than the
    file's (a byte per 6-bit scale and min code): 4.625, 5.625 (it was 6 for Q4_K with fp32 d·sc, −dmin·mn)."""
    N, K = 64, 1024
    for qtype, bpw in (("Q4_K", 4.625), ("Q5_K", 5.625), ("Q6_K", 6.5625), ("Q5_0", 5.5), ("Q5_1", 6.0)):
        wp, wd, wm, _, _ = pack_codes(gguf_blocks(raw_blocks(qtype, N, K), qtype, (N, K)))
        total = sum(t.numel() * t.element_size() for t in (wp, wd, wm) if t is not None)
        assert total * 8 / (N * K) == bpw, qtype


def test_mixed_fused_weight_one_op() -> None:
    """q|k (Q4_K) | v (Q6_K) | a Q5_0 part: segments written by one op, equal to the reference of the whole."""
    K = 512
    parts = [gguf_blocks(raw_blocks(t, n, K, seed=n), t, (n, K)) for t, n in (("Q4_K", 64), ("Q4_K", 24), ("Q6_K", 40),
                                                                               ("Q5_0", 8))]
    fused = cat_rows(parts)
    assert isinstance(fused, SegmentedCodes) and [p.q.shape[0] for p in fused.parts] == [88, 40, 8]
    w = BlockQuantWeight(fused)
    x = _acts(13, K)
    ref = qgemm_ref(x, *fused.blocks32())
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for impl in _paths():
        y = torch.ops.specserve.qgemm_segs(x, w._flat, w._dims, impl)
        assert torch.equal(y, ref), impl
    assert torch.equal(w(x[:1]), ref[:1])


def test_expert_gemm_gives_each_groups_own_bits() -> None:
    """qgemm_experts: row ranges of one activation matrix, each on its own expert of a stacked fused Q4_K | Q6_K
    projection, plus one more (activation, weight) pair in the same loop: every group's rows and the pair are the
    bits qgemm_segs gives them alone, on every path; StackedQuantWeight's experts are views of its stacked
    segments with the same bits; a group out of range is an error."""
    from specserve.formats.quant import StackedQuantWeight

    experts = [BlockQuantWeight(cat_rows([gguf_blocks(raw_blocks(t, n, 512, seed=10 * e + n), t, (n, 512))
                                          for t, n in (("Q4_K", 48), ("Q6_K", 40))])) for e in range(3)]
    stacked = StackedQuantWeight(experts)
    flat = [t for seg in stacked.segments for t in seg[:3]]
    dims = [len(stacked.segments), *(v for seg in stacked.segments for v in seg[3:])]
    extra = BlockQuantWeight(gguf_blocks(raw_blocks("Q6_K", 32, 256, seed=7), "Q6_K", (32, 256)))
    x, ex = _acts(9, 512, seed=1), _acts(3, 256, seed=2)
    groups = [(0, 0, 1), (2, 1, 5), (1, 6, 3)]  # (expert, first row, rows): sorted by expert as moe.cpp sorts them
    for impl in _paths():
        y, ey = torch.ops.specserve.qgemm_experts(x, flat, dims, [v for g in groups for v in g], ex, extra._flat,
                                                  [len(extra.segments), *extra._dims], impl)
        for e, r0, m in groups:
            assert torch.equal(y[r0:r0 + m], torch.ops.specserve.qgemm_segs(x[r0:r0 + m], experts[e]._flat,
                                                                              experts[e]._dims, impl)), impl
        assert torch.equal(ey, torch.ops.specserve.qgemm_segs(ex, extra._flat, extra._dims, impl)), impl
    y, = torch.ops.specserve.qgemm_experts(x, flat, dims, [1, 0, 9], x, [], [0])  # no extra pair
    assert torch.equal(y, experts[1](x))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.specserve.qgemm_experts(x, flat, dims, [3, 0, 9], x, [], [0])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.specserve.qgemm_experts(x, flat, dims, [0, 5, 5], x, [], [0])
    x5 = _acts(5, 512)
    assert len(stacked) == 3 and all(torch.equal(stacked[e](x5), experts[e](x5)) for e in range(3))
    assert stacked.segments[0][0].shape[0] == 3 and stacked[1].wp.data_ptr() != experts[1].wp.data_ptr()
    assert not StackedQuantWeight.stackable([experts[0], extra])


def test_cpp_layer_loop_with_mixed_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M-style model (q, k, gate Q4_K; v, down Q6_K; up Q5_K; o Q5_0) keeps the C++ layer loop, which
    equals the Python loop bit for bit."""
    from specserve.cache.kv_pool import KVPool
    from specserve.models.llama import LlamaModel
    from specserve.formats.quant import quantize_model
    from specserve.runtime.runner import ModelRunner
    from tests.tiny import tiny_model

    model = tiny_model("llama", dtype=torch.float32, hidden_size=256, intermediate_size=512, head_dim=64)
    kinds = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q4_K", "self_attn.v_proj": "Q6_K",
             "self_attn.o_proj": "Q5_0", "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q5_K", "mlp.down_proj": "Q6_K"}
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    blocks = {f"model.layers.{i}.{p}.weight": gguf_blocks(raw_blocks(t, *shapes[p], seed=i * 7 + j, scale=3e-4), t,
                                                          shapes[p]) for i in range(2) for j, (p, t) in enumerate(kinds.items())}
    quantize_model(model, "w4a8", blocks)
    assert [len(model.layers[0].qkv_w.segments), len(model.layers[0].gate_up_w.segments)] == [2, 1]
    assert model._layer_stack() is not None

    def run() -> list[torch.Tensor]:
        pool = KVPool(model.cfg, 16, 8, torch.float32)
        runner, tables = ModelRunner(model, pool), [[], []]
        prompts = [[3, 5, 7, 11, 13], [2, 4]]
        for t, p in zip(tables, prompts):
            pool.ensure(t, len(p) + 4)
        out, cap = runner.forward(tables, [0, 0], prompts, [[len(p) - 1] for p in prompts], capture_layers=(0, 1))
        o2, _ = runner.forward(tables, [5, 2], [[1, 2, 3], [4]], [[0, 1, 2], [0]])
        return out + cap + o2

    cpp = run()
    monkeypatch.setattr(LlamaModel, "_layer_stack", lambda self: None)
    py = run()
    assert all(bool(torch.isfinite(a).all()) for a in cpp)
    assert all(torch.equal(a, b) for a, b in zip(cpp, py)) and len(cpp) == len(py)


def test_real_q4_k_m_tensors() -> None:
    """Qwen2.5-Coder Q4_K_M files (when cached): Q4_K, Q6_K and Q5_0 tensors exact against gguf-py, and a fused
    q|k|v of the file's own formats through the kernel equal to the reference."""
    from pathlib import Path

    from gguf import GGUFReader
    from gguf.quants import dequantize

    root = Path.home() / ".cache" / "specserve" / "models"
    files = [root / f"qwen2.5-coder-{s}-instruct-q4_k_m.gguf" for s in ("1.5b", "0.5b")]
    if not all(f.exists() for f in files):
        pytest.skip("Qwen2.5-Coder Q4_K_M GGUFs not cached")
    seen = set()
    for f in files:
        tensors = {t.name: t for t in GGUFReader(f).tensors}
        blk = [tensors[f"blk.0.attn_{p}.weight"] for p in "qkv"]
        parts = []
        for t in blk + [tensors["blk.0.ffn_down.weight"]]:
            shape = tuple(int(s) for s in reversed(t.shape))
            codes = gguf_blocks(t.data, t.tensor_type.name, shape, name=t.name)
            ref = dequantize(t.data, t.tensor_type).reshape(shape)
            assert np.array_equal(codes.dequantize().numpy(), ref), t.name
            seen.add(t.tensor_type.name)
            parts.append(codes)
        fused = cat_rows(parts[:3])
        x = _acts(3, fused.shape[1])
        y = BlockQuantWeight(fused)(x)
        assert torch.equal(y, qgemm_ref(x, *fused.blocks32()))
    assert {"Q4_K", "Q6_K", "Q5_0"} <= seen
