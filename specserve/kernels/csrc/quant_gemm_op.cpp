// The qgemm / qgemm_segs / quantize_act ops: argument checks, the path choice (portable, AVX-512-VNNI, AMX-INT8),
// activation quantization, and one parallel loop over the column tiles of every segment. Kernels: quant_gemm.cpp
// (4/8-bit codes), quant_gemm_fmt.cpp (5/6-bit and super-block formats), quant_gemm_amx.cpp. Numerics and layout:
// specserve/models/quant_ref.py.
#include "quant_gemm.h"

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
using specserve_quant::Acts;
using specserve_quant::have_vnni;
using specserve_quant::NR;
using specserve_quant::QK;

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
// Q4_K and Q6_K from this many rows: their epilogues form the block scales (Q4_K: d·sc, −(dmin·mn)) or two
// scaled half-block sums (Q6_K), so AMX ties VNNI up to M = 24 (Qwen2.5-1.5B shapes, gemm-formats-amx-kquant.json:
// Q4_K 1.07-1.18x from 32 rows; Q6_K 1.05-1.12x on down (K = 8960), 0.93-1.02x at K = 1536).
constexpr int64_t AMX_MIN_M_KQ = 32;
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
// with_lo: a fifth tensor, Σ q_a over the first 16 of each block (Q6_K's scales are per 16).
std::vector<at::Tensor> quantize_act_padded(const at::Tensor& x_, int64_t impl, int64_t pad_rows, bool with_lo = false) {
  if (impl == FROM_ENV) impl = env_impl();
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) % QK == 0, "quantize_act: x must be [M, K] with K % 32 == 0");
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, padded = (M + pad_rows - 1) / pad_rows * pad_rows;
  at::Tensor q = padded > M ? at::zeros({padded, K}, x.options().dtype(at::kChar)).narrow(0, 0, M)
                            : at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor sa = at::empty({M, nb}, x.options());
  at::Tensor sum = at::empty({M, nb}, x.options().dtype(at::kInt));
  at::Tensor lo = with_lo ? at::empty({M, nb}, x.options().dtype(at::kInt)) : at::Tensor();
  specserve_quant::quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                                 sa.data_ptr<float>(), sum.data_ptr<int32_t>(), with_lo ? lo.data_ptr<int32_t>() : nullptr,
                                 use_vnni(impl));
  if (with_lo) return {q, d, sa, sum, lo};
  return {q, d, sa, sum};
}

std::vector<at::Tensor> quantize_act(const at::Tensor& x, int64_t impl) { return quantize_act_padded(x, impl, 1); }

// Column tiles [t0, t1) of y = x·Wᵀ on the VNNI or portable path (S: the scales' type).
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
// arithmetic. AMX takes F4/F8/K4/K6 segments; the other formats run on VNNI (or portable) whatever the path.
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
  auto act = quantize_act_padded(x2, impl, amx && m_amx > AMX_CHUNK ? AMX_CHUNK : 1, k6);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  Acts a{act[0].data_ptr<int8_t>(), act[1].data_ptr<float>(), act[2].data_ptr<float>(),
         act[3].data_ptr<int32_t>(), K, nb};
  if (k6) a.lo = act[4].data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  Acts tail{a.q + m_amx * K, a.d + m_amx * nb, a.sa + m_amx * nb, a.sum + m_amx * nb, K, nb,
            a.lo ? a.lo + m_amx * nb : nullptr};
  auto one = [&](const Seg& s, auto* wdp, auto* wmp, int64_t t0, int64_t t1) {
    const uint8_t* wpp = s.wp->data_ptr<uint8_t>();
    float* ys = yp + s.col;
    const int fmt = static_cast<int>(s.fmt);
    const bool simple = fmt == specserve_quant::F4 || fmt == specserve_quant::F8;  // quant_gemm.cpp's formats
    auto vec = [&](const Acts& acts, int64_t rows, float* out) {  // the VNNI (or portable) path
      if (simple) return specserve_quant::gemm_tiles(acts, rows, wpp, wdp, wmp, fmt, vnni, out, N, s.n, t0, t1);
      specserve_quant::gemm_tiles_fmt(acts, rows, fmt, wpp, wdp, wmp, vnni, out, N, s.n, t0, t1);
    };
    const bool kq_amx = (fmt == specserve_quant::K4 || fmt == specserve_quant::K6) && (impl != AUTO || M >= AMX_MIN_M_KQ);
    if (!amx || !(simple || kq_amx)) return vec(a, M, ys);
    specserve_quant::gemm_tiles_amx(a, m_amx, wpp, wdp, wmp, fmt, ys, N, s.n, t0, t1);
    if (rest) vec(tail, rest, ys + m_amx * N);
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
