// AMX-INT8 path of the block-scaled GEMM (quant_gemm.cpp): one TDPBSUD per (16 columns, block of 32, up to
// 16 rows) replaces 8 VNNI dot products per row. Only the integer part gets cheaper: the fp32 epilogue
// (scale, multiply, add, offset per element per block) is mandated and still grows with M, so AMX pays off
// from about 12 rows (AMX_MIN_M in quant_gemm.cpp); below that the fixed tile overhead loses to VNNI.
//
// NOTE (bit-identity with the VNNI/portable paths): a tile multiply gives each (row, column) its block's
// integer sum exactly (|sum| < 2^21, int32): Σ q·q_a for 4-bit codes, and for 8-bit codes stored + 128 the
// VNNI path's own Σ (q + 128)·q_a − 128·Σ q_a (the C tile starts at −128·Σ q_a). The fp32 epilogue below is
// the VNNI path's, op for op and in block order. Rows never mix: a row's result does not depend on M, on
// which 16-row chunk holds it, or on threads.
//
// Weights are NOT stored a second time: the packed layout already is the tile-B layout (8 rows of K-groups ×
// 16 columns × 4 bytes). 8-bit codes are tile-loaded in place; 4- and 6-bit codes (F4, Q4_K, Q6_K: nibble
// planes [+ a 2-bit plane], K-quants 8 blocks per super-block) are expanded once per 16-column tile into an L1
// scratch (one byte per code). Activations are tile-loaded in place. The K-quants' scales are formed in the
// epilogue as quant_gemm_fmt.cpp's VNNI path does: Q4_K's d·sc and −(dmin·mn) per block; Q6_K's int8 scales
// per 16 weight two half-block sums (its tile multiplies are per half-block).
#include "quant_gemm.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

namespace specserve_quant {
namespace {

constexpr int MT = 16;                 // rows per tile multiply (AMX maximum)
constexpr int64_t BLK = 8 * 64;        // bytes of one block of one column tile, expanded to int8
constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
// The tile-load/config intrinsics are asm without a memory operand: keep the compiler from sinking the
// scratch/config stores past them.
#define COMPILER_BARRIER() asm volatile("" ::: "memory")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: C0..C3 = 0..3 (R rows × 16 int32: the sums of 4 consecutive units), A = 4, 5 (R rows × 32 int8:
// one unit of activations), B = 6, 7 (8 K-groups × 64 bytes: one unit of 16 columns), A/B alternating. A unit
// is a block of 32, or for Q6_K (`half`) a half-block of 16 (4 K-groups): its scales are per 16, so its two
// halves' integer sums stay apart.
AMX_TARGET void configure(int R, bool half) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3}) { cfg.rows[t] = R; cfg.colsb[t] = 64; }
  for (int t : {4, 5}) { cfg.rows[t] = R; cfg.colsb[t] = half ? 16 : 32; }
  for (int t : {6, 7}) { cfg.rows[t] = half ? 4 : 8; cfg.colsb[t] = 64; }
  COMPILER_BARRIER();
  _tile_loadconfig(&cfg);
}

// Where block b of a column tile starts: F4 blocks follow each other; K-quant blocks sit 8 to a super-block,
// before their 32 scale-code bytes each (quant_gemm_fmt.cpp: block_codes / block_subs).
inline const uint8_t* codes_at(int fmt, const uint8_t* tile, int64_t b) {
  return fmt & KQ ? tile + (b >> 3) * sb_bytes(fmt) + (b & 7) * code_bytes(fmt) : tile + b * code_bytes(fmt);
}
inline const uint8_t* subs_at(int fmt, const uint8_t* tile, int64_t b) {
  return tile + (b >> 3) * sb_bytes(fmt) + 8 * code_bytes(fmt) + (b & 7) * 32;
}

// One column tile's 4- or 6-bit codes (nb blocks) → one byte each in the same layout (see file comment).
template <int BITS>
AMX_TARGET void expand(const uint8_t* src, int64_t nb, int fmt, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b, dst += BLK) {
    __m512i w[8];
    decode_codes<BITS>(codes_at(fmt, src, b), w);
    for (int g = 0; g < 8; ++g) _mm512_store_si512(dst + g * 64, w[g]);
  }
  COMPILER_BARRIER();
}

// One block's fp32 epilogue for R rows: gemm_tile_vnni's (KQ: tile_vnni's for Q4_K), op for op:
// [KQ: d_w = d·sc, m_w = (−dmin)·mn;] scale = d_w·d_a; acc = acc + scale·float(s); acc = acc + m_w·sa.
// tile: the column tile's packed codes (KQ: its scale codes are read from there).
template <int R, bool HAS_M, bool KQF, typename S>
AMX_TARGET __attribute__((always_inline)) inline void epilogue(__m512* acc, const Acts& a, int64_t m0, int64_t b,
                                                               const S* wd, const S* wm, const uint8_t* tile,
                                                               const int32_t (*s)[NR]) {
  __m512 dw, mw = _mm512_setzero_ps();
  if constexpr (KQF) {
    const uint8_t* sub = subs_at(K4, tile, b);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512 msb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(load_scales(wm + (b >> 3) * NR)), sign));
    dw = _mm512_mul_ps(load_scales(wd + (b >> 3) * NR),
                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)))));
    mw = _mm512_mul_ps(msb, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + NR)))));
  } else {
    dw = load_scales(wd + b * NR);
    if (HAS_M) mw = load_scales(wm + b * NR);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t i = (m0 + r) * a.nb + b;
    const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(s[r]))));
    if (HAS_M) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(a.sa[i])));
  }
}

// Q6_K's epilogue for R rows (tile_vnni's K6 branch, op for op): s_lo, s_hi the half-blocks' integer sums;
// isum = sc_lo·(s_lo − 32·A_lo) + sc_hi·(s_hi − 32·A_hi) (exact); acc = acc + (d·d_a)·float(isum).
template <int R, typename S>
AMX_TARGET __attribute__((always_inline)) inline void epilogue6(__m512* acc, const Acts& a, int64_t m0, int64_t b,
                                                                const S* wd, const uint8_t* tile,
                                                                const int32_t (*s_lo)[NR], const int32_t (*s_hi)[NR]) {
  const uint8_t* sub = subs_at(K6, tile, b);
  const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
  const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + NR)));
  const __m512 dw = load_scales(wd + (b >> 3) * NR);
  for (int r = 0; r < R; ++r) {
    const int64_t i = (m0 + r) * a.nb + b;
    const int32_t lo = a.lo[i], hi = a.sum[i] - lo;
    const __m512i s0 = _mm512_mullo_epi32(sc0, _mm512_sub_epi32(_mm512_load_si512(s_lo[r]), _mm512_set1_epi32(32 * lo)));
    const __m512i s1 = _mm512_mullo_epi32(sc1, _mm512_sub_epi32(_mm512_load_si512(s_hi[r]), _mm512_set1_epi32(32 * hi)));
    const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1))));
  }
}

constexpr int G = 4;  // units per group (one C tile each; an even count: a Q6_K block's two halves stay together)

// What the tile multiplies of one (column tile, row chunk) read.
struct TileArgs {
  const int8_t* aq; long lda;  // activations of the chunk's first row, row stride K
  const uint8_t* w;            // this column tile's codes, [nb][8][64] unsigned: expanded nibbles or code + 128
  const uint8_t* tile;         // the column tile as packed (K-quants: where its scale codes are)
  const int32_t* corr;         // 8-bit: [rows][nb][16] of −128·Σq_a (the C tiles start there), else null
  long ldc;                    // row stride of corr in bytes
  int a_step, b_step;          // bytes from one unit to the next: activations (32 or 16), codes (BLK or BLK/2)
};

// Integer block sums of blocks b0..b0+cnt-1 (cnt <= G) into tiles C0..C(cnt-1): TDPBSUD (signed activations ×
// unsigned codes), starting from 0 (4-bit) or from the 8-bit codes' −128·Σq_a, as the VNNI path subtracts it.
AMX_TARGET __attribute__((always_inline)) inline void multiply_group(const TileArgs& t, int64_t b0, int cnt) {
#define BLOCK(J, CT, AT, BT)                                                          \
  if (J < cnt) {                                                                      \
    if (t.corr) _tile_loadd(CT, t.corr + (b0 + J) * NR, t.ldc); else _tile_zero(CT);  \
    _tile_loadd(AT, t.aq + (b0 + J) * t.a_step, t.lda);                               \
    _tile_loadd(BT, t.w + (b0 + J) * t.b_step, 64);                                   \
    _tile_dpbsud(CT, AT, BT);                                                         \
  }
  BLOCK(0, 0, 4, 6) BLOCK(1, 1, 5, 7) BLOCK(2, 2, 4, 6) BLOCK(3, 3, 5, 7)
#undef BLOCK
}

AMX_TARGET __attribute__((always_inline)) inline void store_group(int cnt, int32_t (*c)[MT][NR]) {
  _tile_stored(0, c[0], NR * 4);
  if (cnt > 1) _tile_stored(1, c[1], NR * 4);
  if (cnt > 2) _tile_stored(2, c[2], NR * 4);
  if (cnt > 3) _tile_stored(3, c[3], NR * 4);
}

// Rows m0..m0+R-1 against one column tile; wd/wm [nb][16]. The tiles multiply the configured rows (R, or MT
// for the zero-padded last chunk of M > MT rows); the epilogue runs for R rows only. Software-pipelined: the
// multiplies of group g + 1 are issued before the epilogue of group g and their sums stored after it, so the
// AMX unit and the vector epilogue overlap and the epilogue's loads never queue behind fresh tile stores.
// Epilogues stay in block order.
template <int R, bool HAS_M, int FMT, typename S>
AMX_TARGET void rows_amx(const Acts& a, int64_t m0, const TileArgs& t, const S* wd, const S* wm, float* out,
                         int64_t ldo, int64_t ncols) {
  alignas(64) int32_t c[2][G][MT][NR];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = FMT == K6 ? 2 * a.nb : a.nb;  // units
  auto count = [nb](int64_t b0) { return static_cast<int>(std::min<int64_t>(G, nb - b0)); };
  multiply_group(t, 0, count(0));
  store_group(count(0), c[0]);
  for (int64_t b0 = 0, g = 0; b0 < nb; b0 += G, ++g) {
    const int64_t next = b0 + G;
    if (next < nb) multiply_group(t, next, count(next));
    if constexpr (FMT == K6) {
      for (int j = 0; j < count(b0); j += 2)
        epilogue6<R, S>(acc, a, m0, (b0 + j) / 2, wd, t.tile, c[g & 1][j], c[g & 1][j + 1]);
    } else {
      for (int j = 0; j < count(b0); ++j)
        epilogue<R, HAS_M, FMT == K4, S>(acc, a, m0, b0 + j, wd, wm, t.tile, c[g & 1][j]);
    }
    if (next < nb) store_group(count(next), c[(g + 1) & 1]);
  }
  const __mmask16 mask = ncols >= NR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

template <bool HAS_M, int FMT, typename S>
void rows_dispatch(int R, const Acts& a, int64_t m0, const TileArgs& w, const S* wd, const S* wm, float* out,
                   int64_t ldo, int64_t ncols) {
  switch (R) {
#define CASE(N) case N: rows_amx<N, HAS_M, FMT, S>(a, m0, w, wd, wm, out, ldo, ncols); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
  }
}

bool request_tile_data() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_tile = edx & (1u << 24), amx_int8 = edx & (1u << 25);
  // Without this permission the first tile instruction faults (SIGILL): Linux enables AMX state per process.
  return amx_tile && amx_int8 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace

bool amx_usable() {
  static const bool ok = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         request_tile_data();
  return ok;
}

namespace {
template <typename S>
AMX_TARGET void tiles_amx(const Acts& a, int64_t M, const uint8_t* wp, const S* wd, const S* wm,
                          int fmt, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  // Row chunks of 16. For M > 16 the tiles stay 16 rows (configured once here; a reconfiguration per chunk
  // costs more than it saves): the last, partial chunk multiplies the zero rows that pad the activations to a
  // multiple of 16 (gemm_tiles_amx's contract) and runs its epilogue for its own rows only. NOTE: it used to
  // recompute a whole chunk ending at M instead (SmolLM2 w4a8 forward, context 300: 17 tokens cost 19.5 ms
  // against 14.5 for 16; padded 17.2-18.0 against 13.9-15.3: the 16-row tile work stays, the epilogue does not).
  const int R = static_cast<int>(std::min<int64_t>(M, MT));
  const bool kq = fmt & KQ, half = fmt == K6;
  const int bits = fmt & 15;
  const int64_t nb = a.nb, srows = kq ? nb / 8 : nb, tile_bytes = kq ? srows * sb_bytes(fmt) : nb * code_bytes(fmt);
  thread_local std::vector<uint8_t> scratch;  // 4-bit: one column tile's expanded codes
  thread_local std::vector<int32_t> corr;     // 8-bit: −128·Σq_a per (row, block), 16 lanes
  TileArgs t{nullptr, static_cast<long>(a.K), nullptr, nullptr, nullptr, static_cast<long>(nb * NR * 4),
             half ? QK / 2 : QK, half ? BLK / 2 : BLK};
  uint8_t* w = nullptr;
  if (bits != 8) {
    scratch.resize(nb * BLK + 64);
    w = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  } else {
    corr.resize(((M + MT - 1) / MT) * MT * nb * NR);  // the padding rows' values are never read back
    for (int64_t i = 0; i < M * nb; ++i)
      _mm512_storeu_si512(corr.data() + i * NR, _mm512_set1_epi32(-128 * a.sum[i]));
    COMPILER_BARRIER();  // tile loads read corr
  }
  configure(R, half);  // tile configuration is per thread: set it in the thread that multiplies
  for (int64_t tt = t0; tt < t1; ++tt) {
    const uint8_t* tw = wp + tt * tile_bytes;
    t.tile = tw;
    if (bits != 8) {
      if (half) expand<6>(tw, nb, fmt, w);
      else expand<4>(tw, nb, fmt, w);
      tw = w;
    }
    const S* td = wd + tt * srows * NR;
    const S* tm = wm ? wm + tt * srows * NR : nullptr;
    const int64_t ncols = std::min<int64_t>(NR, n - tt * NR);
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
      const int rows = static_cast<int>(std::min<int64_t>(MT, M - m0));
      t.aq = a.q + m0 * a.K;
      t.w = tw;
      t.corr = bits == 8 ? corr.data() + m0 * nb * NR : nullptr;
      float* out = y + m0 * ldy + tt * NR;
      if (fmt == K6) rows_dispatch<false, K6, S>(rows, a, m0, t, td, tm, out, ldy, ncols);
      else if (fmt == K4) rows_dispatch<true, K4, S>(rows, a, m0, t, td, tm, out, ldy, ncols);
      else if (tm) rows_dispatch<true, F4, S>(rows, a, m0, t, td, tm, out, ldy, ncols);
      else rows_dispatch<false, F4, S>(rows, a, m0, t, td, tm, out, ldy, ncols);
    }
  }
  _tile_release();  // lets the kernel skip saving ~8 KB of tile state at context switches
}
}  // namespace

void gemm_tiles_amx(const Acts& a, int64_t M, const uint8_t* wp, const float* wd, const float* wm, int fmt,
                    float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles_amx(a, M, wp, wd, wm, fmt, y, ldy, n, t0, t1);
}
void gemm_tiles_amx(const Acts& a, int64_t M, const uint8_t* wp, const at::Half* wd, const at::Half* wm, int fmt,
                    float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1) {
  tiles_amx(a, M, wp, wd, wm, fmt, y, ldy, n, t0, t1);
}

}  // namespace specserve_quant

#else  // not x86-64 Linux: no AMX

namespace specserve_quant {
bool amx_usable() { return false; }
void gemm_tiles_amx(const Acts&, int64_t, const uint8_t*, const float*, const float*, int, float*, int64_t, int64_t,
                    int64_t, int64_t) {}
void gemm_tiles_amx(const Acts&, int64_t, const uint8_t*, const at::Half*, const at::Half*, int, float*, int64_t,
                    int64_t, int64_t, int64_t) {}
}  // namespace specserve_quant

#endif
