"""The lean layer loop (specserve/models/fused.py, kernels/csrc/{attention,fused}.cpp) against the
pure-torch reference: same results, ragged attention that computes no padded rows, batch invariance,
NaN/Inf isolation."""
from __future__ import annotations

import pytest
import torch

from specserve.cache.kv_pool import KVPool
from specserve.runtime.runner import ModelRunner
from specserve.models import fused
from specserve.models.forward_batch import build_forward_batch
from specserve.models.attention import reference_attention
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not fused.available(), reason="C++ extension not buildable here")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _pool(dtype: torch.dtype, slots: int = 256, kvh: int = 2, hd: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, kvh, hd, generator=g).to(dtype), torch.randn(slots, kvh, hd, generator=g).to(dtype)


def _ragged(windows: list[int], ctx: list[int], **kw):
    """Request b: committed ctx[b] tokens, a verify window of windows[b] drafts (k + 1 query rows),
    slots of request b laid out at 40·b (so requests never share a slot)."""
    toks = [[1] * (w + 1) for w in windows]
    ctx_lists = [list(range(40 * b, 40 * b + c + w + 1)) for b, (c, w) in enumerate(zip(ctx, windows))]
    return build_forward_batch(toks, ctx, [cl[c:] for cl, c in zip(ctx_lists, ctx)], ctx_lists, None, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["causal", "window", "block", "tree"])
def test_attention_matches_reference(dtype: torch.dtype, kind: str) -> None:
    windows, ctx = [0, 3, 7, 1, 5], [5, 9, 2, 30, 11]
    kw = {"window": 4} if kind == "window" else {"causal": False} if kind == "block" else {}
    if kind == "tree":
        g = torch.Generator().manual_seed(1)
        kw["masks"] = []
        for w, c in zip(windows, ctx):
            m = torch.rand(w + 1, c + w + 1, generator=g) < 0.6
            m[torch.arange(w + 1), c + torch.arange(w + 1)] = True  # every row sees itself
            kw["masks"].append(m)
    fb = _ragged(windows, ctx, **kw)
    kc, vc = _pool(dtype)
    q = torch.randn(fb.num_tokens, 4, 16).to(dtype)
    ref = reference_attention(q, fb, kc, vc)
    out = fused.attention(q, fb, kc, vc)
    torch.testing.assert_close(out.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


def test_no_padded_rows_computed() -> None:
    """Windows 0..7 (1..8 query rows) over contexts of different lengths: the op computes exactly
    Σ rows × heads query rows and only the causally visible q·k products, never the padded rectangle."""
    windows, ctx = list(range(8)), [3 * b + 2 for b in range(8)]
    fb = _ragged(windows, ctx)
    kc, vc = _pool(torch.float32, slots=400)
    H = 4
    q = torch.randn(fb.num_tokens, H, 16)
    fused.counters(reset=True)
    fused.attention(q, fb, kc, vc)
    rows, dots = fused.counters(reset=True)
    assert rows == sum(w + 1 for w in windows) * H
    visible = sum(c + i + 1 for c, w in zip(ctx, windows) for i in range(w + 1))  # row i sees positions ≤ c + i
    assert dots == visible * H
    padded_rows = len(windows) * (max(windows) + 1) * H
    assert rows < padded_rows and dots < padded_rows * max(c + w + 1 for c, w in zip(ctx, windows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_batch_invariant(dtype: torch.dtype) -> None:
    """A request's rows are bit-identical alone, in a batch, and as a verify row vs a decode row
    (a 13-row window spans two of the kernel's row blocks, which share each K/V read)."""
    windows, ctx = [2, 7, 0, 12], [6, 3, 12, 8]
    kc, vc = _pool(dtype)
    fb = _ragged(windows, ctx)
    q = torch.randn(fb.num_tokens, 4, 16).to(dtype)
    together = fused.attention(q, fb, kc, vc)
    starts = fb.q_start.tolist()
    for b, (w, c) in enumerate(zip(windows, ctx)):
        cl = list(range(40 * b, 40 * b + c + w + 1))
        alone = build_forward_batch([[1] * (w + 1)], [c], [cl[c:]], [cl], None)
        qb = q[starts[b]: starts[b + 1]]
        assert torch.equal(fused.attention(qb, alone, kc, vc), together[starts[b]: starts[b + 1]])
        for i in range(w + 1):  # row i of the window == decode of position c + i
            dec = build_forward_batch([[1]], [c + i], [[cl[c + i]]], [cl[: c + i + 1]], None)
            assert torch.equal(fused.attention(qb[i: i + 1], dec, kc, vc)[0], together[starts[b] + i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_layouts_bit_identical(dtype: torch.dtype) -> None:
    """The pool is head-major ([kv_heads, slots, hd] behind a [slots, kv_heads, hd] view, KVPool): RoPE + KV
    write and attention give the same bits as on slot-major storage; K and V of different layouts are refused."""
    windows, ctx = [3, 0, 6], [5, 9, 2]
    fb = _ragged(windows, ctx)
    g = torch.Generator().manual_seed(3)
    T, H, KVH, hd = fb.num_tokens, 4, 2, 16
    q, k, v = (torch.randn(T, n, hd, generator=g).to(dtype) for n in (H, KVH, KVH))
    pos = torch.arange(64)[:, None].to(torch.float64) * torch.arange(1, hd + 1).to(torch.float64) / hd
    cos, sin = pos.cos().to(dtype), pos.sin().to(dtype)
    outs = []
    for head_major in (False, True):
        kc, vc = _pool(dtype)
        if head_major:
            kc, vc = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (kc, vc))
        qr = q.clone()
        torch.ops.specserve.rope_kv_write(qr, k, v, cos, sin, fb.positions, kc, vc, fb.slot_mapping)
        outs.append((qr, kc.contiguous(), vc.contiguous(), fused.attention(qr, fb, kc, vc)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    kc, vc = _pool(dtype)
    with pytest.raises(RuntimeError, match="one layout"):
        fused.attention(q, fb, kc, vc.transpose(0, 1).contiguous().transpose(0, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_attention_isolates_bad_kv(bad: float) -> None:
    """Request 1's K/V rows poisoned: the other requests' outputs are unchanged and finite."""
    windows, ctx = [3, 2, 5], [4, 7, 6]
    fb = _ragged(windows, ctx)
    kc, vc = _pool(torch.float32)
    q = torch.randn(fb.num_tokens, 4, 16)
    clean = fused.attention(q, fb, kc, vc)
    kc[40:52], vc[40:52] = bad, bad
    out = fused.attention(q, fb, kc, vc)
    s = fb.q_start.tolist()
    for b in (0, 2):
        assert torch.equal(out[s[b]: s[b + 1]], clean[s[b]: s[b + 1]])


def _logits(model, pool, tables, starts, tokens):  # noqa: ANN001, ANN202
    return ModelRunner(model, pool).forward(tables, starts, tokens, [list(range(len(t))) for t in tokens])[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_model_fused_matches_reference(arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(arch).to(dtype)
    model.dtype = dtype
    prompts = [[3, 5, 7, 11, 13], [2, 4], [9] * 9]
    outs = []
    for use_fused in (True, False):
        pool = KVPool(model.cfg, 16, 8, dtype)
        tables = [[] for _ in prompts]
        for t, p in zip(tables, prompts):
            pool.ensure(t, len(p) + 4)
        with fused.reference_layers() if not use_fused else _null():
            first = _logits(model, pool, tables, [0] * 3, prompts)
            second = _logits(model, pool, tables, [len(p) for p in prompts], [[1, 2, 3], [4], [5, 6]])
        outs.append(first + second)
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 0.25}[dtype]
    for a, b in zip(*outs):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


def test_model_fused_row_invariant() -> None:
    """fp32 model, fused path: a verify window's logits equal the decode of each position alone."""
    model = tiny_model(dtype=torch.float32)
    pool = KVPool(model.cfg, 16, 8, torch.float32)
    t: list[int] = []
    pool.ensure(t, 20)
    prompt, window = [3, 5, 7, 11, 13], [17, 19, 23, 29]
    _logits(model, pool, [t], [0], [prompt])
    verify = _logits(model, pool, [t], [len(prompt)], [window])[0]
    for i, tok in enumerate(window):
        dec = _logits(model, pool, [t], [len(prompt) + i], [[tok]])[0]
        torch.testing.assert_close(dec[0], verify[i], atol=1e-5, rtol=1e-5)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hd", [16, 64, 24])
def test_attention_builds_bit_identical(dtype: torch.dtype, hd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX-512 item, the portable C++ compiled for AVX2+FMA and the plain portable build give the
    same bits (SPECSERVE_ATTN_IMPL lowers the build; a CPU without the ISA runs its best one), over
    causal, sliding-window and tree rows, contexts that start off a 16-key boundary, long windows."""
    g = torch.Generator().manual_seed(3)
    windows, ctx = [0, 16, 7, 1], [130, 9, 2, 45]
    for kw in ({}, {"window": 37}, {"masks": [torch.rand(w + 1, c + w + 1, generator=g) < 0.6 for w, c in zip(windows, ctx)]}):
        toks = [[1] * (w + 1) for w in windows]
        cls = [list(range(200 * b + 3, 200 * b + 3 + c + w + 1)) for b, (c, w) in enumerate(zip(ctx, windows))]
        fb = build_forward_batch(toks, ctx, [cl[c:] for cl, c in zip(cls, ctx)], cls, None, **kw)
        kc, vc = (torch.randn(800, 3, hd, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(fb.num_tokens, 9, hd, generator=g).to(dtype) * 3
        outs = []
        for impl in ("avx512", "avx2", "portable"):
            monkeypatch.setenv("SPECSERVE_ATTN_IMPL", impl)
            outs.append(fused.attention(q, fb, kc, vc))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        torch.testing.assert_close(outs[0].double(), reference_attention(q, fb, kc, vc).double(),
                                   atol=TOL[dtype], rtol=TOL[dtype])


def test_bf16_pool_under_fp32_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: rope_kv_write stores K/V rounded to nearest even (as
    torch's .to(bfloat16)), and attention over the bf16 pool gives the bits of attention over the same values
    widened to float32 (widening is exact; the arithmetic is the same), in every build; the pure-torch
    reference agrees within fp32 tolerance."""
    g = torch.Generator().manual_seed(5)
    windows, ctx = [0, 16, 7, 1], [130, 9, 2, 45]
    toks = [[1] * (w + 1) for w in windows]
    cls = [list(range(200 * b + 3, 200 * b + 3 + c + w + 1)) for b, (c, w) in enumerate(zip(ctx, windows))]
    fb = build_forward_batch(toks, ctx, [cl[c:] for cl, c in zip(cls, ctx)], cls, None)
    T, hd = fb.num_tokens, 64
    q, k, v = (torch.randn(T, n, hd, generator=g) * 3 for n in (9, 3, 3))
    pos = torch.arange(512)[:, None].double() * torch.arange(1, hd + 1).double() / hd
    cos, sin = pos.cos().float(), pos.sin().float()
    pools = {dt: tuple(torch.randn(800, 3, hd, generator=torch.Generator().manual_seed(6)).to(dt) for _ in range(2))
             for dt in (torch.float32, torch.bfloat16)}
    qs = {}
    for dt, (kc, vc) in pools.items():
        qs[dt] = q.clone()
        torch.ops.specserve.rope_kv_write(qs[dt], k, v, cos, sin, fb.positions, kc, vc, fb.slot_mapping)
    assert torch.equal(qs[torch.float32], qs[torch.bfloat16])
    slots = fb.slot_mapping.long()
    for f32, b16 in zip(pools[torch.float32], pools[torch.bfloat16]):
        assert torch.equal(f32[slots].to(torch.bfloat16), b16[slots])
    kc, vc = pools[torch.bfloat16]
    outs = []
    for impl in ("avx512", "avx2", "portable"):
        monkeypatch.setenv("SPECSERVE_ATTN_IMPL", impl)
        outs.append(fused.attention(qs[torch.float32], fb, kc, vc))
        assert outs[-1].dtype == torch.float32
        assert torch.equal(outs[-1], fused.attention(qs[torch.float32], fb, kc.float(), vc.float()))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], reference_attention(qs[torch.float32], fb, kc, vc), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 under float32"):  # the only mixed pair
        fused.attention(qs[torch.float32].double(), fb, kc, vc)


@pytest.mark.parametrize("mode", ["w4a8", "w8a8"])
def test_cpp_layer_loop_bit_identical_to_python_loop(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ layer loop (decoder_layers) runs the Python fused loop's ops in its order: logits and captured
    hidden states equal bit for bit, for a prefill, a ragged verify and a tree verify, with and without a qkv
    bias (qwen2) and with per-head q/k norms (qwen3)."""
    from specserve.models.llama import LlamaModel
    from specserve.formats.quant import quantize_model

    def run(model: LlamaModel) -> list[torch.Tensor]:
        pool = KVPool(model.cfg, 16, 8, torch.float32)
        runner, tables = ModelRunner(model, pool), [[], [], []]
        prompts = [[3, 5, 7, 11, 13], [2, 4], [9] * 9]
        for t, p in zip(tables, prompts):
            pool.ensure(t, len(p) + 6)
        out, cap = runner.forward(tables, [0] * 3, prompts, [[len(p) - 1] for p in prompts], capture_layers=(0, 1))
        starts = [len(p) for p in prompts]
        o2, c2 = runner.forward(tables, starts, [[1, 2, 3], [4], [5, 6, 7, 8]], [[0, 1, 2], [0], [0, 1, 2, 3]], (1,))
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
        masks = [torch.cat([torch.ones(3, s, dtype=torch.bool), tree], 1) for s in starts]
        o3, _ = runner.forward(tables, starts, [[6, 7, 8]] * 3, [[0, 1, 2]] * 3,
                               positions=[[s, s + 1, s + 1] for s in starts], masks=masks)
        return out + cap + o2 + c2 + o3

    for arch in ("llama", "qwen2", "qwen3"):
        model = tiny_model(arch, dtype=torch.float32)
        quantize_model(model, mode)
        assert model._layer_stack() is not None
        cpp = run(model)
        monkeypatch.setattr(LlamaModel, "_layer_stack", lambda self: None)
        py = run(model)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(cpp, py)) and len(cpp) == len(py) == 12


def test_silu_mul_float_paths_bit_equal_and_accurate(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 silu_mul (own exp, 16 lanes where AVX-512 is there): the portable and vector paths give the same
    bits for widths that are and are not multiples of 16; within 2 ulp-ish of the float64 value; NaN/±inf
    behave as silu does (silu(+inf)·1 = inf, silu(−inf)·1 = −0·… = 0 or NaN only where the reference is)."""
    g = torch.Generator().manual_seed(0)
    for width in (1536, 37):
        gu = torch.randn(9, 2 * width, generator=g) * 6
        gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0])
        gu[1, 0], gu[1, 1], gu[1, 2] = float("nan"), float("inf"), float("-inf")
        fast = torch.ops.specserve.silu_mul(gu)
        monkeypatch.setenv("SPECSERVE_ATTN_IMPL", "portable")
        slow = torch.ops.specserve.silu_mul(gu)
        monkeypatch.delenv("SPECSERVE_ATTN_IMPL")
        assert torch.equal(fast.isnan(), slow.isnan()) and torch.equal(fast.nan_to_num(), slow.nan_to_num())
        ref = (torch.nn.functional.silu(gu[:, :width].double()) * gu[:, width:].double())
        ok = ref.isfinite() & fast.isfinite()
        torch.testing.assert_close(fast[ok].double(), ref[ok], rtol=3e-7, atol=1e-30)
        assert bool(fast[1, 0].isnan()) and float(fast[1, 1]) == float(ref[1, 1])
        rows = torch.cat([torch.ops.specserve.silu_mul(gu[i : i + 1]) for i in range(9)])  # row-invariant
        assert torch.equal(rows.nan_to_num(), fast.nan_to_num())
