// The block-scaled GEMM for the GGUF formats beyond 4/8-bit codes with per-block scales (quant_gemm.cpp has
// those): F5 (Q5_1: 5-bit codes, per-block d/m; Q5_0: no m, codes stored + 16), K4/K5 (Q4_K/Q5_K: fp16 d, dmin per 256 and 6-bit scale/min
// codes per 32) and K6 (Q6_K: 6-bit codes, int8 scale per 16, fp16 d per 256). Layout and numerics:
// specserve/models/quant_ref.py (pack, pack_kquant, the module docstring).
//
// NOTE: the same fp32 sequence per output element as quant_gemm.cpp (mul then add, never fused, block order),
// portable and VNNI alike: K4/K5 form d_w = d·sc and m_w = −(dmin·mn) in fp32 first, which is what storing them
// as fp32 gave, so Q4_K results did not change bits when its scales stopped being streamed as fp32. K6's integer
// sum sc_lo·(S_lo − 32·A_lo) + sc_hi·(S_hi − 32·A_hi) is exact (< 2^24 in magnitude).
#include "quant_gemm.h"

#include <algorithm>
#include <cstring>

namespace specserve_quant {
namespace {

constexpr int64_t PF_TILES = 4;  // prefetch distance in column tiles, as quant_gemm.cpp

// Where block b of a tile starts (codes), and its 32 scale-code bytes (KQ formats).
inline const uint8_t* block_codes(int fmt, const uint8_t* wp, int64_t b) {
  return fmt & KQ ? wp + (b >> 3) * sb_bytes(fmt) + (b & 7) * code_bytes(fmt) : wp + b * code_bytes(fmt);
}
inline const uint8_t* block_subs(int fmt, const uint8_t* wp, int64_t b) {
  return wp + (b >> 3) * sb_bytes(fmt) + 8 * code_bytes(fmt) + (b & 7) * 32;
}
// Index of block b's d (and m/dmin) in a tile's [blocks or super-blocks][16] scale array.
inline int64_t scale_row(int fmt, int64_t b) { return fmt & KQ ? b >> 3 : b; }

// Code of group g (k = 4g..4g+3), column c, byte e: the nibble plane plus bit 4 (5-bit) or bits 4..5 (6-bit).
inline int32_t code_at(const uint8_t* blk, int bits, int g, int c, int e) {
  const int p = c * 4 + e;
  const uint8_t byte = blk[(g & 3) * 64 + p];
  int32_t u = g < 4 ? (byte & 0xF) : (byte >> 4);
  if (bits == 5) u |= ((blk[256 + p] >> g) & 1) << 4;
  if (bits == 6) u |= ((blk[256 + (g >> 2) * 64 + p] >> (2 * (g & 3))) & 3) << 4;
  return u;
}

template <typename S>
void tile_portable(const Acts& a, int64_t m0, int64_t mr, int fmt, const uint8_t* wp, const S* wd, const S* wm,
                   float* out, int64_t ldo, int64_t ncols) {
  const int64_t nb = a.nb;
  const int bits = fmt & 15;
  for (int64_t r = 0; r < mr; ++r) {
    const int64_t m = m0 + r;
    float acc[NR] = {0.f};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = block_codes(fmt, wp, b);
      const uint8_t* sub = block_subs(fmt, wp, b);
      const int8_t* qa = a.q + m * a.K + b * QK;
      const int64_t i = m * nb + b, sr = scale_row(fmt, b) * NR;
      const float da = a.d[i], sab = a.sa[i];
      for (int c = 0; c < NR; ++c) {
        int32_t s[2] = {0, 0};  // k < 16, k >= 16
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e) s[g >> 2] += code_at(blk, bits, g, c, e) * static_cast<int32_t>(qa[4 * g + e]);
        if (fmt == K6) {
          const int32_t lo = a.lo[i], hi = a.sum[i] - lo;
          const int32_t isum = static_cast<int8_t>(sub[c]) * (s[0] - 32 * lo) +
                               static_cast<int8_t>(sub[NR + c]) * (s[1] - 32 * hi);
          const float scale = scale_at(wd, sr + c) * da;
          acc[c] = acc[c] + scale * static_cast<float>(isum);
          continue;
        }
        float dw = scale_at(wd, sr + c), mw = wm ? scale_at(wm, sr + c) : 0.f;
        if (fmt & KQ) {
          dw = dw * static_cast<float>(sub[c]);
          mw = -(mw * static_cast<float>(sub[NR + c]));
        }
        const int32_t corr = fmt == F5 && !wm ? 16 * a.sum[i] : 0;  // Q5_0: codes stored + 16
        const float scale = dw * da;
        acc[c] = acc[c] + scale * static_cast<float>(s[0] + s[1] - corr);
        if (wm) acc[c] = acc[c] + mw * sab;
      }
    }
    for (int64_t c = 0; c < ncols; ++c) out[r * ldo + c] = acc[c];
  }
}

#if defined(__x86_64__)
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

VNNI_TARGET __attribute__((always_inline)) inline __m512 bytes_ps(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// R rows against one tile of 16 columns (quant_gemm.cpp's gemm_tile_vnni, for these formats). `pf`: a later
// tile's bytes (fetched a block's share at a time), `pfd`/`pfm` its scale arrays.
template <int R, int FMT, bool HAS_M, typename S>
VNNI_TARGET void tile_vnni(const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm, float* out,
                           int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd, const S* pfm) {
  constexpr int BITS = FMT & 15;
  constexpr bool KQF = (FMT & KQ) != 0;
  const int64_t nb = a.nb;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  // KQ: the super-block's d and −dmin, converted once per 8 blocks. NOTE: (−dmin)·mn == −(dmin·mn) bit for bit
  // (round to nearest even is sign-symmetric), the reference's order.
  __m512 dsb = _mm512_setzero_ps(), msb = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t sr = scale_row(FMT, b) * NR;
    if (KQF && (b & 7) == 0) {
      dsb = load_scales(wd + sr);
      if (HAS_M) msb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(load_scales(wm + sr)), sign));
    }
    if (pf) {
      // a block's share of the tile's bytes (KQ: codes and scale codes): no division in the loop
      constexpr int64_t share = KQF ? sb_bytes(FMT) / 8 : code_bytes(FMT);
      for (int64_t l = b * share & ~int64_t(63); l < (b + 1) * share; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + l), _MM_HINT_T1);
      if (!KQF || (b & 7) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(pfd + sr), _MM_HINT_T1);
        if (HAS_M) _mm_prefetch(reinterpret_cast<const char*>(pfm + sr), _MM_HINT_T1);
      }
    }
    const uint8_t* sub = block_subs(FMT, wp, b);
    __m512i w[8];
    decode_codes<BITS>(block_codes(FMT, wp, b), w);
    if constexpr (FMT == K6) {
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + NR)));
      const __m512 dw = dsb;
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r, i = m * nb + b;
        const int32_t* qa = reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g) {
          s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(qa[g]));
          s1 = _mm512_dpbusd_epi32(s1, w[g + 4], _mm512_set1_epi32(qa[g + 4]));
        }
        const int32_t lo = a.lo[i], hi = a.sum[i] - lo;
        s0 = _mm512_mullo_epi32(sc0, _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * lo)));
        s1 = _mm512_mullo_epi32(sc1, _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * hi)));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1))));
      }
      continue;
    } else {
      __m512 dw, mw = _mm512_setzero_ps();
      if (KQF) {
        dw = _mm512_mul_ps(dsb, bytes_ps(sub, false));
        mw = _mm512_mul_ps(msb, bytes_ps(sub + NR, false));
      } else {
        dw = load_scales(wd + sr);
        if (HAS_M) mw = load_scales(wm + sr);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r, i = m * nb + b;
        __m512i s = dot_block(w, reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK));
        if (FMT == F5 && !HAS_M) s = _mm512_sub_epi32(s, _mm512_set1_epi32(16 * a.sum[i]));  // Q5_0: codes + 16
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(s)));
        if (HAS_M) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.sa[i])));
      }
    }
  }
  const __mmask16 mask = ncols >= NR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

template <int FMT, bool HAS_M, typename S>
void rows_vnni(int64_t mr, const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm, float* out,
               int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd, const S* pfm) {
  switch (mr) {
#define CASE(R) case R: tile_vnni<R, FMT, HAS_M, S>(a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

template <typename S>
void dispatch_vnni(int fmt, bool has_m, int64_t mr, const Acts& a, int64_t m0, const uint8_t* wp, const S* wd,
                   const S* wm, float* out, int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd, const S* pfm) {
  switch (fmt) {
    case F5:
      if (has_m) rows_vnni<F5, true, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm);
      else rows_vnni<F5, false, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm);
      break;
    case K4: rows_vnni<K4, true, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm); break;
    case K5: rows_vnni<K5, true, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm); break;
    case K6: rows_vnni<K6, false, S>(mr, a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm); break;
  }
}
#endif

constexpr int64_t MR = 8;  // rows sharing one pass over a weight tile

template <typename S>
void tiles(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const S* wd, const S* wm, bool vnni, float* y,
           int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  const int64_t nb = a.nb, srows = fmt & KQ ? nb / 8 : nb;
  const int64_t tile_bytes = fmt & KQ ? srows * sb_bytes(fmt) : nb * code_bytes(fmt);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tw = wp + t * tile_bytes;
    const S* td = wd + t * srows * NR;
    const S* tm = wm ? wm + t * srows * NR : nullptr;
    const int64_t ncols = std::min<int64_t>(NR, n - t * NR), tp = t + PF_TILES;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m0);
      float* out = y + m0 * ldy + t * NR;
#if defined(__x86_64__)
      if (vnni) {
        const bool on = tp < t1 && m0 == 0;  // prefetched during the first row pass, if in this thread's range
        dispatch_vnni<S>(fmt, wm != nullptr, mr, a, m0, tw, td, tm, out, ldy, ncols, on ? wp + tp * tile_bytes : nullptr,
                         on ? wd + tp * srows * NR : nullptr, on && wm ? wm + tp * srows * NR : nullptr);
        continue;
      }
#endif
      tile_portable(a, m0, mr, fmt, tw, td, tm, out, ldy, ncols);
    }
  }
}

}  // namespace

void gemm_tiles_fmt(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const float* wd, const float* wm,
                    bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles(a, M, fmt, wp, wd, wm, vnni, y, ldy, n, t0, t1);
}
void gemm_tiles_fmt(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const at::Half* wd, const at::Half* wm,
                    bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles(a, M, fmt, wp, wd, wm, vnni, y, ldy, n, t0, t1);
}

}  // namespace specserve_quant
