"""GGUF quantized tensors as blocks of 32 with fp32 scales, exactly as the file stores them.

Each supported type is re-expressed without rounding as codes q, scale d and optional offset m per block
of 32 along K (w = d·q + m), the form the block-scaled integer GEMM consumes (see quant_ref.py):
- Q8_0 (d f16, 32 × int8): q = int8 codes, no m.
- Q4_0 (d f16, 16 bytes of nibbles; w = d·(q − 8)): q = 0..15, m = −8·d (exact: a power-of-two multiple).
- Q4_1 (d f16, m f16, nibbles; w = d·q + m): as is.
- Q4_K (super-blocks of 256: f16 d and dmin, eight 6-bit sub-block scales and mins): group j of 32 gets
  d_j = d·sc_j and m_j = −dmin·mn_j, both exact in fp32 (11-bit × 6-bit mantissas).
Nibble order: within Q4_0/Q4_1 blocks element i < 16 is the low nibble of byte i and element i + 16 its high
nibble; in Q4_K each 32-byte chunk holds 64 elements, low nibbles first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")


@dataclass
class BlockCodes:
    """A [N, K] weight as codes q [N, K] (int16: 4-bit 0..15 or int8 range), d and m [N, K/32] fp32."""
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int

    def dequantize(self) -> torch.Tensor:
        N, K = self.q.shape
        w = self.q.float().reshape(N, K // 32, 32) * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(N, K)

    def rows(self, f) -> "BlockCodes":  # noqa: ANN001
        """Apply a row permutation/reshape `f` (dim 0) to codes, scales and offsets alike."""
        return BlockCodes(f(self.q), f(self.d), None if self.m is None else f(self.m), self.bits)


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_blocks(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> BlockCodes | None:
    """Raw GGUF tensor bytes (rows of blocks) of HF-order `shape` [N, K] → BlockCodes, or None if the type
    has no exact block-of-32 form here."""
    if qtype not in NATIVE or len(shape) != 2:
        return None
    N, K = shape
    raw = np.asarray(data, dtype=np.uint8).reshape(N, -1)
    if qtype == "Q8_0":
        b = raw.reshape(N, K // 32, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16))
        return BlockCodes(q.reshape(N, K), _f16(b[..., :2]).reshape(N, -1), None, 8)
    if qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        b = raw.reshape(N, K // 32, size)
        d = _f16(b[..., :2]).reshape(N, -1)
        m = -8 * d if qtype == "Q4_0" else _f16(b[..., 2:4]).reshape(N, -1)
        q = torch.from_numpy(_nibbles(b[..., size - 16:]).astype(np.int16)).reshape(N, K)
        return BlockCodes(q, d, m, 4)
    # Q4_K: 144 bytes per 256 values: d, dmin, scales[12], qs[128]
    b = raw.reshape(N, K // 256, 144)
    d, dmin = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    s = b[..., 4:16].astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[..., 16:].reshape(N, K // 256, 4, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, sb, 4 chunks, 64]: sub-blocks 2c, 2c+1
    dj = d[..., None] * torch.from_numpy(sc.astype(np.float32))
    mj = -(dmin[..., None] * torch.from_numpy(mn.astype(np.float32)))
    return BlockCodes(torch.from_numpy(q.astype(np.int16)).reshape(N, K), dj.reshape(N, -1), mj.reshape(N, -1), 4)
