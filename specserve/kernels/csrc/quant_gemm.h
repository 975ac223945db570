// Shared between quant_gemm.cpp (portable + AVX-512-VNNI paths), quant_gemm_fmt.cpp, quant_gemm_avx2.cpp (AVX2
// path) and quant_gemm_amx.cpp (AMX-INT8 path).
// Numerics: specserve/models/quant_ref.py. Weight layout: quant_ref.pack (tiles of 16 columns, per block
// 8 groups of 4 K-bytes × 16 columns; 4-bit: groups g and g+4 share a byte; 8-bit: code + 128).
#pragma once
#include <cstdint>

#include <c10/util/Half.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace specserve_quant {

constexpr int QK = 32;   // block length along K
constexpr int NR = 16;   // output columns per packed tile (one zmm lane each)

// Weight formats (the op's `fmt`; quant_ref.py): per-block codes of 4, 5 or 8 bits; super-block (KQ) Q4_K, Q5_K, Q6_K.
enum Fmt : int { F4 = 4, F5 = 5, F8 = 8, KQ = 32, K4 = KQ | 4, K5 = KQ | 5, K6 = KQ | 6 };
constexpr int64_t code_bytes(int fmt) { return (fmt & 15) * 64; }   // per block of one 16-column tile
constexpr int64_t sb_bytes(int fmt) { return 8 * (code_bytes(fmt) + 32); }  // KQ: codes + scale codes per 256

struct Acts {  // one quantized activation matrix: q [M, K] int8, d/sa/sum [M, nb]; lo [M, nb]: Σ q_a, k < 16 (K6)
  const int8_t* q; const float* d; const float* sa; const int32_t* sum; int64_t K, nb;
  const int32_t* lo = nullptr;
};

// Block scales d and offsets m are stored as fp32, or as fp16 when every value is exactly an fp16 (GGUF Q4_0/
// Q4_1/Q8_0 store fp16): fewer bytes to stream at decode. fp16 -> fp32 is exact, so the numerics do not change.
inline float scale_at(const float* p, int64_t i) { return p[i]; }
inline float scale_at(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }
#if defined(__x86_64__)
// One 32-code block of 16 columns against one activation block: Σ_g dpbusd(w[g], qa[g]) over its 8 dword
// groups, in two independent chains (integer sums: exact in any order).
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i dot_block(const __m512i* w,
                                                                                    const int32_t* qa) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int g = 0; g < 8; g += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(qa[g]));
    s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(qa[g + 1]));
  }
  return _mm512_add_epi32(s0, s1);
}

// One block of 4-, 5- or 6-bit codes (a nibble plane [+ bit planes]) → 8 vectors of unsigned bytes (group g of
// all 16 columns each): the VNNI kernels' operands and the AMX path's expanded tile.
template <int BITS>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void decode_codes(const uint8_t* blk, __m512i* w) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < 4; ++g) {
    const __m512i v = _mm512_loadu_si512(blk + g * 64);
    w[g] = _mm512_and_si512(v, nib);
    w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  }
  if (BITS == 5) {  // bit g of each byte → bit 4 of group g
    const __m512i h = _mm512_loadu_si512(blk + 256), b4 = _mm512_set1_epi8(0x10);
    w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(h, 4), b4));
    w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(h, 3), b4));
    w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(h, 2), b4));
    w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(h, 1), b4));
    w[4] = _mm512_or_si512(w[4], _mm512_and_si512(h, b4));
    w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(h, 1), b4));
    w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(h, 2), b4));
    w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(h, 3), b4));
  }
  if (BITS == 6) {  // bits 2j..2j+1 of vector h → bits 4..5 of group 4h + j
    const __m512i b45 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(blk + 256 + h * 64);
      w[4 * h] = _mm512_or_si512(w[4 * h], _mm512_and_si512(_mm512_slli_epi16(v, 4), b45));
      w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), b45));
      w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(v, b45));
      w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), b45));
    }
  }
}

__attribute__((target("avx512f"), always_inline)) inline __m512 load_scales(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load_scales(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// quant_gemm.cpp: the 4/8-bit kernels and activation quantization (portable or AVX-512-VNNI).
bool have_vnni();
// lo (or null): Σ q_a over the first 16 codes of each block, exact (Q6_K's scales are per 16).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum, int32_t* lo,
                   bool vnni);
void gemm_tiles(const Acts& a, int64_t M, const uint8_t* wp, const float* wd, const float* wm, int bits, bool vnni,
                float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);
void gemm_tiles(const Acts& a, int64_t M, const uint8_t* wp, const at::Half* wd, const at::Half* wm, int bits,
                bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);

// True when the CPU has AMX-INT8 and Linux granted this process the tile-data state
// (arch_prctl ARCH_REQ_XCOMP_PERM); asked once. False on other CPUs/OSes: callers use the VNNI path.
bool amx_usable();

// Column tiles [t0, t1) of y[M, n] (row stride n) with AMX, every row, for fmt F4, F8, K4 or K6. Each block's
// integer sum is exact int32 and the fp32 epilogue is the VNNI path's, op for op: bit-identical to the other paths.
// NOTE: for M > 16, a.q must hold M rounded up to a multiple of 16 rows (tile loads read whole 16-row chunks;
// the padding rows' results are never used, whatever they hold). One per scale type (fp32, fp16).
// y has row stride ldy (a segment of a wider output); n: this weight's columns.
void gemm_tiles_amx(const Acts& a, int64_t M, const uint8_t* wp, const float* wd, const float* wm, int fmt,
                    float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);
void gemm_tiles_amx(const Acts& a, int64_t M, const uint8_t* wp, const at::Half* wd, const at::Half* wm, int fmt,
                    float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);

// Column tiles [t0, t1) of the formats F5, K4, K5, K6 (quant_gemm_fmt.cpp), portable or AVX-512-VNNI; same
// contract as above. NOTE: of these, the AMX path takes K4 and K6: the op routes F5 and K5 here (VNNI) always.
void gemm_tiles_fmt(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const float* wd, const float* wm,
                    bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);
void gemm_tiles_fmt(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const at::Half* wd, const at::Half* wm,
                    bool vnni, float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);

// quant_gemm_avx2.cpp: every format and the activation quantization on AVX2 + F16C (CPUs without AVX-512), same
// contract and bits as above.
bool have_avx2();
void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum, int32_t* lo);
void gemm_tiles_avx2(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const float* wd, const float* wm, float* y,
                     int64_t ldy, int64_t n, int64_t t0, int64_t t1);
void gemm_tiles_avx2(const Acts& a, int64_t M, int fmt, const uint8_t* wp, const at::Half* wd, const at::Half* wm,
                     float* y, int64_t ldy, int64_t n, int64_t t0, int64_t t1);

}  // namespace specserve_quant
