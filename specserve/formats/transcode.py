"""GGUF block types without a kernel of their own, rewritten exactly into one that has (no value changes):

- Q3_K → Q6_K. Both are 256-element super-blocks of 16 sub-blocks of 16 with an fp16 d and a signed scale per
  sub-block: Q3_K's w = d·(s − 32)·q with 6-bit s and q in −4..3, Q6_K's w = d·sc·(q6 − 32) with int8 sc and q6
  in 0..63. So sc = s − 32 and q6 = q + 32, element for element: the same fp32 products.
- IQ4_NL → Q8_0. A block of 32 with an fp16 d and 4-bit indices into a fixed table of int8 values: w = d·T[i],
  which is Q8_0 with codes T[i].
The rewrite costs memory (Q3_K 3.44 → 6.56 bits a weight, IQ4_NL 4.5 → 8.5) but keeps the file's values on the
integer kernels; Q2_K and IQ4_XS have no exact form here (their scales are finer than any packed layout's)
and are re-quantized by the mode.
Element order (as gguf-py's dequantizers read it): Q3_K element 32b + i (b = 0..7) has its low two bits at bits
2(b mod 4) of qs[32(b div 4) + i] and its high bit, inverted, at bit b of hmask[i]; Q6_K as gguf_blocks.py says;
IQ4_NL element i < 16 is the low nibble of byte i, element i + 16 its high nibble.
"""
from __future__ import annotations

import numpy as np

_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def q3_k_to_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 110] uint8 Q3_K blocks → [n, 210] uint8 Q6_K blocks of the same values."""
    n = blocks.shape[0]
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:110]
    lo = (scales[:, :8, None] >> np.array([0, 4], np.uint8)).transpose(0, 2, 1).reshape(n, 16) & 0x0F
    hi = (scales[:, None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]).reshape(n, 16) & 0x03
    sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    low = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]).reshape(n, 256) & 0x03
    high = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]).reshape(n, 256) & 0x01
    q6 = (low.astype(np.int16) - 4 * (high ^ 1) + 32).astype(np.uint8)  # q + 32, q = low − 4·(1 − high)
    nib = q6.reshape(n, 2, 2, 64) & 0x0F  # [half, which nibble, byte]
    ql = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n, 128)
    top = (q6 >> 4).reshape(n, 2, 4, 32)  # [half, bit pair, byte]
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d], axis=1)


def iq4_nl_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 18] uint8 IQ4_NL blocks → [n, 34] uint8 Q8_0 blocks of the same values."""
    d, qs = blocks[:, :2], blocks[:, 2:]
    idx = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return np.concatenate([d, _IQ4_NL_VALUES[idx].view(np.uint8)], axis=1)


# file block type → (the type it is rewritten to, bytes per block in, out, the rewrite)
TRANSCODED = {"Q3_K": ("Q6_K", 110, 210, q3_k_to_q6_k), "IQ4_NL": ("Q8_0", 18, 34, iq4_nl_to_q8_0)}


def transcode(data: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """A tensor's rows of raw blocks (uint8 [N, row bytes]) in a kernel's block type: rewritten when `qtype` is
    in TRANSCODED, else as they are."""
    if qtype not in TRANSCODED:
        return data, qtype
    out, size_in, _, rewrite = TRANSCODED[qtype]
    rows = data.shape[0]
    return rewrite(np.ascontiguousarray(data).reshape(-1, size_in)).reshape(rows, -1), out
