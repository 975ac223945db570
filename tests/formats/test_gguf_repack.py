"""The C++ GGUF repack (`gguf_repack`, `RawBlocks.pack`, `BlockQuantWeight.from_gguf`) equals the Python path
(`BlockQuantWeight(gguf_blocks(...))`, quant_ref.pack / pack_kquant) bit for bit: every block type, row orders,
column padding, fp32 scales, fused weights (concatenated tiles, mixed formats, joins), the real 1.5B's tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import kernels
from specserve.formats.gguf_repack import RawBlocks, concat_packed
from specserve.formats.quant import BlockQuantWeight, _runs, cat_rows

from .test_gguf_kquants import SIZES, raw_blocks

REAL = Path.home() / ".cache/specserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.fixture(scope="module", autouse=True)
def _ops() -> None:
    kernels.load()


def _same(a: BlockQuantWeight, b: BlockQuantWeight) -> None:
    assert a.shape == b.shape and a.bits == b.bits and len(a.segments) == len(b.segments)
    for sa, sb in zip(a.segments, b.segments):
        assert sa[3:] == sb[3:]
        for x, y in zip(sa[:3], sb[:3]):
            assert (x is None and y is None) or (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))


def _check(parts: list[RawBlocks]) -> BlockQuantWeight:
    got = BlockQuantWeight.from_gguf(parts)
    _same(got, BlockQuantWeight(cat_rows([p.codes() for p in parts])))
    return got


def _raw(qtype: str, N: int, K: int, seed: int = 0, order: bool = False, **kw: float) -> RawBlocks:
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed)) if order else None
    return RawBlocks(raw_blocks(qtype, N, K, seed, **kw), qtype, (N, K), perm)


@pytest.mark.parametrize("order", (False, True))
@pytest.mark.parametrize("N", (16, 40))  # whole tiles, and zero columns past N
@pytest.mark.parametrize("qtype", list(SIZES))
def test_repack_equals_python_pack(qtype: str, N: int, order: bool) -> None:
    w = _check([_raw(qtype, N, 512, seed=N, order=order)])
    assert w.fmt == (32 | w.bits if qtype.endswith("_K") else w.bits)


def test_q4_0_offsets_out_of_fp16_range_stay_fp32() -> None:
    """Q4_0's m = −8·d leaves fp16's range for |d| > 8188: the whole weight's scales are then fp32."""
    raw = _raw("Q4_0", 24, 256, scale=1.0)
    raw.data.reshape(24, -1, 18)[3, 2, :2] = np.frombuffer(np.float16(9000.0).tobytes(), np.uint8)
    w = _check([raw])
    assert w.wd.dtype == torch.float32 and w.wm.dtype == torch.float32
    assert _check([_raw("Q4_0", 24, 256, scale=1.0)]).wd.dtype == torch.float16


@pytest.mark.parametrize("types,concat", [
    (("Q4_K", "Q4_K", "Q6_K"), True),   # Q4_K_M's q|k|v: one concatenated K4 segment, then K6
    (("Q4_0", "Q4_1"), True),           # both F4 with offsets
    (("Q8_0", "Q8_0"), True),
    (("Q4_K", "Q5_K"), False),          # joined as K5 codes by the Python path
    (("Q5_0", "Q5_1"), False),          # Q5_0's signed codes join Q5_1's as 8-bit
    (("Q8_0", "Q4_0"), False),          # F8 without m joins F4 with m
])
def test_fused_parts(types: tuple[str, ...], concat: bool) -> None:
    parts = [_raw(t, 32 * (i + 1), 512, seed=i, order=i == 0) for i, t in enumerate(types)]
    _check(parts)
    joined = [r for r in _runs(parts) if len(r) > 1]
    assert joined and all((concat_packed(r) is not None) == concat for r in joined)


def test_fused_partial_tile_falls_back() -> None:
    """A part that does not fill its last tile cannot be followed by concatenated tiles; the last one may."""
    _check([_raw("Q4_K", 24, 256), _raw("Q4_K", 32, 256, seed=1)])
    _check([_raw("Q4_K", 32, 256), _raw("Q4_K", 24, 256, seed=1)])


def test_bad_arguments_refused() -> None:
    data = torch.zeros(4 * 18, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="K % 32"):
        torch.ops.specserve.gguf_repack(data, "Q4_0", 4, 48)
    with pytest.raises(RuntimeError, match="elements"):
        torch.ops.specserve.gguf_repack(data, "Q4_0", 5, 32)
    with pytest.raises(RuntimeError, match="Q3_K"):
        torch.ops.specserve.gguf_repack(data, "Q3_K", 4, 32)
    with pytest.raises(RuntimeError, match="row order"):
        torch.ops.specserve.gguf_repack(data, "Q4_0", 4, 32, torch.tensor([0, 1, 2, 4]))


@pytest.mark.skipif(not REAL.exists(), reason="Qwen2.5-Coder-1.5B Q4_K_M not fetched (scripts/fetch_qwen_pair.py)")
def test_real_tensors() -> None:
    """Every block type of the real file (Q4_K, Q6_K, and Q8_0/Q5_0 where present), in the file's row order
    and in the llama q/k un-permutation's."""
    from specserve.formats.gguf_file import GGUFFile
    from specserve.loading.gguf import tensor_shape, unpermute_rotary

    reader = GGUFFile(REAL)
    seen: dict[str, str] = {}
    for t in reader.tensors:
        if len(tensor_shape(t)) == 2 and t.tensor_type.name not in seen and t.name != "token_embd.weight":
            seen[t.tensor_type.name] = t.name
    seen["Q4_K"] = "blk.0.attn_q.weight"
    assert {"Q4_K", "Q6_K"} <= set(seen)
    by = {t.name: t for t in reader.tensors}
    for qtype, name in seen.items():
        t = by[name]
        shape = tensor_shape(t)
        _check([RawBlocks(t.data, qtype, shape, None, name)])
        order = unpermute_rotary(torch.arange(shape[0]), 2).contiguous()
        _check([RawBlocks(t.data, qtype, shape, order, name)])
