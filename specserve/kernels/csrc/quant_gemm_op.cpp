// The qgemm / qgemm_segs / quantize_act ops: argument checks, the path choice (portable, AVX2, AVX-512-VNNI, AMX-INT8),
// activation quantization, and one parallel loop over the column tiles of every segment. Kernels: quant_gemm.cpp
// (4/8-bit codes), quant_gemm_fmt.cpp (5/6-bit and super-block formats), quant_gemm_avx2.cpp (every format),
// quant_gemm_amx.cpp. Numerics and layout:
// specserve/models/quant_ref.py.
#include "quant_gemm.h"
#include "quant_gemm_grouped.h"

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
using specserve_quant::have_avx2;
using specserve_quant::have_vnni;
using specserve_quant::NR;
using specserve_quant::QK;

// impl: 0 = best available, 1 = portable, 2 = AVX-512-VNNI only, 3 = AMX-INT8 for every M, 4 = AVX2 only (tests
// and benches force a path to compare them; a forced path the CPU lacks is an error, not a silent fallback);
// -1 = from the environment, read at every call (cheap here, unlike os.environ from Python per linear):
// SPECSERVE_QUANT_IMPL = auto | portable | avx2 | vnni | amx; SPECSERVE_QUANT_PORTABLE=1 means portable.
enum Impl : int64_t { FROM_ENV = -1, AUTO = 0, PORTABLE = 1, VNNI = 2, AMX = 3, AVX2 = 4 };

int64_t env_impl() {
  const char* portable = std::getenv("SPECSERVE_QUANT_PORTABLE");
  if (portable && *portable && std::strcmp(portable, "0") != 0) return PORTABLE;
  const char* name = std::getenv("SPECSERVE_QUANT_IMPL");
  if (!name || !*name || !std::strcmp(name, "auto")) return AUTO;
  if (!std::strcmp(name, "portable")) return PORTABLE;
  if (!std::strcmp(name, "avx2")) return AVX2;
  if (!std::strcmp(name, "vnni")) return VNNI;
  if (!std::strcmp(name, "amx")) return AMX;
  TORCH_CHECK(false, "SPECSERVE_QUANT_IMPL='", name, "': choose one of auto, portable, avx2, vnni, amx");
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

// The kernels of a call's rows that AMX does not take: AVX-512-VNNI where the CPU has it, else AVX2, else portable.
enum class Vec { portable, avx2, vnni };
Vec vec_path(int64_t impl) {
  TORCH_CHECK(impl >= AUTO && impl <= AVX2, "qgemm: impl must be 0 (auto), 1 (portable), 2 (vnni), 3 (amx) or 4 (avx2)");
  TORCH_CHECK((impl != VNNI && impl != AMX) || have_vnni(), "qgemm: this CPU has no AVX-512-VNNI");
  TORCH_CHECK(impl != AVX2 || have_avx2(), "qgemm: this CPU has no AVX2");
  if (impl == PORTABLE) return Vec::portable;
  if (impl == AVX2) return Vec::avx2;
  return have_vnni() ? Vec::vnni : have_avx2() ? Vec::avx2 : Vec::portable;
}

void quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sa, int32_t* sum, int32_t* lo, Vec v) {
  if (v == Vec::avx2) return specserve_quant::quantize_rows_avx2(x, M, K, q, d, sa, sum, lo);
  specserve_quant::quantize_rows(x, M, K, q, d, sa, sum, lo, v == Vec::vnni);
}

bool use_amx(int64_t impl, int64_t M) {
  if (impl == AMX) {
    TORCH_CHECK(specserve_quant::amx_usable(), "qgemm: AMX-INT8 is not available (CPU or OS permission)");
    return true;
  }
  return impl == AUTO && M >= AMX_MIN_M && have_vnni() && specserve_quant::amx_usable();
}

// x [M, K] → (q [M, K] int8, d, sa [M, nb] float, sum [M, nb] int32): the activation quantization every path
// multiplies (make_job's bits, as tensors for tests and the Python reference).
std::vector<at::Tensor> quantize_act(const at::Tensor& x_, int64_t impl) {
  if (impl == FROM_ENV) impl = env_impl();
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) % QK == 0, "quantize_act: x must be [M, K] with K % 32 == 0");
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options());
  at::Tensor sa = at::empty({M, nb}, x.options());
  at::Tensor sum = at::empty({M, nb}, x.options().dtype(at::kInt));
  quantize(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), sa.data_ptr<float>(),
           sum.data_ptr<int32_t>(), nullptr, vec_path(impl));
  return {q, d, sa, sum};
}

// One weight (or row segment of a fused one): packed codes, scales, offsets (raw: an expert's are offsets into its
// stacked tensors, which the caller keeps alive); n columns written at column col of job's output, for the job's
// rows [r0, r0 + m) (m < 0: all of them); its column tiles are [t0, t0 + ntiles) of the parallel loop.
struct Seg {
  const uint8_t* wp; const void* wd; const void* wm; bool half; int64_t n, fmt, col, t0, ntiles, job = 0, r0 = 0, m = -1;
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
  return Seg{wp.data_ptr<uint8_t>(), wd.data_ptr(), has_m ? wm->data_ptr() : nullptr, half, n, fmt, 0, 0, ntiles};
}

// One activation matrix, quantized, and where its products go (y [M, ldy]): the input of one qgemm, or of one
// group of a grouped call. Its rows are split between AMX (the first m_amx) and VNNI (the rest) as below.
struct Job {
  at::Tensor buf;  // the quantized rows (q, d, sa, sum, lo?) in one allocation; Acts points into it
  Acts a{}, tail{};
  int64_t M = 0, m_amx = 0, rest = 0;
  bool amx = false;
  float* y = nullptr;
  int64_t ldy = 0;
};

// a's rows from r0 on
Acts rows_from(const Acts& a, int64_t r0) {
  return Acts{a.q + r0 * a.K, a.d + r0 * a.nb, a.sa + r0 * a.nb, a.sum + r0 * a.nb, a.K, a.nb, a.lo ? a.lo + r0 * a.nb : nullptr};
}

// allow_amx false: VNNI (or portable) whatever M is (a job whose segments take row ranges: AMX reads whole
// 16-row chunks). NOTE: the quantized rows are quantize_act's bits; one buffer, not five tensors, per job.
Job make_job(const at::Tensor& x2_, int64_t impl, bool k6, float* y, int64_t ldy, bool allow_amx = true) {
  Job j;
  const at::Tensor x2 = x2_.scalar_type() == at::kFloat && x2_.is_contiguous() ? x2_ : x2_.to(at::kFloat).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), nb = K / QK;
  TORCH_CHECK(x2.dim() == 2 && K % QK == 0, "qgemm: x must be [M, K] with K % 32 == 0");
  j.M = M, j.amx = allow_amx && M > 0 && use_amx(impl, M), j.y = y, j.ldy = ldy;
  // Under AUTO, up to VNNI_REST rows past the last full AMX chunk go to VNNI: cheaper than a partial chunk's
  // tile work (gate_up, M = 16 -> 17: +0.027 ms on AMX, a VNNI row 0.018). More rows: a zero-padded AMX chunk.
  j.rest = j.amx && impl == AUTO && M > AMX_CHUNK && M % AMX_CHUNK <= VNNI_REST ? M % AMX_CHUNK : 0;
  j.m_amx = M - j.rest;
  const int64_t pad = j.amx && j.m_amx > AMX_CHUNK ? AMX_CHUNK : 1, padded = (M + pad - 1) / pad * pad;
  const int64_t q_bytes = padded * K, n4 = M * nb * 4;  // K % 32 == 0: every part 4-byte aligned
  j.buf = at::empty({q_bytes + n4 * (k6 ? 4 : 3)}, x2.options().dtype(at::kByte));
  uint8_t* p = j.buf.data_ptr<uint8_t>();
  if (padded > M) std::memset(p + M * K, 0, (padded - M) * K);  // the AMX path's zero rows past M
  j.a = Acts{reinterpret_cast<int8_t*>(p), reinterpret_cast<float*>(p + q_bytes), reinterpret_cast<float*>(p + q_bytes + n4),
             reinterpret_cast<int32_t*>(p + q_bytes + 2 * n4), K, nb, k6 ? reinterpret_cast<int32_t*>(p + q_bytes + 3 * n4) : nullptr};
  Acts& a = j.a;
  quantize(x2.data_ptr<float>(), M, K, const_cast<int8_t*>(a.q), const_cast<float*>(a.d), const_cast<float*>(a.sa),
           const_cast<int32_t*>(a.sum), const_cast<int32_t*>(a.lo), vec_path(impl));
  j.tail = rows_from(a, j.m_amx);
  return j;
}

// Every segment's column tiles in one parallel loop (segment s reads jobs[s.job]'s activations, its row range, and
// writes its output). NOTE: the split over tiles (columns), and of rows between paths, never changes any
// element's arithmetic. AMX takes F4/F8/K4/K6 segments; the other formats run on
// VNNI (else AVX2, else portable) whatever the path.
void run_segs(const std::vector<Job>& jobs, std::vector<Seg>& segs, int64_t impl) {
  int64_t T = 0;
  for (Seg& s : segs) s.t0 = T, T += s.ntiles;
  const Vec v = vec_path(impl);
  const bool vnni = v == Vec::vnni;
  auto one = [&](const Seg& s, auto* wdp, auto* wmp, int64_t t0, int64_t t1) {
    const Job& j = jobs[s.job];
    float* ys = j.y + s.col;
    const int fmt = static_cast<int>(s.fmt);
    const bool simple = fmt == specserve_quant::F4 || fmt == specserve_quant::F8;  // quant_gemm.cpp's formats
    auto vec = [&](const Acts& acts, int64_t rows, float* out) {  // the VNNI, AVX2 or portable path
      if (v == Vec::avx2) return specserve_quant::gemm_tiles_avx2(acts, rows, fmt, s.wp, wdp, wmp, out, j.ldy, s.n, t0, t1);
      if (simple) return specserve_quant::gemm_tiles(acts, rows, s.wp, wdp, wmp, fmt, vnni, out, j.ldy, s.n, t0, t1);
      specserve_quant::gemm_tiles_fmt(acts, rows, fmt, s.wp, wdp, wmp, vnni, out, j.ldy, s.n, t0, t1);
    };
    if (s.m >= 0) return vec(rows_from(j.a, s.r0), s.m, ys + s.r0 * j.ldy);  // a row range: never an AMX job
    const bool kq_amx = (fmt == specserve_quant::K4 || fmt == specserve_quant::K6) && (impl != AUTO || j.M >= AMX_MIN_M_KQ);
    if (!j.amx || !(simple || kq_amx)) return vec(j.a, j.M, ys);
    specserve_quant::gemm_tiles_amx(j.a, j.m_amx, s.wp, wdp, wmp, fmt, ys, j.ldy, s.n, t0, t1);
    if (j.rest) vec(j.tail, j.rest, ys + j.m_amx * j.ldy);
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (const Seg& s : segs) {
      const int64_t lo_t = std::max(t0, s.t0) - s.t0, hi_t = std::min(t1, s.t0 + s.ntiles) - s.t0;
      if (lo_t >= hi_t) continue;
      if (s.half) one(s, static_cast<const at::Half*>(s.wd), static_cast<const at::Half*>(s.wm), lo_t, hi_t);
      else one(s, static_cast<const float*>(s.wd), static_cast<const float*>(s.wm), lo_t, hi_t);
    }
  });
}

// y[:, seg.col : seg.col + seg.n] for every segment, one activation quantization, one parallel loop.
at::Tensor qgemm_run(const at::Tensor& x, std::vector<Seg> segs, int64_t impl) {
  if (impl == FROM_ENV) impl = env_impl();
  const int64_t K = x.size(-1);
  int64_t N = 0;
  bool k6 = false;
  for (Seg& s : segs) {
    s.col = N, N += s.n;
    k6 = k6 || s.fmt == specserve_quant::K6;
  }
  const at::Tensor x2 = x.reshape({-1, K});
  at::Tensor y = at::empty({x2.size(0), N}, x.options().dtype(at::kFloat));
  std::vector<Job> jobs;
  jobs.push_back(make_job(x2, impl, k6, y.data_ptr<float>(), N));
  run_segs(jobs, segs, impl);
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
  std::vector<Seg> segs;
  for (int64_t i = 0; i < S; ++i) {
    const c10::optional<at::Tensor> wp = w.get(3 * i), wd = w.get(3 * i + 1), wm = w.get(3 * i + 2);
    TORCH_CHECK(wp && wd, "qgemm_segs: segment ", i, " has no codes or scales");
    segs.push_back(check_seg(*wp, *wd, wm, dims[2 * i], dims[2 * i + 1], x.size(-1)));  // raw pointers: w holds them
  }
  return qgemm_run(x, segs, impl);
}

// The op form of specserve_quant::qgemm_experts: w/dims the stacked projection as read_segs reads it, groups
// (expert, r0, m) triples, extra_w/extra_dims one more pair's weight (S = 0: none).
std::vector<at::Tensor> qgemm_experts_op(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& w,
                                         at::IntArrayRef dims, at::IntArrayRef groups, const at::Tensor& extra_x,
                                         const c10::List<c10::optional<at::Tensor>>& extra_w, at::IntArrayRef extra_dims,
                                         int64_t impl) {
  size_t wi = 0, di = 0, ewi = 0, edi = 0;
  const std::vector<specserve_quant::WeightSeg> stacked = specserve_quant::read_segs(w, wi, dims, di);
  const std::vector<specserve_quant::WeightSeg> extra = specserve_quant::read_segs(extra_w, ewi, extra_dims, edi);
  TORCH_CHECK(wi == w.size() && di == dims.size() && ewi == extra_w.size() && edi == extra_dims.size(),
              "qgemm_experts: weights/dims left over");
  TORCH_CHECK(groups.size() % 3 == 0, "qgemm_experts: groups are (expert, r0, m) triples");
  std::vector<specserve_quant::ExpertRows> g;
  for (size_t i = 0; i < groups.size(); i += 3) g.push_back({groups[i], groups[i + 1], groups[i + 2]});
  return specserve_quant::qgemm_experts(x, stacked, g, extra_x, extra, impl);
}

// The instruction sets the kernels can use here, best first ("portable" where none): the paths a test may force.
std::string quant_isa() {
  std::string isa = specserve_quant::amx_usable() ? "amx-int8+" : "";
  if (have_vnni()) isa += "avx512vnni+";
  if (have_avx2()) isa += "avx2+";
  return isa.empty() ? "portable" : isa.substr(0, isa.size() - 1);
}

}  // namespace

namespace specserve_quant {

std::vector<WeightSeg> read_segs(const c10::List<c10::optional<at::Tensor>>& w, size_t& wi, at::IntArrayRef dims,
                                 size_t& di) {
  TORCH_CHECK(di < dims.size(), "read_segs: dims too short");
  const int64_t S = dims[di++];
  TORCH_CHECK(S >= 0 && wi + 3 * S <= w.size() && di + 2 * S <= dims.size(), "read_segs: weights/dims do not match");
  std::vector<WeightSeg> segs;
  for (int64_t i = 0; i < S; ++i, wi += 3, di += 2)
    segs.push_back({w.get(wi).value(), w.get(wi + 1).value(), w.get(wi + 2).value_or(at::Tensor()), dims[di], dims[di + 1]});
  return segs;
}

namespace {

Seg seg_of(const WeightSeg& w, int64_t K) {
  return check_seg(w.wp, w.wd, w.wm.defined() ? c10::optional<at::Tensor>(w.wm) : c10::nullopt, w.n, w.fmt, K);
}

// One more (x, W) pair for run_segs: its job and segments appended, its output [M, Σ n] returned.
at::Tensor add_pair(std::vector<Job>& jobs, std::vector<Seg>& segs, const at::Tensor& x, const std::vector<WeightSeg>& w,
                    int64_t impl) {
  const int64_t K = x.size(-1);
  int64_t N = 0;
  bool k6 = false;
  for (const WeightSeg& ws : w) {
    Seg s = seg_of(ws, K);
    s.col = N, s.job = static_cast<int64_t>(jobs.size());
    N += ws.n, k6 = k6 || ws.fmt == K6;
    segs.push_back(s);
  }
  const at::Tensor x2 = x.reshape({-1, K});
  at::Tensor y = at::empty({x2.size(0), N}, x2.options().dtype(at::kFloat));
  jobs.push_back(make_job(x2, impl, k6, y.data_ptr<float>(), N));
  return y;
}

}  // namespace

std::vector<at::Tensor> qgemm_experts(const at::Tensor& x_, const std::vector<WeightSeg>& stacked,
                                      const std::vector<ExpertRows>& groups, const at::Tensor& extra_x,
                                      const std::vector<WeightSeg>& extra_w, int64_t impl) {
  if (impl == FROM_ENV) impl = env_impl();
  TORCH_CHECK(x_.dim() == 2 && !stacked.empty(), "qgemm_experts: x must be [M, K] and experts given");
  const at::Tensor x = x_.scalar_type() == at::kFloat && x_.is_contiguous() ? x_ : x_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), E = stacked[0].wp.size(0);
  // each stacked segment checked once, on expert 0; expert e's codes, scales and offsets lie e strides on
  struct Stride { int64_t wp, wd, wm; };
  std::vector<Seg> base;
  std::vector<Stride> strides;
  int64_t N = 0;
  bool k6 = false;
  for (const WeightSeg& w : stacked) {
    TORCH_CHECK(w.wp.dim() >= 2 && w.wp.size(0) == E && w.wd.size(0) == E && (!w.wm.defined() || w.wm.size(0) == E),
                "qgemm_experts: every segment's tensors must be stacked over the same ", E, " experts");
    Seg s = seg_of({w.wp.select(0, 0), w.wd.select(0, 0), w.wm.defined() ? w.wm.select(0, 0) : at::Tensor(), w.n, w.fmt}, K);
    TORCH_CHECK(w.wp.is_contiguous() && w.wd.is_contiguous() && (!w.wm.defined() || w.wm.is_contiguous()),
                "qgemm_experts: stacked experts must be contiguous");
    s.col = N, N += w.n, k6 = k6 || w.fmt == K6;
    base.push_back(s);
    strides.push_back({w.wp.stride(0), w.wd.stride(0) * w.wd.element_size(), w.wm.defined() ? w.wm.stride(0) * w.wm.element_size() : 0});
  }
  std::vector<at::Tensor> ys{at::empty({M, N}, x.options())};
  float* y = ys[0].data_ptr<float>();
  std::vector<Job> jobs;
  std::vector<Seg> segs;
  // groups of few rows share one quantization of x (row ranges of one job); a group AMX pays on gets its own
  const bool shared_job = std::any_of(groups.begin(), groups.end(), [&](const ExpertRows& g) { return !use_amx(impl, g.m); });
  if (shared_job) jobs.push_back(make_job(x, impl, k6, y, N, /*allow_amx=*/false));
  for (const ExpertRows& g : groups) {
    TORCH_CHECK(g.expert >= 0 && g.expert < E && g.r0 >= 0 && g.m > 0 && g.r0 + g.m <= M, "qgemm_experts: group of expert ",
                g.expert, " rows [", g.r0, ", ", g.r0 + g.m, ") out of range");
    int64_t job = 0, r0 = g.r0, m = g.m;
    if (use_amx(impl, g.m)) {
      job = static_cast<int64_t>(jobs.size()), r0 = 0, m = -1;
      jobs.push_back(make_job(x.narrow(0, g.r0, g.m), impl, k6, y + g.r0 * N, N));
    }
    for (size_t i = 0; i < base.size(); ++i) {
      Seg s = base[i];
      const Stride& st = strides[i];
      s.wp += g.expert * st.wp;
      s.wd = static_cast<const char*>(s.wd) + g.expert * st.wd;
      if (s.wm) s.wm = static_cast<const char*>(s.wm) + g.expert * st.wm;
      s.job = job, s.r0 = r0, s.m = m;
      segs.push_back(s);
    }
  }
  if (!extra_w.empty()) ys.push_back(add_pair(jobs, segs, extra_x, extra_w, impl));
  run_segs(jobs, segs, impl);
  return ys;
}

}  // namespace specserve_quant

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("quantize_act(Tensor x, int impl=-1) -> Tensor[]", &quantize_act);
  m.def("qgemm(Tensor x, Tensor wp, Tensor wd, Tensor? wm, int n, int bits, int impl=-1) -> Tensor", &qgemm);
  m.def("qgemm_segs(Tensor x, Tensor?[] w, int[] dims, int impl=-1) -> Tensor", &qgemm_segs);
  m.def("qgemm_experts(Tensor x, Tensor?[] w, int[] dims, int[] groups, Tensor extra_x, Tensor?[] extra_w, "
        "int[] extra_dims, int impl=-1) -> Tensor[]", &qgemm_experts_op);
  m.def("quant_isa() -> str", &quant_isa);
}
