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

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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
#endif

constexpr int MR = 8;    // rows sharing one pass over a weight tile
// Software prefetch distance in column tiles (VNNI path). Measured end to end on SmolLM2 w4a8 decode (Xeon,
// 2 threads): plain 108-119 -> 132-138 tok/s with 4 tiles; 2 was close, 8 worse (docs/benchmarks.md).
constexpr int64_t PF_TILES = 4;
// Blocks with amax below this quantize to zero (d_a = 0): 127/amax would overflow to inf.
constexpr float TINY = 0x1p-100f;

// ---- activation quantization (portable) --------------------------------------------------------
void quantize_rows_portable(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float id = amax >= TINY ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) {
      float r = std::nearbyint(xb[j] * id);  // default rounding mode: half to even
      r = std::fmin(std::fmax(r, -127.f), 127.f);
      q[i * QK + j] = static_cast<int8_t>(r);
      s += static_cast<int32_t>(r);
    }
    d[i] = amax >= TINY ? amax / 127.f : 0.f;
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
                                    int32_t* sum) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
    const float amax = _mm512_reduce_max_ps(a);  // max is exact in any order
    const float id = amax >= TINY ? 127.f / amax : 0.f;
    const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    // cvtps rounds with MXCSR (half to even), as nearbyint does.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x0, vid), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x1, vid), lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[i] = amax >= TINY ? amax / 127.f : 0.f;
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
      const int32_t* qa = reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK);
      // two independent chains (integer sums: exact in any order)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(qa[g]));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(qa[g + 1]));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
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

bool have_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}
#else
bool have_vnni() { return false; }
#endif

// impl: 0 = best available, 1 = portable, 2 = AVX-512-VNNI only, 3 = AMX-INT8 for every M (tests and benches
// force a path to compare them; a forced path the CPU lacks is an error, not a silent fallback);
// -1 = from the environment, read at every call (cheap here, unlike os.environ from Python per linear):
// SPECSERVE_QUANT_IMPL = auto | portable | vnni | amx; SPECSERVE_QUANT_PORTABLE=1 means portable.
enum Impl : int64_t { FROM_ENV = -1, AUTO = 0, PORTABLE = 1, VNNI = 2, AMX = 3 };

int64_t env_impl() {
  const char* portable = std::getenv("SPECSERVE_QUANT_PORTABLE");
  if (portable && *portable && std::strcmp(portable, "0") != 0) return PORTABLE;
  const char* name = std::getenv("SPECSERVE_QUANT_IMPL");
  if (!name || !*name || !std::strcmp(name, "auto")) return AUTO;
  if (!std::strcmp(name, "portable")) return PORTABLE;
  if (!std::strcmp(name, "vnni")) return VNNI;
  if (!std::strcmp(name, "amx")) return AMX;
  TORCH_CHECK(false, "SPECSERVE_QUANT_IMPL='", name, "': choose one of auto, portable, vnni, amx");
}
// AMX pays off from this many rows. At SmolLM2-135M's shapes it loses at M <= 6 (its fixed tile/expand
// cost per block), is mixed at M = 8 (-8 %..+10 % per shape; no gain end to end for verify-8), and wins on
// every shape from M = 12 (1.05-1.2x; 1.2-1.4x at M = 16).
constexpr int64_t AMX_MIN_M = 12;
constexpr int64_t AMX_CHUNK = 16;  // rows per AMX tile multiply (quant_gemm_amx.cpp: MT)
constexpr int64_t VNNI_REST = 3;

bool use_vnni(int64_t impl) {
  TORCH_CHECK(impl >= AUTO && impl <= AMX, "qgemm: impl must be 0 (auto), 1 (portable), 2 (vnni) or 3 (amx)");
  TORCH_CHECK(impl < VNNI || have_vnni(), "qgemm: this CPU has no AVX-512-VNNI");
  return impl != PORTABLE && have_vnni();
}

bool use_amx(int64_t impl, int64_t M) {
  if (impl == AMX) {
    TORCH_CHECK(specserve_quant::amx_usable(), "qgemm: AMX-INT8 is not available (CPU or OS permission)");
    return true;
  }
  return impl == AUTO && M >= AMX_MIN_M && have_vnni() && specserve_quant::amx_usable();
}

// pad_rows: q gets M rounded up to a multiple of it rows (zeros past M; the AMX path's contract), returned [M, K].
std::vector<at::Tensor> quantize_act_padded(const at::Tensor& x_, int64_t impl, int64_t pad_rows) {
  if (impl == FROM_ENV) impl = env_impl();
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) % QK == 0, "quantize_act: x must be [M, K] with K % 32 == 0");
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, padded = (M + pad_rows - 1) / pad_rows * pad_rows;
  at::Tensor q = padded > M ? at::zeros({padded, K}, x.options().dtype(at::kChar)).narrow(0, 0, M)
                            : at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor sa = at::empty({M, nb}, x.options());
  at::Tensor sum = at::empty({M, nb}, x.options().dtype(at::kInt));
  auto args = std::make_tuple(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                              sa.data_ptr<float>(), sum.data_ptr<int32_t>());
#ifdef SPECSERVE_X86
  if (use_vnni(impl)) { std::apply(quantize_rows_vnni, args); return {q, d, sa, sum}; }
#endif
  std::apply(quantize_rows_portable, args);
  return {q, d, sa, sum};
}

std::vector<at::Tensor> quantize_act(const at::Tensor& x, int64_t impl) { return quantize_act_padded(x, impl, 1); }

// Column tiles [t0, t1) of y = x·Wᵀ on the VNNI or portable path (S: the scales' type).
template <typename S>
void gemm_tiles(const Acts& a, int64_t M, const uint8_t* wpp, const S* wdp, const S* wmp, int64_t bits, bool vnni,
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

// One weight (or row segment of a fused one): packed codes, scales, offsets; n columns written at column col.
struct Seg {
  const at::Tensor* wp; const at::Tensor* wd; const at::Tensor* wm; int64_t n, fmt, col, t0, ntiles;
};

Seg check_seg(const at::Tensor& wp, const at::Tensor& wd, const c10::optional<at::Tensor>& wm, int64_t n, int64_t fmt,
              int64_t K) {
  using namespace specserve_quant;
  TORCH_CHECK(fmt == F4 || fmt == F5 || fmt == F8 || fmt == K4 || fmt == K5 || fmt == K6,
              "qgemm: fmt must be 4, 5, 8 (per-block codes) or 36, 37, 38 (Q4_K, Q5_K, Q6_K), got ", fmt);
  const bool half = wd.scalar_type() == at::kHalf, kq = fmt & KQ;
  TORCH_CHECK(wp.dtype() == at::kByte && wp.is_contiguous() && (half || wd.dtype() == at::kFloat) && wd.is_contiguous(),
              "qgemm: packed weights must be contiguous uint8 codes and float32 or float16 scales");
  TORCH_CHECK(!kq || (half && K % 256 == 0), "qgemm: super-block formats need float16 scales and K % 256 == 0");
  const int64_t nb = K / QK, ntiles = (n + NR - 1) / NR, rows = kq ? nb / 8 : nb;
  const int64_t bytes = kq ? rows * sb_bytes(fmt) : nb * code_bytes(fmt);
  TORCH_CHECK(wd.numel() == ntiles * rows * NR && wp.numel() == ntiles * bytes,
              "qgemm: packed weight does not match K=", K, " n=", n, " fmt=", fmt);
  const bool has_m = wm.has_value() && wm->defined();
  if (has_m) TORCH_CHECK(wm->dtype() == wd.dtype() && wm->is_contiguous() && wm->numel() == wd.numel(),
                         "qgemm: offsets must have the scales' dtype and shape");
  TORCH_CHECK(has_m || (fmt != K4 && fmt != K5), "qgemm: Q4_K/Q5_K need their dmin (wm)");
  TORCH_CHECK(!has_m || fmt != K6, "qgemm: Q6_K has no offsets");
  return Seg{&wp, &wd, has_m ? &*wm : nullptr, n, fmt, 0, 0, ntiles};
}

// y[:, seg.col : seg.col + seg.n] for every segment, one activation quantization, one parallel loop over all
// column tiles. NOTE: the split over tiles (columns), and of rows between paths, never changes any element's
// arithmetic. AMX takes F4/F8 segments; the other formats run on VNNI (or portable) whatever the path.
at::Tensor qgemm_run(const at::Tensor& x, std::vector<Seg> segs, int64_t impl) {
  if (impl == FROM_ENV) impl = env_impl();
  const int64_t K = x.size(-1), nb = K / QK;
  int64_t N = 0, T = 0;
  bool k6 = false;
  for (Seg& s : segs) {
    s.col = N, s.t0 = T;
    N += s.n, T += s.ntiles;
    k6 = k6 || s.fmt == specserve_quant::K6;
  }
  const at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  const bool vnni = use_vnni(impl), amx = M > 0 && use_amx(impl, M);
  // Under AUTO, up to VNNI_REST rows past the last full AMX chunk go to VNNI: cheaper than a partial chunk's
  // tile work (gate_up, M = 16 -> 17: +0.027 ms on AMX, a VNNI row 0.018). More rows: a zero-padded AMX chunk.
  const int64_t rest = amx && impl == AUTO && M > AMX_CHUNK && M % AMX_CHUNK <= VNNI_REST ? M % AMX_CHUNK : 0;
  const int64_t m_amx = M - rest;
  auto act = quantize_act_padded(x2, impl, amx && m_amx > AMX_CHUNK ? AMX_CHUNK : 1);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor lo;  // K6: Σ q_a over the first 16 of each block (exact int32)
  if (k6) lo = act[0].view({M, nb, 2, 16}).select(2, 0).sum({-1}, false, at::kInt).contiguous();
  Acts a{act[0].data_ptr<int8_t>(), act[1].data_ptr<float>(), act[2].data_ptr<float>(),
         act[3].data_ptr<int32_t>(), K, nb};
  if (k6) a.lo = lo.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  Acts tail{a.q + m_amx * K, a.d + m_amx * nb, a.sa + m_amx * nb, a.sum + m_amx * nb, K, nb};
  auto one = [&](const Seg& s, auto* wdp, auto* wmp, int64_t t0, int64_t t1) {
    const uint8_t* wpp = s.wp->data_ptr<uint8_t>();
    float* ys = yp + s.col;
    if (s.fmt != specserve_quant::F4 && s.fmt != specserve_quant::F8)
      return specserve_quant::gemm_tiles_fmt(a, M, static_cast<int>(s.fmt), wpp, wdp, wmp, vnni, ys, N, s.n, t0, t1);
    if (!amx) return gemm_tiles(a, M, wpp, wdp, wmp, s.fmt, vnni, ys, N, s.n, t0, t1);
    specserve_quant::gemm_tiles_amx(a, m_amx, wpp, wdp, wmp, static_cast<int>(s.fmt), ys, N, s.n, t0, t1);
    if (rest) gemm_tiles(tail, rest, wpp, wdp, wmp, s.fmt, vnni, ys + m_amx * N, N, s.n, t0, t1);
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (const Seg& s : segs) {
      const int64_t lo_t = std::max(t0, s.t0) - s.t0, hi_t = std::min(t1, s.t0 + s.ntiles) - s.t0;
      if (lo_t >= hi_t) continue;
      if (s.wd->scalar_type() == at::kHalf)
        one(s, s.wd->data_ptr<at::Half>(), s.wm ? s.wm->data_ptr<at::Half>() : static_cast<at::Half*>(nullptr), lo_t, hi_t);
      else one(s, s.wd->data_ptr<float>(), s.wm ? s.wm->data_ptr<float>() : static_cast<float*>(nullptr), lo_t, hi_t);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// x [M, K] float; wp packed codes; wd/wm [ntiles, nb or nb/8, 16] fp32 or fp16 → y [M, n] float. fmt: quant_ref.py.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& wd, const c10::optional<at::Tensor>& wm,
                 int64_t n, int64_t fmt, int64_t impl) {
  return qgemm_run(x, {check_seg(wp, wd, wm, n, fmt, x.size(-1))}, impl);
}

// A fused weight of row segments: w = (wp, wd, wm?) per segment, dims = (n, fmt) per segment → y [M, Σ n].
at::Tensor qgemm_segs(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w, at::IntArrayRef dims,
                      int64_t impl) {
  const int64_t S = static_cast<int64_t>(dims.size()) / 2;
  TORCH_CHECK(S > 0 && static_cast<int64_t>(w.size()) == 3 * S && static_cast<int64_t>(dims.size()) == 2 * S,
              "qgemm_segs: 3 tensors and 2 dims per segment");
  std::vector<at::Tensor> keep;  // List::get returns copies: hold them while the segments point at them
  keep.reserve(3 * S);
  for (int64_t i = 0; i < 3 * S; ++i) keep.push_back(w.get(i).value_or(at::Tensor()));
  std::vector<c10::optional<at::Tensor>> wms;
  for (int64_t i = 0; i < S; ++i) wms.push_back(keep[3 * i + 2].defined() ? c10::optional<at::Tensor>(keep[3 * i + 2]) : c10::nullopt);
  std::vector<Seg> segs;
  for (int64_t i = 0; i < S; ++i) {
    Seg s = check_seg(keep[3 * i], keep[3 * i + 1], wms[i], dims[2 * i], dims[2 * i + 1], x.size(-1));
    s.wm = wms[i].has_value() ? &*wms[i] : nullptr;
    segs.push_back(s);
  }
  return qgemm_run(x, segs, impl);
}

std::string quant_isa() {
  return !have_vnni() ? "portable" : specserve_quant::amx_usable() ? "amx-int8+avx512vnni" : "avx512vnni";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("quantize_act(Tensor x, int impl=-1) -> Tensor[]", &quantize_act);
  m.def("qgemm(Tensor x, Tensor wp, Tensor wd, Tensor? wm, int n, int bits, int impl=-1) -> Tensor", &qgemm);
  m.def("qgemm_segs(Tensor x, Tensor?[] w, int[] dims, int impl=-1) -> Tensor", &qgemm_segs);
  m.def("quant_isa() -> str", &quant_isa);
}
