"""Quantized linear layers for CPU decoding (`--quantization int4 | w4a8 | w8a8`) and model conversion.

- w4a8 / w8a8: weights in blocks of 32 (4- or 8-bit codes, fp32 scale and offset), activations quantized
  to int8 per block of 32 per token, integer block dot products in our C++ kernel
  (`torch.ops.specserve.qgemm`, numerics defined in quant_ref.py). GGUF blocks are kept exactly as the file
  stores them (gguf_blocks.py); HF weights are quantized here. Output fp32; the model runs in fp32 around
  it. Every row is computed independently in a fixed order: the GEMMs are batch-invariant and a row of a
  verify equals the decode of that row bit for bit (end to end this also needs a row-invariant attention).
- int4: torch's `_weight_int4pack_mm_for_cpu` (w = (q − 8)·scale + zero per group of 32), dequantizing
  on the fly. Scales/zeros are kept in the activation dtype (fp32 with --dtype float32).
"""
from __future__ import annotations

from typing import Callable
from dataclasses import dataclass

import torch

from .gguf_blocks import BlockCodes
from .gguf_repack import RawBlocks, concat_packed
from .quant_ref import KQ, pack, pack_kquant

GROUP = 32
MODES = ("int4", "w4a8", "w8a8")


def quantize_blocks(w: torch.Tensor, bits: int) -> BlockCodes:
    """Float [N, K] → groups of 32: 4-bit asymmetric (as Q4_1: d = (max − min)/15, m = min) or 8-bit
    symmetric (as Q8_0: d = amax/127). Codes round half to even."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((g - lo[..., None]) / safe[..., None]).clamp(0, 15)
        return BlockCodes(q.to(torch.int16).reshape(N, K), d, lo, 4)
    d = g.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / safe[..., None]).clamp(-127, 127)
    return BlockCodes(q.to(torch.int16).reshape(N, K), d, None, 8)


def _joinable(a: BlockCodes, b: BlockCodes) -> bool:
    """Rows of a and b can share one packed segment exactly: per-block formats widen (4-bit codes 0..15 are valid
    5- and 8-bit codes, 5-bit codes valid 8-bit ones; a missing offset is m = 0, which turns Q5_0's signed codes
    into 8-bit ones), Q4_K joins Q5_K (same scales,
    codes 0..15 are 5-bit codes); Q6_K only joins Q6_K."""
    if a.kquant != b.kquant:
        return False
    return not a.kquant or (a.bits == 6) == (b.bits == 6)


def _join(parts: list[BlockCodes]) -> BlockCodes:
    bits = max(p.bits for p in parts)
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    if parts[0].kquant:
        return BlockCodes(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), cat([p.m for p in parts]),
                          bits, torch.cat([p.sc for p in parts]), cat([p.mn for p in parts]))
    has_m = any(p.m is not None for p in parts)
    if has_m and any(p.m is None and p.bits == 5 for p in parts):
        bits = 8  # Q5_0's signed codes are valid int8 codes, not unsigned 5-bit ones
    ms = [(p.m if p.m is not None else torch.zeros_like(p.d)) for p in parts] if has_m else None
    return BlockCodes(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                      torch.cat(ms) if ms else None, bits)


@dataclass
class SegmentedCodes:
    """A fused weight whose row segments have different formats (a Q4_K_M layer's q|k (Q4_K) | v (Q6_K)): the
    kernel computes each segment's columns with its own format in one call (`qgemm_segs`)."""
    parts: list[BlockCodes]

    @property
    def bits(self) -> int:
        return max(p.bits for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.q.shape[0] for p in self.parts), self.parts[0].q.shape[1]

    def blocks32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return _join([BlockCodes(*p.blocks32(), p.bits) for p in self.parts]).blocks32()

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def cat_rows(parts: "list[BlockCodes | SegmentedCodes]") -> "BlockCodes | SegmentedCodes":
    """Concatenate along N (fused q|k|v, gate|up). Runs of joinable parts (`_joinable`) become one segment;
    a single segment is a BlockCodes, several a SegmentedCodes."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, SegmentedCodes) else [p])]
    segs = [_join(r) for r in _runs(flat)]
    return segs[0] if len(segs) == 1 else SegmentedCodes(segs)


def _runs(parts: list) -> list[list]:
    """Consecutive joinable parts (`_joinable`: BlockCodes or RawBlocks) grouped: one segment each."""
    runs: list[list] = []
    for p in parts:
        if runs and _joinable(runs[-1][0], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def pack_codes(c: BlockCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """One segment for the kernel: (wp, wd, wm, n, fmt)."""
    if c.kquant:
        return (*pack_kquant(c.q, c.d, c.m, c.sc, c.mn, c.bits), c.q.shape[0], KQ | c.bits)
    return (*pack(c.q, c.d, c.m, c.bits), c.q.shape[0], c.bits)


class BlockQuantWeight:
    """A [n, k] weight packed for `torch.ops.specserve.qgemm` (one segment) or `qgemm_segs` (several: columns of
    each written by its own format). Call it like F.linear; returns fp32."""

    def __init__(self, codes: "BlockCodes | SegmentedCodes") -> None:
        from .. import kernels

        kernels.load()
        parts = codes.parts if isinstance(codes, SegmentedCodes) else [codes]
        self._set(tuple(codes.shape), [pack_codes(p) for p in parts])

    @classmethod
    def from_gguf(cls, parts: list[RawBlocks]) -> "BlockQuantWeight":
        """GGUF tensors (rows concatenated, as cat_rows) packed from the file's bytes by the C++ op: equal to
        BlockQuantWeight(cat_rows([p.codes() for p in parts])) bit for bit, without the BlockCodes."""
        segs = [concat_packed(r) or pack_codes(_join([p.codes() for p in r])) for r in _runs(parts)]
        return cls.of_segments((sum(s[3] for s in segs), parts[0].shape[1]), segs)

    @classmethod
    def of_segments(cls, shape: tuple[int, int], segments: list) -> "BlockQuantWeight":
        """A weight of packed segments [(wp, wd, wm, n, fmt)] as they are (no copy)."""
        w = cls.__new__(cls)
        w._set(shape, segments)
        return w

    def _set(self, shape: tuple[int, int], segments: list) -> None:
        self.shape = shape
        self.bits = max(fmt & ~KQ for *_, fmt in segments)  # cat_rows' .bits: the widest segment's code bits
        # NOTE: segments: [(wp, wd, wm, n, fmt)], what decoder_layers takes per projection
        self.segments = segments
        self.wp, self.wd, self.wm, _, self.fmt = self.segments[0]
        self._flat = [t for s in self.segments for t in s[:3]]
        self._dims = [v for s in self.segments for v in s[3:]]

    @staticmethod
    def supported(w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[1] % GROUP == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: the kernel path comes from SPECSERVE_QUANT_IMPL = auto (AMX-INT8 from a row threshold where
        # the CPU has it, else AVX-512-VNNI, else portable) | portable | vnni | amx, read by the op at every
        # call so tests and benches can switch it; a forced path the CPU lacks raises
        if len(self.segments) == 1:
            y = torch.ops.specserve.qgemm(x, self.wp, self.wd, self.wm, self.shape[0], self.fmt)
        else:
            y = torch.ops.specserve.qgemm_segs(x, self._flat, self._dims)
        return y if bias is None else y + bias


class StackedQuantWeight:
    """E packed weights of one layout stacked along a leading dimension, as llama.cpp stores an MoE layer's
    `ffn_*_exps`: `segments` [(wp [E, …], wd [E, …], wm [E, …] or None, n, fmt)], what the moe_mlp op and
    decoder_layers take; `[e]` is expert e's BlockQuantWeight (views: the same bytes, no copy)."""

    def __init__(self, ws: list[BlockQuantWeight]) -> None:
        if not self.stackable(ws):
            raise ValueError("StackedQuantWeight: the weights differ in shape or segment layout")
        stack = lambda ts: None if ts[0] is None else torch.stack(ts)  # noqa: E731
        self.segments = [(*(stack([w.segments[i][j] for w in ws]) for j in range(3)), n, fmt)
                         for i, (*_, n, fmt) in enumerate(ws[0].segments)]
        self.shape = ws[0].shape
        self._experts = [BlockQuantWeight.of_segments(self.shape, [(wp[e], wd[e], None if wm is None else wm[e], n, fmt)
                                                                  for wp, wd, wm, n, fmt in self.segments])
                         for e in range(len(ws))]

    @staticmethod
    def stackable(ws: list) -> bool:
        """Every weight packed for the block kernel with the first one's shape, segments and tensor sizes."""
        def layout(w: BlockQuantWeight) -> tuple:
            return w.shape, tuple((tuple(t.shape) if t is not None else None, t.dtype if t is not None else None)
                                  for s in w.segments for t in s[:3]), tuple(w._dims)
        return bool(ws) and all(isinstance(w, BlockQuantWeight) for w in ws) and len({layout(w) for w in ws}) == 1

    def __getitem__(self, e: int) -> BlockQuantWeight:
        return self._experts[e]

    def __len__(self) -> int:
        return len(self._experts)


class Int4Weight:
    """A [n, k] weight stored as 4-bit codes + per-group (scale, zero) for torch's int4 CPU kernel."""

    def __init__(self, codes: "BlockCodes | SegmentedCodes", dtype: torch.dtype) -> None:
        if codes.bits != 4:
            raise ValueError("int4 needs 4-bit blocks")
        q, d, m = codes.blocks32()  # Q4_K: its per-block d·sc and −dmin·mn
        n, k = q.shape
        m = m if m is not None else torch.zeros_like(d)
        zero = m + 8 * d  # kernel: (q − 8)·scale + zero == q·d + m
        self.shape, self.dtype = (n, k), dtype
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scale_zero = torch.stack([d.T, zero.T], dim=-1).to(dtype).contiguous()  # [k/32, n, 2]

    @staticmethod
    def supported(w: torch.Tensor) -> bool:
        return w.dim() == 2 and w.shape[1] % GROUP == 0 and w.shape[0] % 16 == 0

    def dequantize(self) -> torch.Tensor:
        """The effective weight (tests): what the kernel multiplies with."""
        eye = torch.eye(self.shape[1], dtype=self.dtype)
        return self(eye).T.float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(self.dtype), self.packed, GROUP,
                                              self.scale_zero)
        y = y.reshape(*shape[:-1], self.shape[0])
        return y if bias is None else y + bias


QuantWeight = BlockQuantWeight | Int4Weight


def linear(x: torch.Tensor, w: "torch.Tensor | QuantWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, (BlockQuantWeight, Int4Weight)):
        return w(x, bias)
    return torch.nn.functional.linear(x, w, bias)


def packed_nbytes(shape: tuple[int, int], bits: int) -> int:
    """An upper bound of a packed [N, K] weight's bytes: codes plus fp32 scale and offset per block of 32."""
    n, k = shape
    return n * k * bits // 8 + 2 * 4 * n * (k // GROUP)


def _codes(mode: str, file_codes: "list[BlockCodes | RawBlocks | None]", dense: Callable[[], torch.Tensor]
           ) -> "BlockCodes | SegmentedCodes | list[RawBlocks]":
    """The blocks for one (possibly fused) weight: the file's own when every part has them and the mode
    keeps them (w4a8 keeps 4- and 8-bit blocks; int4 keeps 4-bit; w8a8 keeps 8-bit), else quantized from
    the float weight (`dense()`, asked for only then) at the mode's width. Raw GGUF parts stay raw for
    the block kernel (`BlockQuantWeight.from_gguf`)."""
    bits = 8 if mode == "w8a8" else 4
    if file_codes and all(c is not None for c in file_codes):
        kept = [c for c in file_codes if mode == "w4a8" or c.bits == bits]
        if len(kept) == len(file_codes):
            if mode != "int4" and all(isinstance(c, RawBlocks) for c in kept):
                return kept
            return cat_rows([c.codes() if isinstance(c, RawBlocks) else c for c in kept])
    return quantize_blocks(dense(), bits)


def _block_weight(c: "BlockCodes | SegmentedCodes | list[RawBlocks]") -> BlockQuantWeight:
    return BlockQuantWeight.from_gguf(c) if isinstance(c, list) else BlockQuantWeight(c)


def check_quantizable(cfg: "ModelConfig", mode: str) -> None:  # noqa: F821
    if cfg.is_hybrid:
        raise ValueError(f"--quantization {mode}: not supported for {cfg.architecture} (hybrid recurrent) "
                         f"targets; serve them unquantized (--dtype float32, bfloat16 or float64)")


def quantize_model(model: torch.nn.Module, mode: str, blocks: "dict[str, BlockCodes] | Callable | None" = None,
                   dense: Callable[[str], torch.Tensor] | None = None, head_rows: torch.Tensor | None = None,
                   done: Callable[[list[str]], None] = lambda names: None) -> None:
    """Swap every projection (an MoE's experts too, each on its own) and the LM head of a LlamaModel for
    quantized weights in place.
    `blocks`: HF name → the GGUF file's exact blocks (a dict from load_gguf, or a lookup function), None
    where the file has none. `dense`: HF name → the float weight, for weights the mode re-quantizes; without
    it the model's own (loaded) float weights are used. With `dense`, the model's float matrices need not be
    loaded at all (the streaming GGUF load). The embedding table stays as it is (it is gathered, not multiplied).
    `head_rows`: sorted vocab ids; the LM head keeps only those rows (a draft model's reduced vocabulary).
    `done(names)`: called once those weights are copied out (the streaming load drops their mapped pages)."""
    if mode not in MODES:
        raise ValueError(f"--quantization: unknown {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "int4" and model.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("--quantization int4 runs with float32 or bfloat16 activations: use --dtype float32/bfloat16")
    if mode != "int4" and model.dtype != torch.float32:
        raise ValueError(f"--quantization {mode} runs with float32 activations around the integer GEMMs: "
                         "use --dtype float32 (or auto)")
    codes_of = blocks.get if isinstance(blocks, dict) else blocks or (lambda name: None)
    make = (lambda c: Int4Weight(c, model.dtype)) if mode == "int4" else _block_weight  # noqa: E731

    def float_of(names: list[str], own: torch.Tensor) -> Callable[[], torch.Tensor]:
        return (lambda: torch.cat([dense(n) for n in names]).to(model.dtype)) if dense else (lambda: own)

    ok = Int4Weight.supported if mode == "int4" else BlockQuantWeight.supported
    for i, layer in enumerate(model.layers):
        for name, parts in model.PARTS.items():  # layer attribute → the HF-named weights fused into it
            w = getattr(layer, name)
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            if not ok(w):
                if dense:  # stays float: load it now
                    w.copy_(float_of(names, w)())
                    done(names)
                continue
            file_codes = [codes_of(n) for n in names]
            delattr(layer, name)  # a Parameter slot cannot hold the packed weight
            setattr(layer, name, make(_codes(mode, file_codes, float_of(names, w))))
            done(names)
        for name, parts in getattr(model, "EXPERTS", {}).items():  # an MoE's stacked experts (models/moe.py)
            stacked = getattr(layer, name)
            names = [[f"model.layers.{i}.{p.format(e=e)}.weight" for p in parts] for e in range(stacked.shape[0])]
            if not ok(stacked[0]):
                if dense:  # stays float: load it now
                    for e, ns in enumerate(names):
                        stacked[e].copy_(float_of(ns, stacked[e])())
                    done([n for ns in names for n in ns])
                continue
            # NOTE: one packed weight per expert: a step runs only the experts its rows route to; stacked into
            # one tensor per segment where they share a layout (the C++ MoE op's input; `[e]` still one expert)
            packed = [make(_codes(mode, [codes_of(n) for n in ns], float_of(ns, stacked[e])))
                      for e, ns in enumerate(names)]
            delattr(layer, name)
            setattr(layer, name, StackedQuantWeight(packed) if StackedQuantWeight.stackable(packed) else packed)
            del packed
            done([n for ns in names for n in ns])
    key = "model.embed_tokens.weight" if model.cfg.tie_word_embeddings else "lm_head.weight"
    head_codes, head_float = codes_of(key), float_of([key], model.lm_head)
    if head_rows is not None:
        pick = lambda r: r[head_rows].contiguous()  # noqa: E731  whole rows: every block stays exact
        head_codes = None if head_codes is None else head_codes.rows(pick)
        head_float = (lambda full: lambda: pick(full()))(head_float)
        model.head_ids = head_rows
    if mode == "int4" and head_codes is not None and head_codes.bits == 8:
        # NOTE: re-quantizing the file's 8-bit head to 4 bits was int4's drift from fp32 (agreement 0.89 ->
        # 0.98); the head keeps its Q8_0 blocks through the w8a8 kernel (fp32 logits) instead.
        head = _block_weight([head_codes] if isinstance(head_codes, RawBlocks) else head_codes)
    elif ok(model.lm_head):
        head = make(_codes(mode, [head_codes], head_float))
    elif head_rows is not None:
        head = torch.nn.Parameter(head_float(), requires_grad=False)
    else:
        if dense and not model.cfg.tie_word_embeddings:
            model.lm_head.copy_(dense(key))
        done([key])
        return
    del model.lm_head  # when tied, only the alias goes: the embedding stays registered
    model.lm_head = head
    done([key])
