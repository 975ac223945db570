"""Block-scaled integer GEMM in plain torch: the definition the C++ kernel (`kernels/csrc/quant_gemm*.cpp`)
matches bit for bit, plus the packing of block weights into the kernel's tile layout.

Numerics (NOTE: invariants the kernel and these functions share):
- weights: blocks of 32 along K; codes q (4-bit 0..15, or int8), fp32 scale d, optional fp32 offset m:
  w = d·q (+ m). Q4_0 is q' = q − 8 re-expressed as m = −8·d; Q4_1/Q4_K carry m; Q8_0 has none.
- activations, per token per block of 32: amax = max|x|; d_a = amax/127 and q_a = round_half_even(x·(127/amax))
  clamped to ±127; a block with amax < 2^-100 is all zeros with d_a = 0; a block holding NaN/Inf is all zeros
  with d_a = NaN. sa = d_a·float(Σ q_a).
- y[m, n]: acc = 0; for b = 0..nb-1: acc = acc + (d_w·d_a)·float(isum_b); then acc = acc + m_w·sa when m exists.
  isum is exact int32; every float op is one IEEE fp32 mul or add (no FMA), in block order. Rows and columns
  never mix, so the result of a row does not depend on M, N, threads or the SIMD path.
- formats (the op's `fmt`; 4 and 8 were its `bits`): F4/F8 as above; F5: 5-bit codes with per-block d: with m
  codes 0..31 (Q5_1), without m signed codes −16..15 (Q5_0: w = d·(q − 16)), stored + 16 with 16·Σq_a subtracted
  from the integer sum, as 8-bit codes are. Super-block formats (256 along K, per column an fp16 d, Q4_K/Q5_K also an fp16 dmin):
  K4/K5 (Q4_K/Q5_K): block j's d_w = float(d)·float(sc_j) and m_w = −(float(dmin)·float(mn_j)), formed in fp32
  in the kernel (exact: 11-bit × 6-bit mantissas), then the epilogue above: the same bits as storing them.
  K6 (Q6_K, codes 0..63, int8 scale sc per 16): isum = sc_lo·(S_lo − 32·A_lo) + sc_hi·(S_hi − 32·A_hi) with S the
  exact sums Σ q·q_a and A = Σ q_a over k = 0..15 (lo) and 16..31 (hi); |isum| <= 2·16·32·127·128 < 2^24, so it
  is exact in int32 and in fp32; then acc = acc + (float(d)·d_a)·float(isum): qgemm_ref with integer codes
  sc·(q − 32) and d per block (gguf_blocks.BlockCodes.blocks32 gives that form for every format).
"""
from __future__ import annotations

import torch

QK = 32   # block length
NR = 16   # columns per packed tile
TINY = 2.0 ** -100
F4, F5, F8 = 4, 5, 8          # per-block formats (`fmt` = code bits)
KQ = 32                       # super-block flag
K4, K5, K6 = KQ | 4, KQ | 5, KQ | 6  # Q4_K, Q5_K, Q6_K


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
    bad = ~torch.isfinite(xb).all(-1)  # a NaN/Inf block: codes 0, d_a NaN (the row's outputs are NaN)
    q, d = q.masked_fill(bad[..., None], 0), d.masked_fill(bad, float("nan"))
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


def _layout(q: torch.Tensor, tiles: int, nb: int, bits: int, signed: bool = False) -> torch.Tensor:
    """Codes [tiles·16, K] → [tiles, nb, bits·64] bytes: per block of one tile, 4-byte groups of K (k = 4g..4g+3)
    for all 16 columns as one 64-byte vector (group g, column c at byte (g·16 + c)·4): the VNNI layout.
    8-bit: code + 128 (unsigned operand; the kernel subtracts 128·Σq_a); 5-bit `signed` (no m): code + 16, the
    kernel subtracts 16·Σq_a. 4/5/6-bit: a nibble plane (256 bytes:
    group g low nibble, group g + 4 high nibble of the same byte), then 5-bit: 64 bytes, bit g = bit 4 of group g;
    6-bit: two 64-byte vectors, bits 2j..2j+1 of vector h = bits 4..5 of group 4h + j."""
    g = q.reshape(tiles, NR, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, nb, group, col, byte]
    if bits == 8:
        return (g + 128).to(torch.uint8).reshape(tiles, nb, -1)
    if signed:
        q, g = q + 16, g + 16
    if int(q.min()) < 0 or int(q.max()) >= 1 << bits:
        raise ValueError(f"{bits}-bit codes must be in 0..{(1 << bits) - 1}")
    lo, hi = g & 15, g >> 4
    planes = [lo[:, :, :4] | (lo[:, :, 4:] << 4)]
    if bits == 5:
        planes.append(sum(hi[:, :, j] << j for j in range(8)))
    elif bits == 6:
        planes += [sum(hi[:, :, 4 * h + j] << (2 * j) for j in range(4)) for h in (0, 1)]
    return torch.cat([p.to(torch.uint8).reshape(tiles, nb, -1) for p in planes], -1)


def _tile(t: torch.Tensor, tiles: int, dt: torch.dtype) -> torch.Tensor:
    """Per-column values [N, n] → [tiles, n, 16] (zero columns past N)."""
    t = torch.nn.functional.pad(t, (0, 0, 0, tiles * NR - t.shape[0]))
    return t.reshape(tiles, NR, -1).transpose(1, 2).to(dt).contiguous()


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-block formats F4/F5/F8: codes q [N, K], d/m [N, nb] → (codes [tiles, nb, bits·64] uint8 (`_layout`),
    d [tiles, nb, 16], m [tiles, nb, 16]); d and m in fp16 when all of them are exactly fp16 values, else fp32.
    A tile is 16 output columns."""
    if bits not in (F4, F5, F8):
        raise ValueError(f"bits must be 4, 5 or 8, got {bits}")
    N, K = q.shape
    nb, tiles = K // QK, -(-N // NR)
    codes = _layout(torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, tiles * NR - N)), tiles, nb, bits,
                    signed=bits == 5 and m is None)
    # fp16 when every scale and offset is exactly an fp16 (GGUF Q4_0/Q4_1/Q5_x/Q8_0 store them so): a quarter
    # fewer bytes per 4-bit weight to stream at decode, the same values (fp16 -> fp32 is exact in the kernel)
    exact = all(t is None or torch.equal(t.float().half().float(), t.float()) for t in (d, m))
    dt = torch.float16 if exact else torch.float32
    return codes, _tile(d.float(), tiles, dt), None if m is None else _tile(m.float(), tiles, dt)


def pack_kquant(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor | None, sc: torch.Tensor,
                mn: torch.Tensor | None, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Super-block formats (K4/K5: bits 4/5 with dmin, sc, mn [N, K/32] 0..63; K6: bits 6, sc [N, K/16] int8,
    no dmin/mn); d/dmin [N, K/256] fp16 values → (wp [tiles, nsb, 8·(bits·64 + 32)] uint8, wd [tiles, nsb, 16]
    fp16, wm (dmin) or None). Per tile and super-block: the 8 blocks' codes (`_layout`), then per block 32
    scale bytes: sc[16 columns], mn[16] (K4/K5) or sc of k = 0..15, sc of k = 16..31 (K6, int8)."""
    N, K = q.shape
    nb, tiles = K // QK, -(-N // NR)
    nsb = nb // 8
    codes = _layout(torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, tiles * NR - N)), tiles, nb, bits)
    pair = [sc, mn] if mn is not None else [sc[:, 0::2], sc[:, 1::2]]
    subs = torch.stack([_tile(p.to(torch.int16), tiles, torch.int16) for p in pair], 2)  # [tiles, nb, 2, 16]
    subs = subs.to(torch.int8 if mn is None else torch.uint8).view(torch.uint8)
    wp = torch.cat([codes.reshape(tiles, nsb, -1), subs.reshape(tiles, nsb, -1)], -1).contiguous()
    half = lambda t: None if t is None else _tile(t.float(), tiles, torch.float16)  # noqa: E731
    return wp, half(d), half(dmin)
