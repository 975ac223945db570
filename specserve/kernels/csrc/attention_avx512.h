// AVX-512 work item of paged attention (fp32 and bf16 inputs, head_dim a multiple of 16), chosen at run
// time. It performs exactly the arithmetic spelled out in attention_math.h, so it matches the portable
// item bit for bit; what changes is the schedule:
//  * keys go in chunks of 16 aligned to absolute positions (lane k = key with position ≡ k mod 16),
//    each chunk's K/V rows are read once for all query rows and heads of the item;
//  * the 16 scores of a chunk come out of one 16×16 transpose-reduce (no per-key horizontal sum), whose
//    levels are the tree16 levels; the scores then get max, exp16 and the softmax sum lane-wise;
//  * keys a row does not see are computed as lanes but masked out of the max, the sums and acc (masked
//    ops select, they never multiply by 0, so a NaN/Inf in such a lane cannot leak).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <type_traits>

#include "attention_math.h"

namespace specserve_attn {

#define SS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

SS_AVX512 SS_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SS_AVX512 SS_INLINE __m512 load16(const c10::BFloat16* p) {  // bf16 → fp32 is exact: the bits on top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SS_AVX512 SS_INLINE __m512 c(float v) { return _mm512_set1_ps(v); }

// exp_poly of attention_math.h, lane-wise: the same operations in the same order.
SS_AVX512 SS_INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(c(ex::lo), x);  // (lo > x) ? lo : x, NaN passes
  const __m512 t = _mm512_fmadd_ps(x, c(ex::log2e), c(ex::magic)), n = _mm512_sub_ps(t, c(ex::magic));
  const __m512 r = _mm512_fmadd_ps(n, c(-ex::c2), _mm512_fmadd_ps(n, c(-ex::c1), x)), z = _mm512_mul_ps(r, r);
  __m512 p = c(ex::p0);
  for (float pk : {ex::p1, ex::p2, ex::p3, ex::p4, ex::p5}) p = _mm512_fmadd_ps(p, r, c(pk));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), c(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(ex::magic_bits)), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// 16 vectors of partial lanes → one vector of 16 tree16 sums: level 1 adds lanes l, l+8 (of two inputs at
// once), level 2 l, l+4, level 3 l, l+2, level 4 l, l+1. Output lane 4q+c holds input 4c+q's sum (a 4×4
// transpose): callers put key perm16(s) in slot s so that lane k holds key k.
SS_INLINE int perm16(int s) { return 4 * (s & 3) + (s >> 2); }
SS_AVX512 SS_INLINE __m512 reduce16x16(const __m512* p) {
  __m512 t[8], u[4], v[2];
  for (int m = 0; m < 8; ++m)
    t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x44), _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0x88), _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)
    v[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44), _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// A chunk's K, staged as [D/16][16 slots][16 floats] (slot s holds key perm16(s); keys outside [lo, hi),
// seen by no row of the item, are zeros): pass 1 then reads it with one pointer and fixed offsets.
template <typename T, typename C>
SS_AVX512 SS_INLINE void stage_k(const Args<T, C>& a, const Rows& w, int64_t j0, float* kst) {
  for (int s = 0; s < 16; ++s) {
    const int64_t j = j0 + perm16(s);
    const bool in = j >= w.lo && j < w.hi;
    const C* src = in ? a.kd + a.slots[w.c0 + j] * a.ks0 + w.kvh * a.ks1 : nullptr;
    for (int64_t d = 0; d < a.D; d += 16) _mm512_storeu_ps(kst + d * 16 + 16 * s, in ? load16(src + d) : _mm512_setzero_ps());
  }
}

// Ask for the K or V rows of the chunk at j0 ahead of use: their slots are scattered over the pool, so the
// hardware prefetcher cannot guess them. NOTE: PF chunks ahead, into L2: with one chunk ahead into L1 a long
// context streamed ~8 GB/s (the L1 fill buffers cap the misses in flight), 30 layers at 2k context 13.2 ms;
// 8 ahead into L2: 8.8 ms (4 into L2: 9.6; 16: 11.3; 8 into L1: 9.7 — SmolLM2 shapes, AMD EPYC, 2 threads).
constexpr int64_t PF = 8;
template <typename T, typename C>
SS_AVX512 SS_INLINE void prefetch_chunk(const Args<T, C>& a, const Rows& w, const C* base, int64_t j0) {
  for (int64_t j = std::max(j0, w.lo), e = std::min(j0 + 16, w.hi); j < e; ++j) {
    const char* p = reinterpret_cast<const char*>(base + a.slots[w.c0 + j] * a.ks0 + w.kvh * a.ks1);
    for (int64_t o = 0; o < a.D * static_cast<int64_t>(sizeof(C)); o += 64) _mm_prefetch(p + o, _MM_HINT_T2);
  }
}

// A chunk's V rows (keys in [lo, hi) only; the others are never read): the pool rows themselves (fp32)
// or converted once into `vst` (bf16).
template <typename T, typename C>
SS_AVX512 SS_INLINE void chunk_v(const Args<T, C>& a, const Rows& w, int64_t j0, float* vst, const float** rows) {
  for (int k = 0; k < 16; ++k) {
    const int64_t j = j0 + k;
    if (j < w.lo || j >= w.hi) continue;
    const C* src = a.vd + a.slots[w.c0 + j] * a.ks0 + w.kvh * a.ks1;
    if constexpr (std::is_same_v<C, float>) {
      rows[k] = src;
    } else {
      for (int64_t d = 0; d < a.D; d += 16) _mm512_storeu_ps(vst + k * a.D + d, load16(src + d));
      rows[k] = vst + k * a.D;
    }
  }
}

// For NH heads of one query row (the same visible keys `bits`): acc_h[d0, d0 + 16·NV) =
// fma(e_h[k], v_k, acc_h) over the set bits k, ascending; the NH·NV accumulators stay in registers, and
// they are independent chains, which hides the fma latency; each v_k load serves all NH heads.
template <int NV, int NH>
SS_AVX512 SS_INLINE void acc_tile(float* const* ac, const float (*e)[16], uint32_t bits, const float* const* rows, int64_t d0) {
  __m512 x[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) x[h][v] = _mm512_loadu_ps(ac[h] + d0 + 16 * v);
  for (; bits; bits &= bits - 1) {
    const int k = __builtin_ctz(bits);
    const float* vr = rows[k] + d0;
    for (int v = 0; v < NV; ++v) {
      const __m512 vv = _mm512_loadu_ps(vr + 16 * v);
      for (int h = 0; h < NH; ++h) x[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(e[h][k]), vv, x[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ac[h] + d0 + 16 * v, x[h][v]);
}

template <int NH>
SS_AVX512 SS_INLINE void acc_heads(float* const* ac, const float (*e)[16], uint32_t bits, const float* const* rows, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) acc_tile<4, NH>(ac, e, bits, rows, d);
  for (; d < D; d += 16) acc_tile<1, NH>(ac, e, bits, rows, d);
}

// Scratch (floats): qf[RG·D] acc[RG·D] scores[RG·16·nch] stage[16·D]; vis: per row and chunk, visible keys.
template <typename T, typename C>
SS_AVX512 int64_t item_avx512(const Args<T, C>& a, const Rows& w, const float* qf, float* acc, float* sc,
                              float* stage, const uint32_t* vis, int64_t nch, int64_t j00) {
  const int64_t D = a.D, G = w.Gn, RG = w.R * G, span = 16 * nch;
  __m512 mx[RB * 8], sum[RB * 8];
  for (int64_t rg = 0; rg < RG; ++rg) mx[rg] = _mm512_set1_ps(-INFINITY), sum[rg] = _mm512_setzero_ps();
  auto seen = [&](int64_t ch) {  // does any row of the item see a key of chunk ch?
    uint32_t any = 0;
    for (int64_t i = 0; i < w.R; ++i) any |= vis[i * nch + ch];
    return any != 0;
  };
  // pass 1: scores of 16 keys per (row, head), lane-wise running max over the visible ones
  for (int64_t ch = 0; ch < PF; ++ch) prefetch_chunk(a, w, a.kd, j00 + 16 * ch);
  for (int64_t ch = 0; ch < nch; ++ch) {
    prefetch_chunk(a, w, a.kd, j00 + 16 * (ch + PF));
    if (!seen(ch)) continue;
    stage_k(a, w, j00 + 16 * ch, stage);
    for (int64_t rg = 0; rg < RG; ++rg) {
      const __mmask16 m = static_cast<__mmask16>(vis[(rg / G) * nch + ch]);
      if (!m) continue;
      const float* q = qf + rg * D;
      __m512 p[16];
      const __m512 q0 = _mm512_loadu_ps(q);
      for (int s = 0; s < 16; ++s) p[s] = _mm512_mul_ps(q0, _mm512_loadu_ps(stage + 16 * s));
      for (int64_t d = 16; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        const float* kd = stage + 16 * d;
        for (int s = 0; s < 16; ++s) p[s] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kd + 16 * s), p[s]);
      }
      const __m512 s16 = reduce16x16(p);
      _mm512_storeu_ps(sc + rg * span + 16 * ch, s16);
      mx[rg] = _mm512_mask_max_ps(mx[rg], m, mx[rg], s16);
    }
  }
  for (int64_t ch = 0; ch < PF; ++ch) prefetch_chunk(a, w, a.vd, j00 + 16 * ch);
  float mrow[RB * 8];
  for (int64_t rg = 0; rg < RG; ++rg) mrow[rg] = _mm512_reduce_max_ps(mx[rg]);
  std::fill(acc, acc + RG * D, 0.0f);
  // pass 2: e = exp(s − m) on the visible lanes, lane sums, acc += e·v in ascending key order
  const float* rows[16];
  alignas(64) float e[8][16];
  float* ac[8];
  for (int64_t ch = 0; ch < nch; ++ch) {
    prefetch_chunk(a, w, a.vd, j00 + 16 * (ch + PF));
    if (!seen(ch)) continue;
    chunk_v(a, w, j00 + 16 * ch, stage, rows);
    for (int64_t i = 0; i < w.R; ++i) {
      const uint32_t bits = vis[i * nch + ch];
      if (!bits) continue;
      const __mmask16 m = static_cast<__mmask16>(bits);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rg = i * G + g;
        const __m512 s16 = _mm512_loadu_ps(sc + rg * span + 16 * ch);
        const __m512 ev = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(s16, _mm512_set1_ps(mrow[rg]))));
        sum[rg] = _mm512_mask_add_ps(sum[rg], m, sum[rg], ev);
        _mm512_store_ps(e[g], ev);
        ac[g] = acc + rg * D;
      }
      asm volatile("" ::: "memory");  // broadcast e[g][k] from memory (one load) rather than by permutes
      for (int64_t g = 0; g < G; g += 4) {  // heads in groups of up to 4: ≤ 16 accumulators
        switch (std::min<int64_t>(G - g, 4)) {
          case 4: acc_heads<4>(ac + g, e + g, bits, rows, D); break;
          case 3: acc_heads<3>(ac + g, e + g, bits, rows, D); break;
          case 2: acc_heads<2>(ac + g, e + g, bits, rows, D); break;
          default: acc_heads<1>(ac + g, e + g, bits, rows, D);
        }
      }
    }
  }
  // out = acc · (1 / tree16(lane sums)); rows that see no key get zeros
  int64_t dots = 0;
  for (int64_t rg = 0; rg < RG; ++rg) {
    const int64_t i = rg / G, g = rg % G;
    for (int64_t ch = 0; ch < nch; ++ch) dots += __builtin_popcount(vis[i * nch + ch]);
    alignas(64) float lane[16];
    _mm512_store_ps(lane, sum[rg]);
    const float s = tree16(lane), inv = s > 0 ? 1.0f / s : 0.0f;
    T* o = a.od + (w.r0 + i) * a.H * D + (w.h0 + g) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + rg * D + d), _mm512_set1_ps(inv));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(o + d, x);
      } else {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, x);
        for (int l = 0; l < 16; ++l) o[d + l] = static_cast<T>(tmp[l]);
      }
    }
  }
  return dots;
}

}  // namespace specserve_attn
#endif
