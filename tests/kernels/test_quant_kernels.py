"""Block-scaled int8 GEMM (torch.ops.specserve.qgemm): bit-equal to the torch reference on every SIMD path and
thread count, rows independent of the batch, GGUF blocks exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import kernels
from specserve.formats.gguf_blocks import gguf_blocks
from specserve.formats.quant_ref import pack, qgemm_ref, quantize_act_ref

VNNI, AMX, AVX2 = 2, 3, 4  # forced paths (quant_gemm_op.cpp: Impl)
#: 0 = best available (AMX-INT8 for M >= a threshold, else AVX-512-VNNI, else AVX2), 1 = portable, AVX2 forced
PATHS = (0, 1, AVX2)


@pytest.fixture(scope="module", autouse=True)
def _ops() -> None:
    kernels.load()


def _need(impl: int) -> None:
    if impl == AVX2 and "avx2" not in torch.ops.specserve.quant_isa():
        pytest.skip("AVX2 unavailable on this CPU")


def _weights(N: int, K: int, bits: int, has_m: bool, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g) if bits == 4 else torch.randint(-128, 128, (N, K), generator=g)
    d = torch.rand(N, K // 32, generator=g) * 0.02
    m = torch.randn(N, K // 32, generator=g) * 0.02 if has_m else None
    return q, d, m


def _acts(M: int, K: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(1, K, generator=g) * 4
    x[:, 5] *= 300  # a massive-activation channel, as SmolLM2 has
    x[0, 32:64] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("impl", PATHS)
def test_quantize_act_matches_reference(impl: int) -> None:
    _need(impl)
    x = _acts(7, 128)
    x[1, :32] = torch.arange(32) - 15.5  # ties: x·127/amax lands on .5 for several entries
    x[2, 64:96] = 1e-35  # below the zero-block threshold
    got, ref = torch.ops.specserve.quantize_act(x, impl), quantize_act_ref(x)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert bool((ref[0][0, 32:64] == 0).all()) and float(ref[1][2, 2]) == 0.0


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("bits,has_m", [(4, True), (4, False), (8, False), (8, True)])
def test_qgemm_bit_equal_to_reference(bits: int, has_m: bool, impl: int, threads: int) -> None:
    _need(impl)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for M, K, N in ((1, 32, 16), (3, 576, 40), (8, 576, 960), (13, 1536, 72)):  # N % 16 != 0 too
            q, d, m = _weights(N, K, bits, has_m)
            x = _acts(M, K)
            y = torch.ops.specserve.qgemm(x, *pack(q, d, m, bits), N, bits, impl)
            assert torch.equal(y, qgemm_ref(x, q, d, m)), (M, K, N)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("bits", (4, 8))
def test_lm_head_shape_bit_equal_and_rows_independent(bits: int) -> None:
    """SmolLM2's head (N=49152, K=576): both paths equal the reference; rows of an M=8 call equal M=1 calls."""
    N, K = 49152, 576
    q, d, m = _weights(N, K, bits, has_m=bits == 4)
    w = pack(q, d, m, bits)
    x = _acts(8, K)
    ref = qgemm_ref(x, q, d, m)
    for impl in _available_paths():
        y = torch.ops.specserve.qgemm(x, *w, N, bits, impl)
        assert torch.equal(y, ref)
        for r in (0, 3, 7):
            assert torch.equal(torch.ops.specserve.qgemm(x[r:r + 1], *w, N, bits, impl)[0], y[r])


def test_rows_do_not_depend_on_the_batch() -> None:
    """Verify (M = 1..17 rows) vs decode (M = 1): every row bit-identical, on every path."""
    q, d, m = _weights(960, 576, 4, True)
    w = pack(q, d, m, 4)
    x = _acts(17, 576)
    for impl in _available_paths():
        single = torch.cat([torch.ops.specserve.qgemm(x[i:i + 1], *w, 960, 4, impl) for i in range(17)])
        for M in (2, 5, 8, 9, 16, 17):
            assert torch.equal(torch.ops.specserve.qgemm(x[:M], *w, 960, 4, impl), single[:M])


def _available_paths() -> list[int]:
    isa = torch.ops.specserve.quant_isa()
    return [1, 0] + ([AVX2] if "avx2" in isa else []) + ([VNNI] if "avx512vnni" in isa else []) + \
        ([AMX] if "amx" in isa else [])


@pytest.mark.parametrize("bits,has_m", [(4, True), (4, False), (8, False), (8, True)])
def test_fp16_scales_packed_when_exact_and_bit_equal(bits: int, has_m: bool) -> None:
    """pack stores d/m as fp16 exactly when every value is an fp16 (GGUF's own scales), else fp32; both layouts
    give the reference's bits on every path the CPU has, for M from decode to past the AMX threshold (auto: 16-row
    AMX chunks with a rest of up to 3 rows on VNNI, 17 and 35, or a zero-padded AMX chunk, 28 and 40)."""
    N, K = 72, 576
    q, d, m = _weights(N, K, bits, has_m)
    assert pack(q, d, m, bits)[1].dtype == torch.float32  # random fp32 scales are not fp16 values
    d16 = d.half().float()
    m16 = None if m is None else m.half().float()
    w16 = pack(q, d16, m16, bits)
    assert w16[1].dtype == torch.float16 and (m16 is None or w16[2].dtype == torch.float16)
    w32 = tuple(t if t is None or t.dtype == torch.uint8 else t.float() for t in w16)
    x = _acts(40, K)
    ref = qgemm_ref(x, q, d16, m16)
    for impl in _available_paths():
        for M in (1, 5, 9, 17, 28, 35, 40):
            y16 = torch.ops.specserve.qgemm(x[:M], *w16, N, bits, impl)
            assert torch.equal(y16, ref[:M]), (impl, M)
            assert torch.equal(torch.ops.specserve.qgemm(x[:M], *w32, N, bits, impl), y16), (impl, M)
    with pytest.raises(RuntimeError, match="dtype"):  # offsets must match the scales' dtype
        torch.ops.specserve.qgemm(x, w16[0], w16[1], w16[1].float(), N, bits)


def test_pack_rejects_out_of_range_4bit_codes() -> None:
    q, d, m = _weights(16, 32, 8, False)
    with pytest.raises(ValueError, match="0..15"):
        pack(q, d, m, 4)


@pytest.mark.parametrize("qtype,size,per", [("Q8_0", 34, 32), ("Q4_0", 18, 32), ("Q4_1", 20, 32), ("Q4_K", 144, 256)])
def test_gguf_blocks_are_exact(qtype: str, size: int, per: int) -> None:
    """Random raw GGUF blocks: our (q, d, m) reproduce gguf-py's dequantization exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    N, K = 8, 512
    raw = rng.integers(0, 256, (N, K // per * size), dtype=np.uint8)
    b = raw.reshape(N, K // per, size)
    f16 = lambda a: np.frombuffer(a.astype(np.float16).tobytes(), np.uint8).reshape(N, K // per, 2)  # noqa: E731
    b[..., 0:2] = f16(rng.random((N, K // per)) * 0.01)
    if qtype in ("Q4_1", "Q4_K"):
        b[..., 2:4] = f16(rng.standard_normal((N, K // per)) * 0.01)
    ref = dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(N, K).astype(np.float32)
    codes = gguf_blocks(raw, qtype, (N, K))
    assert codes is not None and codes.bits == (8 if qtype == "Q8_0" else 4)
    assert np.array_equal(codes.dequantize().numpy(), ref)


def _need_amx() -> None:
    if "amx" not in torch.ops.specserve.quant_isa():
        pytest.skip("AMX-INT8 unavailable: the CPU lacks amx_int8 or Linux refused the tile-data permission")


def _need_vnni() -> None:
    if "avx512vnni" not in torch.ops.specserve.quant_isa():
        pytest.skip("AVX-512-VNNI unavailable on this CPU")


@pytest.mark.parametrize("bits,has_m", [(4, True), (4, False), (8, False), (8, True)])
def test_amx_bit_equal_to_vnni_portable_and_reference(bits: int, has_m: bool) -> None:
    """The forced AMX path for every M in 1..33 (one, two and three 16-row chunks, partial ones) and N not a
    multiple of 16: bit-equal to the VNNI path, the portable path and the torch reference; rows independent."""
    _need_amx()
    _need_vnni()
    for K, N in ((32, 16), (576, 40), (1536, 72), (96, 7)):
        q, d, m = _weights(N, K, bits, has_m, seed=K + N)
        w = pack(q, d, m, bits)
        x = _acts(33, K)
        ref = qgemm_ref(x, q, d, m)
        single = torch.cat([torch.ops.specserve.qgemm(x[i:i + 1], *w, N, bits, AMX) for i in range(33)])
        assert torch.equal(single, ref), (K, N)
        for M in range(2, 34):
            y = torch.ops.specserve.qgemm(x[:M], *w, N, bits, AMX)
            assert torch.equal(y, single[:M]), (K, N, M)
        for impl in (VNNI, 1, 0):
            assert torch.equal(torch.ops.specserve.qgemm(x, *w, N, bits, impl), ref), (K, N, impl)


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("bits", (4, 8))
def test_amx_lm_head_shape_and_threads(bits: int, threads: int) -> None:
    """SmolLM2's head (N=49152, K=576) on the AMX path, 1 and 2 threads: equal to the reference and to the
    VNNI path; rows of M=17 equal M=1 calls."""
    _need_amx()
    N, K = 49152, 576
    q, d, m = _weights(N, K, bits, has_m=bits == 4)
    w = pack(q, d, m, bits)
    x = _acts(17, K)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = torch.ops.specserve.qgemm(x, *w, N, bits, AMX)
        assert torch.equal(y, qgemm_ref(x, q, d, m))
        assert torch.equal(y, torch.ops.specserve.qgemm(x, *w, N, bits, VNNI))
        for r in (0, 9, 16):
            assert torch.equal(torch.ops.specserve.qgemm(x[r:r + 1], *w, N, bits, AMX)[0], y[r])
    finally:
        torch.set_num_threads(old)


def test_forced_amx_runs_or_fails_loudly() -> None:
    """A forced path the CPU lacks must raise, never fall back silently (the AMX tests above rely on it)."""
    q, d, m = _weights(16, 32, 4, True)
    x, w = _acts(2, 32), pack(q, d, m, 4)
    if "amx" in torch.ops.specserve.quant_isa():
        assert torch.equal(torch.ops.specserve.qgemm(x, *w, 16, 4, AMX), qgemm_ref(x, q, d, m))
    else:
        with pytest.raises(RuntimeError, match="AMX"):
            torch.ops.specserve.qgemm(x, *w, 16, 4, AMX)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bits,has_m", [(4, True), (8, False)])
def test_a_nan_or_inf_activation_makes_its_row_nan(bad: float, bits: int, has_m: bool) -> None:
    """A non-finite activation makes its row of an integer GEMM all NaN on every path (so the engine fails that
    request instead of emitting tokens from 0 logits), as the reference does; other rows stay bit-equal."""
    M, K, N = 20, 576, 40  # 20 rows: a full AMX chunk where the CPU has AMX
    q, d, m = _weights(N, K, bits, has_m)
    x = _acts(M, K)
    x[3, 100] = bad
    ref, want = quantize_act_ref(x), qgemm_ref(x, q, d, m)
    assert torch.isnan(ref[1][3, 3]) and int(torch.isnan(ref[1]).sum()) == 1 and torch.isnan(want[3]).all()
    rest = [r for r in range(M) if r != 3]
    for impl in _available_paths():
        for a, b in zip(torch.ops.specserve.quantize_act(x, impl), ref):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), impl
        y = torch.ops.specserve.qgemm(x, *pack(q, d, m, bits), N, bits, impl)
        assert torch.isnan(y[3]).all() and torch.equal(y[rest], want[rest]), impl
