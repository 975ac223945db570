"""Block-scaled integer GEMM in plain torch: the definition the C++ kernel (`kernels/csrc/quant_gemm.cpp`)
matches bit for bit, plus the packing of block weights into the kernel's tile layout.

Numerics (NOTE: invariants the kernel and these functions share):
- weights: blocks of 32 along K; codes q (4-bit 0..15, or int8), fp32 scale d, optional fp32 offset m:
  w = d·q (+ m). Q4_0 is q' = q − 8 re-expressed as m = −8·d; Q4_1/Q4_K carry m; Q8_0 has none.
- activations, per token per block of 32: amax = max|x|; d_a = amax/127 and q_a = round_half_even(x·(127/amax))
  clamped to ±127; a block with amax < 2^-100 is all zeros with d_a = 0. sa = d_a·float(Σ q_a).
- y[m, n]: acc = 0; for b = 0..nb-1: acc = acc + (d_w·d_a)·float(isum_b); then acc = acc + m_w·sa when m exists.
  isum is exact int32; every float op is one IEEE fp32 mul or add (no FMA), in block order. Rows and columns
  never mix, so the result of a row does not depend on M, N, threads or the SIMD path.
"""
from __future__ import annotations

import torch

QK = 32   # block length
NR = 16   # columns per packed tile
TINY = 2.0 ** -100


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] → (q int8 [M, K], d [M, nb], sa [M, nb], sum int32 [M, nb])."""
    M, K = x.shape
    xb = x.float().reshape(M, K // QK, QK)
    amax = xb.abs().amax(-1)
    ok = amax >= TINY
    one = torch.ones((), dtype=torch.float32)
    inv = torch.where(ok, torch.full_like(amax, 127.0) / torch.where(ok, amax, one), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    d = torch.where(ok, amax / torch.full_like(amax, 127.0), torch.zeros_like(amax))
    s = q.sum(-1)  # exact: at most 32·127
    return q.to(torch.int8).reshape(M, K), d, d * s, s.to(torch.int32)


def qgemm_ref(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float; q [N, K] codes (int, 4-bit 0..15 or int8); d, m [N, nb] fp32 → y [M, N] fp32."""
    qa, da, sa, _ = quantize_act_ref(x)
    M, K = qa.shape
    N, nb = q.shape[0], K // QK
    # Integer block sums, exact in float64 (|isum| < 2^21).
    isum = torch.einsum("mbk,nbk->mnb", qa.double().reshape(M, nb, QK), q.double().reshape(N, nb, QK)).float()
    acc = torch.zeros(M, N, dtype=torch.float32)
    for b in range(nb):
        acc = acc + (d[None, :, b] * da[:, None, b]) * isum[:, :, b]
        if m is not None:
            acc = acc + m[None, :, b] * sa[:, None, b]
    return acc


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes q [N, K], d/m [N, nb] → (codes [tiles, nb, bytes] uint8, d [tiles, nb, 16], m [tiles, nb, 16]);
    d and m in fp16 when all of them are exactly fp16 values, else fp32.

    A tile is 16 output columns. Per block, the kernel loads 4-byte groups of K (k = 4g..4g+3) for all 16
    columns as one 64-byte vector (group g, column c at byte (g·16 + c)·4): the VNNI layout. 8-bit codes
    are stored + 128 (unsigned operand; the kernel subtracts 128·Σq_a); 4-bit codes put group g in the low
    nibble and group g + 4 in the high nibble of the same byte.
    """
    N, K = q.shape
    nb, tiles = K // QK, -(-N // NR)
    pad = tiles * NR - N
    q = torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, pad))
    d = torch.nn.functional.pad(d.float(), (0, 0, 0, pad))
    m = None if m is None else torch.nn.functional.pad(m.float(), (0, 0, 0, pad))
    g = q.reshape(tiles, NR, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, nb, group, col, byte]
    if bits == 8:
        codes = (g + 128).to(torch.uint8)
    elif bits == 4:
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("4-bit codes must be in 0..15")
        codes = (g[:, :, :4] | (g[:, :, 4:] << 4)).to(torch.uint8)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    # fp16 when every scale and offset is exactly an fp16 (GGUF Q4_0/Q4_1/Q8_0 store them so): a quarter fewer
    # bytes per 4-bit weight to stream at decode, the same values (fp16 -> fp32 is exact in the kernel)
    exact = all(t is None or torch.equal(t.half().float(), t) for t in (d, m))
    dt = torch.float16 if exact else torch.float32
    tile = lambda t: t.reshape(tiles, NR, nb).transpose(1, 2).to(dt).contiguous()  # noqa: E731
    return codes.reshape(tiles, nb, -1).contiguous(), tile(d), None if m is None else tile(m)
