"""GGUF quantized tensors as block codes with their scales, exactly as the file stores them (no rounding).

Two families (numerics and packing: quant_ref.py):
- per-block (blocks of 32 along K, w = d·q + m):
  Q8_0 (d f16, 32 × int8: q = int8 codes, no m); Q4_0 (w = d·(q − 8): q = 0..15, m = −8·d, exact: a power-of-
  two multiple); Q4_1 (d, m f16, nibbles); Q5_0 (w = d·(q − 16): signed codes q − 16, no m); Q5_1 (d, m f16).
- super-block (256 along K, f16 d per super-block, a scale code per sub-block):
  Q4_K / Q5_K: w = (d·sc_j)·q − dmin·mn_j per block j of 32 (sc, mn 6-bit codes; q 0..15 / 0..31);
  Q6_K: w = (d·sc_i)·(q − 32) per sub-block i of 16 (sc int8, q 0..63).
Element order in the file: Q4_0/Q4_1/Q5_0/Q5_1 element i < 16 is the low nibble of byte i and element i + 16 its
high nibble, bit 4 (5-bit) is bit i of the 32-bit qh; Q4_K/Q5_K: each 32-byte chunk holds 64 elements, low
nibbles first, Q5_K's bit 4 of element 32j + i is bit j of qh[i]; Q6_K: half h (128 elements) has ql[64h..64h+63]
(elements 0..63 low nibbles, 64..127 high) and qh[32h..32h+31] (element 32s + i: bits 2s..2s+1 of qh[32h + i]).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
DENSE = ("F32", "F16", "BF16", "F64")  # not block types: the caller keeps the float weight
QK, QK_K = 32, 256


class UnsupportedBlockType(ValueError):
    """A GGUF quantization type with no exact block form here (Q2_K, IQ4_XS, ...; Q3_K and IQ4_NL: formats/transcode.py)."""

    def __init__(self, name: str, qtype: str) -> None:
        super().__init__(f"GGUF tensor {name!r}: block type {qtype} is not supported natively "
                         f"(supported: {', '.join(NATIVE)})")
        self.name, self.qtype = name, qtype


@dataclass
class BlockCodes:
    """A [N, K] weight as codes q [N, K] int16 (0..2^bits − 1 for 4/5/6 bits, int8 range for 8; 5-bit codes
    without m are signed, −16..15: Q5_0) and scales.

    Per-block form (sc is None): d, m [N, K/32] fp32 (m may be None): w = d·q + m.
    Super-block form (sc set; 4/5 bits: Q4_K/Q5_K, 6 bits: Q6_K): d [N, K/256] fp32 (fp16 values), m = dmin
    [N, K/256] (None for Q6_K), sc [N, K/32] 0..63 (Q6_K: [N, K/16] int8), mn [N, K/32] 0..63 (Q6_K: None).
    NOTE: every array is per row (dim 0 = N), so a row permutation applies to each alike (`rows`)."""
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    @property
    def kquant(self) -> bool:
        return self.sc is not None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def blocks32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The per-block-of-32 form (q, d, m) the reference GEMM (quant_ref.qgemm_ref) takes, exactly:
        Q4_K/Q5_K: d_j = d·sc_j and m_j = −(dmin·mn_j) (fp32 products of 11-bit and 6-bit mantissas: exact);
        Q6_K: integer codes sc_i·(q − 32) (|·| <= 4096) with d per block (no m)."""
        if not self.kquant:
            return self.q, self.d, self.m
        N, K = self.q.shape
        per = lambda t, n: t.float().repeat_interleave(n, dim=1)  # noqa: E731
        if self.mn is None:  # Q6_K
            w = self.sc.to(torch.int16).repeat_interleave(16, dim=1) * (self.q - 32)
            return w, per(self.d, QK_K // QK), None
        return self.q, per(self.d, 8) * self.sc.float(), -(per(self.m, 8) * self.mn.float())

    def dequantize(self) -> torch.Tensor:
        q, d, m = self.blocks32()
        N, K = q.shape
        w = q.float().reshape(N, K // QK, QK) * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(N, K)

    def rows(self, f) -> "BlockCodes":  # noqa: ANN001
        """Apply a row permutation/reshape `f` (dim 0) to codes, scales, offsets and scale codes alike."""
        return BlockCodes(**{k.name: (v if v is None or isinstance(v, int) else f(v))
                             for k in fields(self) for v in (getattr(self, k.name),)})

    def cols(self, a: int, b: int) -> "BlockCodes":
        """Input columns [a, b) (tensor-parallel splits); a and b must fall on (super-)block bounds."""
        unit = QK_K if self.kquant else QK
        if a % unit or b % unit:
            raise ValueError(f"columns {a}:{b} split a block of {unit}")
        cut = lambda t: None if t is None else t[:, a * t.shape[1] // self.q.shape[1]:  # noqa: E731
                                                 b * t.shape[1] // self.q.shape[1]].contiguous()
        return BlockCodes(self.q[:, a:b].contiguous(), cut(self.d), cut(self.m), self.bits, cut(self.sc), cut(self.mn))


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).astype(np.int16))


def _bit4(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) → [..., 32] bit i of it, as 0 or 16."""
    return ((np.unpackbits(qh, axis=-1, bitorder="little")) << 4).astype(np.uint8)


def _per_block(b: np.ndarray, qtype: str, N: int, K: int) -> BlockCodes:
    if qtype == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16))
        return BlockCodes(q.reshape(N, K), _f16(b[..., :2]).reshape(N, -1), None, 8)
    d = _f16(b[..., :2]).reshape(N, -1)
    has_m = qtype in ("Q4_1", "Q5_1")
    qs = b[..., -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    if qtype == "Q4_0":
        return BlockCodes(_t(q).reshape(N, K), d, -8 * d, 4)
    if qtype == "Q4_1":
        return BlockCodes(_t(q).reshape(N, K), d, _f16(b[..., 2:4]).reshape(N, -1), 4)
    q = _t(q | _bit4(b[..., 2 + 2 * has_m: 6 + 2 * has_m])).reshape(N, K)
    if qtype == "Q5_1":
        return BlockCodes(q, d, _f16(b[..., 2:4]).reshape(N, -1), 5)
    return BlockCodes(q - 16, d, None, 5)  # Q5_0: signed codes −16..15, no offset stream (as Q8_0)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes → 8 six-bit scales and 8 six-bit mins."""
    s = s.astype(np.int16)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _super_block(b: np.ndarray, qtype: str, N: int, K: int) -> BlockCodes:
    nsb = K // QK_K
    if qtype == "Q6_K":  # ql[128], qh[64], scales[16] int8, d
        ql, qh = b[..., 0:128].reshape(N, nsb, 2, 64), b[..., 128:192].reshape(N, nsb, 2, 32)
        lo = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [N, sb, half, 128]
        hi = np.concatenate([(qh >> (2 * s)) & 3 for s in range(4)], axis=-1)
        sc = torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.int16))
        return BlockCodes(_t(lo | (hi << 4)).reshape(N, K), _f16(b[..., 208:210])[..., 0], None, 6,
                          sc.reshape(N, -1), None)
    # Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
    d, dmin = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    sc, mn = _scale_min_k4(b[..., 4:16])
    qs = b[..., -128:].reshape(N, nsb, 4, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, nsb, 256)  # sub-blocks 2c, 2c+1 per chunk c
    bits = 4
    if qtype == "Q5_K":
        qh = b[..., 16:48]  # element 32j + i: bit j of qh[i]
        q = q | np.concatenate([((qh >> j) & 1) << 4 for j in range(8)], axis=-1)
        bits = 5
    return BlockCodes(_t(q).reshape(N, K), d, dmin, bits, _t(sc).reshape(N, -1), _t(mn).reshape(N, -1))


_SIZES = {"Q8_0": (34, QK), "Q4_0": (18, QK), "Q4_1": (20, QK), "Q5_0": (22, QK), "Q5_1": (24, QK),
          "Q4_K": (144, QK_K), "Q5_K": (176, QK_K), "Q6_K": (210, QK_K)}


def gguf_blocks(data: np.ndarray, qtype: str, shape: tuple[int, ...], name: str = "?") -> BlockCodes | None:
    """Raw GGUF tensor bytes (rows of blocks, e.g. a view of the memory-mapped file) of HF-order `shape` [N, K]
    → BlockCodes. None for float tensors and anything not 2-D (the caller keeps them dense); a quantized type
    with no exact form here raises UnsupportedBlockType naming `name` and the type."""
    if qtype in DENSE or len(shape) != 2:
        return None
    if qtype not in NATIVE:
        raise UnsupportedBlockType(name, qtype)
    N, K = shape
    size, per = _SIZES[qtype]
    if K % per:
        raise ValueError(f"GGUF tensor {name!r}: {qtype} row length {K} is not a multiple of {per}")
    b = np.asarray(data, dtype=np.uint8).reshape(N, K // per, size)
    return (_per_block if per == QK else _super_block)(b, qtype, N, K)
