// Shared definitions of paged attention (attention.cpp): the work item's arguments, key visibility,
// and the arithmetic that BOTH the portable and the AVX-512 path must perform in the same order.
//
// Arithmetic of one (query row, head), F = float (fp32/bf16 inputs) or double (fp64):
//   q'      = F(q) * F(scale)
//   s_j     = tree16(lane), lane[l] = q'[l]·k_j[l], then lane[l] = fma(q'[16c+l], k_j[16c+l], lane[l]) for
//             c = 1, 2, … (fused multiply-adds are exact-rounded, so every build computes the same bits;
//             no other mul/add is ever contracted: -ffp-contract=off)
//   m       = max over visible s_j (exact, order-free)
//   e_j     = exp_poly(s_j − m)                 (own polynomial for float, std::exp for double)
//   sum     = tree16(sl), sl[pos_j & 15] += e_j  over visible j ascending (pos_j: absolute position)
//   acc[d]  = fma(e_j, v_j[d], acc[d]) from 0     over visible j ascending
//   out[d]  = acc[d] · (1/sum)                   (0 when no key is visible)
// tree16 adds lanes l and l+8, then l and l+4, l+2, l+1 (a pairwise tree). Every quantity depends only
// on the row's own visible keys and positions, never on the other rows, the block or the thread split.
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace specserve_attn {

#define SS_INLINE inline __attribute__((always_inline))

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

// T: the queries' and the output's type; C: the KV pool's (C = T, or a bf16 pool under fp32 queries: keys and
// values widen to F exactly, so the arithmetic below is unchanged)
template <typename T, typename C = T> struct Args {
  const T* qd;
  const C *kd, *vd;
  T* od;
  const int64_t *qs, *qpos, *slots, *cs, *first, *ms;
  const bool* mask;
  bool causal;
  int64_t window, H, D, KVH, G, qs0, qs1, ks0, ks1;
  double scale;
};

constexpr int64_t RB = 8;  // query rows of one request that share each K/V read (a work item's block)

// A work item: rows [r0, r1) of request b (at most RB), kv head kvh, its query heads g0 .. g0 + Gn − 1
// (query head h0 + g); each row's visible context range and their union [lo, hi).
struct Rows {
  int64_t b, kvh, h0, Gn, c0, L, f, r0, R, lo, hi, jlo[RB], jhi[RB];
  template <typename A>
  Rows(const A& a, int64_t b_, int64_t r0_, int64_t r1, int64_t kvh_, int64_t g0, int64_t g1)
      : b(b_), kvh(kvh_), h0(kvh_ * a.G + g0), Gn(g1 - g0), r0(r0_), R(r1 - r0_) {
    c0 = a.cs[b], L = a.cs[b + 1] - c0, f = a.first[b], lo = L, hi = 0;
    for (int64_t i = 0; i < R; ++i) {
      const int64_t p = a.qpos[r0 + i];
      jlo[i] = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1 - f) : 0;
      jhi[i] = a.causal ? std::min<int64_t>(L, p - f + 1) : L;
      lo = std::min(lo, jlo[i]), hi = std::max(hi, jhi[i]);
    }
  }
  // Bit k: whether context entry j0 + k (j0 may be < 0 or the range end ≥ L) is visible to row i.
  template <typename A> uint32_t visible16(const A& a, int64_t i, int64_t j0) const {
    const int64_t s = std::max(j0, jlo[i]), e = std::min(j0 + 16, jhi[i]);
    if (s >= e) return 0;
    uint32_t bits = ((1u << (e - s)) - 1u) << (s - j0);  // e − s ≤ 16
    if (a.mask) {
      const bool* m = a.mask + a.ms[b] + (r0 + i - a.qs[b]) * L;
      for (int64_t j = s; j < e; ++j)
        if (!m[j]) bits &= ~(1u << (j - j0));
    }
    return bits;
  }
};

template <typename F> SS_INLINE F tree16(F* lane) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

// exp(x) for x ≤ 0 (x = s − max): Cody–Waite reduction x = n·ln2 + r, |r| ≤ ln2/2, Cephes' degree-7
// polynomial (≈1 ulp), 2^n from the exponent bits. Float ops and fmas in a fixed order, so the AVX-512
// lane version (exp16 in attention_avx512.h) computes the same bits. n is rounded by the 1.5·2^23 trick
// (no float→int conversion, defined for NaN); x is clamped at −87 so 2^n stays normal (n ≥ −126).
namespace ex {
constexpr float lo = -87.0f, log2e = 1.44269504088896341f, magic = 12582912.0f;  // 1.5·2^23
constexpr float c1 = 0.693359375f, c2 = -2.12194440e-4f;  // ln2 = c1 − c2, c1 exact in few bits
constexpr float p0 = 1.9875691500e-4f, p1 = 1.3981999507e-3f, p2 = 8.3334519073e-3f, p3 = 4.1665795894e-2f,
                p4 = 1.6666665459e-1f, p5 = 5.0000001201e-1f;
constexpr uint32_t magic_bits = 0x4B400000u;
}  // namespace ex

SS_INLINE float exp_poly(float x) {
  x = ex::lo > x ? ex::lo : x;  // NaN stays NaN (as _mm512_max_ps(lo, x))
  const float t = std::fma(x, ex::log2e, ex::magic), n = t - ex::magic;
  const float r = std::fma(n, -ex::c2, std::fma(n, -ex::c1, x)), z = r * r;
  float p = ex::p0;
  for (float pk : {ex::p1, ex::p2, ex::p3, ex::p4, ex::p5}) p = std::fma(p, r, pk);
  const float y = std::fma(p, z, r) + 1.0f;
  uint32_t tb;
  std::memcpy(&tb, &t, 4);
  const uint32_t eb = (tb - ex::magic_bits + 127u) << 23;
  float scale;
  std::memcpy(&scale, &eb, 4);
  return y * scale;
}
SS_INLINE double exp_poly(double x) { return std::exp(x); }  // fp64 has no SIMD path to agree with

}  // namespace specserve_attn
