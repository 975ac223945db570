// The block-scaled GEMM and activation quantization on AVX2 (x86 CPUs without AVX-512: AMD Zen 1-3, Intel
// client cores), every format: F4/F8 (quant_gemm.cpp's), F5, K4, K5, K6 (quant_gemm_fmt.cpp's). Layout and
// numerics: specserve/models/quant_ref.py.
//
// NOTE: bit-equal to the portable and AVX-512 paths. A tile's 16 columns run as two halves of 8 (one ymm of
// fp32 each), with the same fp32 sequence per output element (mul then add, block order) and the same exact
// integer block sums. AVX2 has no u8·s8 → s32 dot: maddubs gives s16 pair sums, added in s16 only as far as
// they cannot saturate (4-bit codes: all 8 groups, 8·2·15·127 < 2^15; 5-bit: 4 groups; 6-bit: 2), then widened
// to s32 by madd. 8-bit codes (stored + 128) would saturate a pair (2·255·127): they run signed,
// |w|·sign(q_a, w), whose pairs stay ≤ 2·128·127, and Σ (u − 128)·q_a is the AVX-512 path's Σ u·q_a − 128·Σ q_a.
#include "quant_gemm.h"

#include <algorithm>
#include <limits>

namespace specserve_quant {
namespace {

#if defined(__x86_64__)
#define AVX2_TARGET __attribute__((target("avx2,f16c")))

constexpr int64_t MR = 4;        // rows sharing a weight tile's codes (rows_avx2: how they take its halves)
constexpr int64_t PF_TILES = 4;  // software prefetch distance in column tiles, as the AVX-512 paths
constexpr float TINY = 0x1p-100f;  // quant_gemm.cpp's zero-block threshold

AVX2_TARGET inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2_TARGET inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2_TARGET inline __m256 bytes8(const uint8_t* p, bool is_signed) {  // 8 bytes → 8 fp32 (exact)
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
AVX2_TARGET inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
AVX2_TARGET inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

AVX2_TARGET inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Group g's codes (k = 4g..4g+3) of columns 8h..8h+7 of one block, as unsigned bytes (8-bit: signed, code − 128).
template <int BITS>
AVX2_TARGET inline void decode_half(const uint8_t* blk, int h, __m256i* w) {
  blk += 32 * h;
  if (BITS == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) w[g] = _mm256_xor_si256(load32(blk + g * 64), flip);
    return;
  }
  const __m256i nib = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m256i v = load32(blk + g * 64);
    w[g] = _mm256_and_si256(v, nib);
    w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  }
  if (BITS == 5) {  // bit g of each byte → bit 4 of group g
    const __m256i hb = load32(blk + 256), b4 = _mm256_set1_epi8(0x10);
    w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), b4));
    w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), b4));
    w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), b4));
    w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), b4));
    w[4] = _mm256_or_si256(w[4], _mm256_and_si256(hb, b4));
    w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), b4));
    w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), b4));
    w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), b4));
  }
  if (BITS == 6) {  // bits 2j..2j+1 of plane p → bits 4..5 of group 4p + j
    const __m256i b45 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
      const __m256i v = load32(blk + 256 + p * 64);
      w[4 * p] = _mm256_or_si256(w[4 * p], _mm256_and_si256(_mm256_slli_epi16(v, 4), b45));
      w[4 * p + 1] = _mm256_or_si256(w[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), b45));
      w[4 * p + 2] = _mm256_or_si256(w[4 * p + 2], _mm256_and_si256(v, b45));
      w[4 * p + 3] = _mm256_or_si256(w[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), b45));
    }
  }
}

// Σ over groups [G0, G0 + NG) of codes · activations, per column (8 int32): exact (module NOTE).
template <int BITS, int G0, int NG>
AVX2_TARGET inline __m256i dot(const __m256i* w, const int32_t* qa) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int RUN = std::min(NG, BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1);  // s16 sums that cannot saturate
  __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int g = G0; g < G0 + NG; g += RUN) {
    __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // two chains of s16 pair sums
#pragma GCC unroll 8
    for (int j = 0; j < RUN; ++j) {
      const __m256i a = _mm256_set1_epi32(qa[g + j]), wj = w[g + j];
      p[j & 1] = _mm256_add_epi16(p[j & 1], BITS == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(wj), _mm256_sign_epi8(a, wj))
                                                      : _mm256_maddubs_epi16(wj, a));
    }
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones));
  }
  return s;
}

// R rows against NH halves of one tile, from columns 8·h0 on (a half: 8 columns, one ymm of fp32 per row). Up to
// 2 rows take both halves in one pass; more take them one after the other (R accumulators and one block's 8 code
// vectors then stay in the 16 ymm registers). `pf`: a later tile's bytes (prefetched a block's share at a time),
// `pfd`/`pfm` its scale arrays.
template <int R, int NH, int FMT, bool HAS_M, typename S>
AVX2_TARGET void tile_avx2(const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm, float* out,
                           int64_t ldo, int64_t ncols, int h0, const uint8_t* pf, const S* pfd, const S* pfm) {
  constexpr int BITS = FMT & 15;
  constexpr bool KQF = (FMT & KQ) != 0;
  const int64_t nb = a.nb;
  __m256 acc[R][NH];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < NH; ++k) acc[r][k] = _mm256_setzero_ps();
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = KQF ? wp + (b >> 3) * sb_bytes(FMT) + (b & 7) * code_bytes(FMT) : wp + b * code_bytes(FMT);
    const uint8_t* sub0 = KQF ? wp + (b >> 3) * sb_bytes(FMT) + 8 * code_bytes(FMT) + (b & 7) * 32 : nullptr;
    const int64_t sr0 = (KQF ? b >> 3 : b) * NR;
    if (pf) {
      constexpr int64_t share = KQF ? sb_bytes(FMT) / 8 : code_bytes(FMT);
      for (int64_t l = b * share & ~int64_t(63); l < (b + 1) * share; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + l), _MM_HINT_T1);
      if (!KQF || (b & 7) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(pfd + sr0), _MM_HINT_T1);
        if (HAS_M) _mm_prefetch(reinterpret_cast<const char*>(pfm + sr0), _MM_HINT_T1);
      }
    }
#pragma GCC unroll 2
    for (int k = 0; k < NH; ++k) {
      const int h = h0 + k;
      const int64_t sr = sr0 + 8 * h;
      const uint8_t* sub = KQF ? sub0 + 8 * h : nullptr;
      __m256i w[8];
      decode_half<BITS>(blk, h, w);
      __m256 dw = load8(wd + sr), mw = _mm256_setzero_ps();
      __m256i sc0 = _mm256_setzero_si256(), sc1 = _mm256_setzero_si256();
      if (FMT == K6) {
        sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub)));
        sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + NR)));
      } else if (KQF) {  // d_w = d·sc, m_w = (−dmin)·mn: quant_gemm_fmt.cpp's order
        mw = _mm256_mul_ps(_mm256_xor_ps(load8(wm + sr), sign), bytes8(sub + NR, false));
        dw = _mm256_mul_ps(dw, bytes8(sub, false));
      } else if (HAS_M) {
        mw = load8(wm + sr);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * nb + b;
        const int32_t* qa = reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK);
        __m256i s;
        if (FMT == K6) {
          const int32_t alo = a.lo[i], ahi = a.sum[i] - alo;
          s = _mm256_add_epi32(_mm256_mullo_epi32(sc0, _mm256_sub_epi32(dot<BITS, 0, 4>(w, qa), _mm256_set1_epi32(32 * alo))),
                               _mm256_mullo_epi32(sc1, _mm256_sub_epi32(dot<BITS, 4, 4>(w, qa), _mm256_set1_epi32(32 * ahi))));
        } else {
          s = dot<BITS, 0, 8>(w, qa);
          if (FMT == F5 && !HAS_M) s = _mm256_sub_epi32(s, _mm256_set1_epi32(16 * a.sum[i]));  // Q5_0: codes + 16
        }
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[i]));
        acc[r][k] = _mm256_add_ps(acc[r][k], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(s)));
        if (HAS_M) acc[r][k] = _mm256_add_ps(acc[r][k], _mm256_mul_ps(mw, _mm256_set1_ps(a.sa[i])));
      }
    }
  }
  for (int k = 0; k < NH; ++k) {
    const int h = h0 + k;
    const int64_t n = std::min<int64_t>(8, ncols - 8 * h);
    for (int r = 0; r < R && n > 0; ++r) {
      if (n == 8) {
        _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r][k]);
        continue;
      }
      alignas(32) float row[8];
      _mm256_store_ps(row, acc[r][k]);
      std::copy(row, row + n, out + r * ldo + 8 * h);
    }
  }
}

template <int FMT, bool HAS_M, typename S>
void rows_avx2(int64_t mr, const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm, float* out,
               int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd, const S* pfm) {
#define TILE(R, NH, H0, PF) tile_avx2<R, NH, FMT, HAS_M, S>(a, m0, wp, wd, wm, out, ldo, ncols, H0, PF, pfd, pfm)
  switch (mr) {
    case 1: TILE(1, 2, 0, pf); return;
    case 2: TILE(2, 2, 0, pf); return;
  }
  for (int h = 0; h < 2 && 8 * h < ncols; ++h, pf = nullptr) {
    if (mr == 3) TILE(3, 1, h, pf);
    else TILE(4, 1, h, pf);
  }
#undef TILE
}

template <typename S>
void dispatch(int fmt, bool has_m, int64_t mr, const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm,
              float* out, int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd, const S* pfm) {
#define ROWS(F, M) rows_avx2<F, M, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm)
  switch (fmt) {
    case F4: has_m ? ROWS(F4, true) : ROWS(F4, false); break;
    case F5: has_m ? ROWS(F5, true) : ROWS(F5, false); break;
    case F8: has_m ? ROWS(F8, true) : ROWS(F8, false); break;
    case K4: ROWS(K4, true); break;
    case K5: ROWS(K5, true); break;
    case K6: ROWS(K6, false); break;
  }
#undef ROWS
}

template <typename S>
void tiles(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const S* wd, const S* wm, float* y, int64_t ldy,
           int64_t n, int64_t t0, int64_t t1) {
  const int64_t nb = a.nb, srows = fmt & KQ ? nb / 8 : nb;
  const int64_t tile_bytes = fmt & KQ ? srows * sb_bytes(fmt) : nb * code_bytes(fmt);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t ncols = std::min<int64_t>(NR, n - t * NR), tp = t + PF_TILES;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const bool on = tp < t1 && m0 == 0;  // prefetched during the first row pass, if in this thread's range
      dispatch<S>(fmt, wm != nullptr, std::min<int64_t>(MR, M - m0), a, m0, wp + t * tile_bytes, wd + t * srows * NR,
                  wm ? wm + t * srows * NR : nullptr, y + m0 * ldy + t * NR, ldy, ncols,
                  on ? wp + tp * tile_bytes : nullptr, on ? wd + tp * srows * NR : nullptr,
                  on && wm ? wm + tp * srows * NR : nullptr);
    }
  }
}
#endif

}  // namespace

#if defined(__x86_64__)
bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}

AVX2_TARGET void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa,
                                    int32_t* sum, int32_t* lo) {
  const int64_t nb = K / QK;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 vmin = _mm256_set1_ps(-127.f), vmax = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' per-lane interleave
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 1;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      const __m256 ab = _mm256_and_ps(v[j], abs_mask);
      amax = _mm256_max_ps(amax, ab);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(ab, big, _CMP_LE_OQ)) == 0xFF;  // false for NaN and Inf
    }
    const float am = hmax(amax);  // max is exact in any order
    const float id = finite && am >= TINY ? 127.f / am : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i c[4];
    for (int j = 0; j < 4; ++j)  // cvtps rounds with MXCSR (half to even), as nearbyint does
      c[j] = finite ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], vid), vmin), vmax))
                    : _mm256_setzero_si256();
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * QK), _mm256_permutevar8x32_epi32(p, order));
    const int32_t first = hsum(_mm256_add_epi32(c[0], c[1]));
    const int32_t s = first + hsum(_mm256_add_epi32(c[2], c[3]));
    if (lo) lo[i] = first;
    d[i] = !finite ? std::numeric_limits<float>::quiet_NaN() : am >= TINY ? am / 127.f : 0.f;
    sum[i] = s;
    sa[i] = d[i] * static_cast<float>(s);
  }
}

void gemm_tiles_avx2(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const float* wd, const float* wm, float* y,
                     int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles(a, M, fmt, wp, wd, wm, y, ldy, n, t0, t1);
}
void gemm_tiles_avx2(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const at::Half* wd, const at::Half* wm,
                     float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles(a, M, fmt, wp, wd, wm, y, ldy, n, t0, t1);
}
#else
bool have_avx2() { return false; }
void quantize_rows_avx2(const float*, int64_t, int64_t, int8_t*, float*, float*, int32_t*, int32_t*) {}
void gemm_tiles_avx2(const Acts&, int64_t, int, const uint8_t*, const float*, const float*, float*, int64_t, int64_t,
                     int64_t, int64_t) {}
void gemm_tiles_avx2(const Acts&, int64_t, int, const uint8_t*, const at::Half*, const at::Half*, float*, int64_t,
                     int64_t, int64_t, int64_t) {}
#endif

}  // namespace specserve_quant
