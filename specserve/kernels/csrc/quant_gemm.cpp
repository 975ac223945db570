// Block-scaled integer GEMM: y[m, n] = Σ_b (d_w·d_a)·isum(q_w·q_a) [+ m_w·sa], weights in blocks of 32
// (4-bit codes 0..15 or int8, fp32 scale d and optional fp32 offset m per block), activations int8 per
// block of 32 per token (symmetric, d_a = amax/127). Layout and numerics: specserve/models/quant_ref.py.
//
// NOTE: every output element is the same sequence of fp32 operations in block order b = 0..nb-1
// (mul then add, never fused: -ffp-contract=off), whatever M, N, the thread count or the SIMD path;
// the integer part is exact. So rows are independent (decode == verify, batch invariance) and the
// AVX-512-VNNI path, the AMX-INT8 path (quant_gemm_amx.cpp), the portable path and the torch reference
// agree bit for bit.
#include "quant_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <cstdlib>
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif

namespace {
using specserve_quant::Acts;
using specserve_quant::NR;
using specserve_quant::QK;
using specserve_quant::scale_at;
#ifdef SPECSERVE_X86
using specserve_quant::load_scales;
using specserve_quant::dot_block;
#endif

constexpr int MR = 8;    // rows sharing one pass over a weight tile
// Software prefetch distance in column tiles (VNNI path). Measured end to end on SmolLM2 w4a8 decode (Xeon,
// 2 threads): plain 108-119 -> 132-138 tok/s with 4 tiles; 2 was close, 8 worse (docs/benchmarks.md).
constexpr int64_t PF_TILES = 4;
// Blocks with amax below this quantize to zero (d_a = 0): 127/amax would overflow to inf.
constexpr float TINY = 0x1p-100f;
// NOTE: a block holding a NaN or Inf gets d_a = NaN (codes 0), so every output of its row is NaN and the
// engine fails that request; max() drops NaN, and an all-zero block would turn the fault into 0 logits.
inline float act_scale(float amax, bool finite) {
  return !finite ? std::numeric_limits<float>::quiet_NaN() : amax >= TINY ? amax / 127.f : 0.f;
}

// ---- activation quantization (portable) --------------------------------------------------------
void quantize_rows_portable(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum,
                            int32_t* lo) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(xb[j])), finite = finite && std::isfinite(xb[j]);
    const float id = finite && amax >= TINY ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) {
      float r = finite ? std::nearbyint(xb[j] * id) : 0.f;  // default rounding mode: half to even
      r = std::fmin(std::fmax(r, -127.f), 127.f);
      q[i * QK + j] = static_cast<int8_t>(r);
      s += static_cast<int32_t>(r);
      if (lo && j == QK / 2 - 1) lo[i] = s;
    }
    d[i] = act_scale(amax, finite);
    sum[i] = s;
    sa[i] = d[i] * static_cast<float>(s);
  }
}

// ---- block dot products (portable): same operation order as the SIMD path --------------------
template <typename S>
void gemm_tile_portable(const Acts& a, int64_t m0, int64_t mr, const uint8_t* wp, const S* wd, const S* wm,
                        int bits, float* out, int64_t ldo, int64_t ncols) {
  const int64_t nb = a.nb;
  const int64_t tile_bytes = bits == 4 ? QK * NR / 2 : QK * NR;  // per block
  const int32_t offset = bits == 8 ? 128 : 0;
  for (int64_t r = 0; r < mr; ++r) {
    const int64_t m = m0 + r;
    float acc[NR] = {0.f};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + b * tile_bytes;
      const int8_t* qa = a.q + m * a.K + b * QK;
      const float da = a.d[m * nb + b], sab = a.sa[m * nb + b];
      const int32_t corr = offset * a.sum[m * nb + b];
      for (int c = 0; c < NR; ++c) {
        int32_t s = 0;
        for (int g = 0; g < 8; ++g) {  // group g holds k = 4g..4g+3
          for (int e = 0; e < 4; ++e) {
            int32_t u;
            if (bits == 4) {
              const uint8_t byte = blk[((g & 3) * NR + c) * 4 + e];
              u = g < 4 ? (byte & 0xF) : (byte >> 4);
            } else {
              u = blk[(g * NR + c) * 4 + e];
            }
            s += u * static_cast<int32_t>(qa[4 * g + e]);
          }
        }
        s -= corr;
        const float scale = scale_at(wd, b * NR + c) * da;
        acc[c] = acc[c] + scale * static_cast<float>(s);
        if (wm) acc[c] = acc[c] + scale_at(wm, b * NR + c) * sab;
      }
    }
    for (int64_t c = 0; c < ncols; ++c) out[r * ldo + c] = acc[c];
  }
}

#ifdef SPECSERVE_X86
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

VNNI_TARGET void quantize_rows_vnni(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa,
                                    int32_t* sum, int32_t* lo) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
    const float amax = _mm512_reduce_max_ps(a);  // max is exact in any order
    // NaN/Inf: |x| ≤ FLT_MAX fails (an ordered compare is false for NaN)
    const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
    const bool finite = (_mm512_cmp_ps_mask(_mm512_abs_ps(x0), big, _CMP_LE_OQ) &
                         _mm512_cmp_ps_mask(_mm512_abs_ps(x1), big, _CMP_LE_OQ)) == 0xFFFF;
    if (!finite) x0 = x1 = _mm512_setzero_ps();  // codes 0 (NaN·0 would convert to -127)
    const float id = finite && amax >= TINY ? 127.f / amax : 0.f;
    const __m512 vid = _mm512_set1_ps(id), vmin = _mm512_set1_ps(-127.f), vmax = _mm512_set1_ps(127.f);
    // cvtps rounds with MXCSR (half to even), as nearbyint does.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, vid), vmin), vmax));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, vid), vmin), vmax));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    if (lo) lo[i] = _mm512_reduce_add_epi32(q0);
    d[i] = act_scale(amax, finite);
    sum[i] = s;
    sa[i] = d[i] * static_cast<float>(s);
  }
}

// R rows against one tile of 16 columns; the weight block stays in registers for all R rows.
// `pf` (or null): a later tile's codes, fetched block by block into L2 while this one computes. At one or
// a few rows the GEMM streams its weights from DRAM; the hardware prefetcher alone leaves that latency exposed.
template <int R, int BITS, bool HAS_M, typename S>
VNNI_TARGET void gemm_tile_vnni(const Acts& a, int64_t m0, const uint8_t* wp, const S* wd, const S* wm,
                                float* out, int64_t ldo, int64_t ncols, const uint8_t* pf, const S* pfd,
                                const S* pfm) {
  const int64_t nb = a.nb;
  constexpr int64_t tile_bytes = BITS == 4 ? QK * NR / 2 : QK * NR;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wp + b * tile_bytes;
    if (pf) {
      for (int64_t l = 0; l < tile_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + b * tile_bytes + l), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pfd + b * NR), _MM_HINT_T1);
      if (HAS_M) _mm_prefetch(reinterpret_cast<const char*>(pfm + b * NR), _MM_HINT_T1);
    }
    __m512i w[8];
    if (BITS == 4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(blk + g * 64);
        w[g] = _mm512_and_si512(v, nib);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    } else {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(blk + g * 64);
    }
    const __m512 dw = load_scales(wd + b * NR);
    __m512 mw = _mm512_setzero_ps();
    if (HAS_M) mw = load_scales(wm + b * NR);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      __m512i s = dot_block(w, reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK));
      if (BITS == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.sum[m * nb + b]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[m * nb + b]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(s)));
      if (HAS_M) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.sa[m * nb + b])));
    }
  }
  const __mmask16 mask = ncols >= NR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

template <int BITS, bool HAS_M, typename S>
VNNI_TARGET void gemm_rows_vnni(const Acts& a, int64_t m0, int64_t mr, const uint8_t* wp, const S* wd,
                                const S* wm, float* out, int64_t ldo, int64_t ncols, const uint8_t* pf,
                                const S* pfd, const S* pfm) {
  switch (mr) {
#define CASE(R) case R: gemm_tile_vnni<R, BITS, HAS_M, S>(a, m0, wp, wd, wm, out, ldo, ncols, pf, pfd, pfm); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

bool cpu_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}
#else
bool cpu_vnni() { return false; }
#endif
template <typename S>
void tiles48(const Acts& a, int64_t M, const uint8_t* wpp, const S* wdp, const S* wmp, int64_t bits, bool vnni,
                float* yp, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  const int64_t nb = a.nb, tile_bytes = nb * QK * NR * bits / 8;
  const bool has_m = wmp != nullptr;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tw = wpp + t * tile_bytes;
    const S* td = wdp + t * nb * NR;
    const S* tm = has_m ? wmp + t * nb * NR : nullptr;
    const int64_t ncols = std::min<int64_t>(NR, n - t * NR);
    const int64_t tp = t + PF_TILES;  // prefetched during the first row pass, if still in this thread's range
    const bool pf_on = tp < t1;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m0);
      float* out = yp + m0 * ldy + t * NR;
#ifdef SPECSERVE_X86
      if (vnni) {
        const bool on = pf_on && m0 == 0;
        const uint8_t* pf = on ? wpp + tp * tile_bytes : nullptr;
        const S* pfd = on ? wdp + tp * nb * NR : nullptr;
        const S* pfm = on && has_m ? wmp + tp * nb * NR : nullptr;
        if (bits == 4 && has_m) gemm_rows_vnni<4, true, S>(a, m0, mr, tw, td, tm, out, ldy, ncols, pf, pfd, pfm);
        else if (bits == 4) gemm_rows_vnni<4, false, S>(a, m0, mr, tw, td, tm, out, ldy, ncols, pf, pfd, pfm);
        else if (has_m) gemm_rows_vnni<8, true, S>(a, m0, mr, tw, td, tm, out, ldy, ncols, pf, pfd, pfm);
        else gemm_rows_vnni<8, false, S>(a, m0, mr, tw, td, tm, out, ldy, ncols, pf, pfd, pfm);
        continue;
      }
#endif
      gemm_tile_portable(a, m0, mr, tw, td, tm, static_cast<int>(bits), out, ldy, ncols);
    }
  }
}


}  // namespace

namespace specserve_quant {

bool have_vnni() { return cpu_vnni(); }

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum, int32_t* lo,
                   bool vnni) {
#ifdef SPECSERVE_X86
  if (vnni) return quantize_rows_vnni(x, M, K, q, d, sa, sum, lo);
#endif
  quantize_rows_portable(x, M, K, q, d, sa, sum, lo);
}

void gemm_tiles(const Acts& a, int64_t M, const uint8_t* wp, const float* wd, const float* wm, int bits, bool vnni,
                float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles48(a, M, wp, wd, wm, bits, vnni, y, ldy, n, t0, t1);
}
void gemm_tiles(const Acts& a, int64_t M, const uint8_t* wp, const at::Half* wd, const at::Half* wm, int bits,
                bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles48(a, M, wp, wd, wm, bits, vnni, y, ldy, n, t0, t1);
}

}  // namespace specserve_quant
