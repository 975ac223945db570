// A mixture-of-experts MLP as one op (models/moe.py, MoEDecoderLayer._moe, on block-quantized experts stacked as
// llama.cpp stacks `ffn_*_exps`): router logits (router_logits: row-invariant), softmax in fp32 → top-k (at::topk,
// as the reference breaks ties) → renormalised; each touched expert's rows gathered, every expert's gate|up in
// one grouped GEMM, silu_mul once over all of them, every down projection in a second grouped GEMM; each token's
// k outputs scaled and summed in its top-k order; qwen2_moe's shared expert (its own groups in the same two
// GEMMs) added, scaled by sigmoid of its gate logit.
// NOTE: the same operations as the Python path in the same order (models/moe.py `_experts`, `_combine`), so the
// same bits; a token's result never depends on what else is in its batch. Untouched experts are never read.
#include "moe.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>

namespace specserve_moe {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

std::vector<WeightSeg> expert(const std::vector<WeightSeg>& stacked, int64_t e) {
  std::vector<WeightSeg> out;
  for (const WeightSeg& s : stacked)
    out.push_back({s.wp.select(0, e), s.wd.select(0, e), s.wm.defined() ? s.wm.select(0, e) : at::Tensor(), s.n, s.fmt});
  return out;
}

}  // namespace

MoEWeights read_weights(const at::Tensor& router, int64_t top_k, bool norm,
                        const c10::List<c10::optional<at::Tensor>>& w, size_t& wi, at::IntArrayRef dims, size_t& di) {
  MoEWeights m;
  m.router = router, m.top_k = top_k, m.norm = norm;
  using specserve_quant::read_segs;
  m.shared_gate_up = read_segs(w, wi, dims, di);
  m.shared_down = read_segs(w, wi, dims, di);
  m.gate_up = read_segs(w, wi, dims, di);
  m.down = read_segs(w, wi, dims, di);
  return m;
}

std::pair<at::Tensor, at::Tensor> moe_forward(const at::Tensor& h, const MoEWeights& m, int64_t impl) {
  using RouterSig = at::Tensor(const at::Tensor&, const at::Tensor&);
  using SiluSig = at::Tensor(const at::Tensor&);
  static const auto router_logits = op<RouterSig>("specserve::router_logits");
  static const auto silu_mul = op<SiluSig>("specserve::silu_mul");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "moe: h must be [T, H] float32");
  TORCH_CHECK(!m.gate_up.empty() && !m.down.empty(), "moe: no expert weights");
  const int64_t T = h.size(0), H = h.size(1), E = m.gate_up[0].wp.size(0), k = m.top_k;
  const bool shared = !m.shared_gate_up.empty();
  TORCH_CHECK(m.router.size(0) == E + (shared ? 1 : 0) && k > 0 && k <= E, "moe: router rows, experts, top_k disagree");
  const at::Tensor x = h.contiguous();
  const at::Tensor logits = router_logits.call(x, m.router);
  auto [weights, experts] = at::topk(at::softmax(logits.narrow(1, 0, E), -1, at::kFloat), k, -1);
  if (m.norm) weights = weights / weights.sum(-1, true);
  weights = weights.contiguous();
  experts = experts.contiguous();
  // slots (t, j) grouped by expert, tokens ascending within one (models/moe.py: a stable argsort)
  const int64_t* ex = experts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> slots(E);
  for (int64_t s = 0; s < T * k; ++s) slots[ex[s]].push_back(s);
  std::vector<int64_t> touched, row_of(T * k), group_of(T * k);
  std::vector<at::Tensor> xs;
  std::vector<std::vector<WeightSeg>> gu_w, down_w;
  for (int64_t e = 0; e < E; ++e) {
    const auto& sl = slots[e];
    if (sl.empty()) continue;
    at::Tensor rows;
    if (sl.size() == 1) {
      rows = x.narrow(0, sl[0] / k, 1);
    } else {
      std::vector<int64_t> idx;
      for (int64_t s : sl) idx.push_back(s / k);
      rows = x.index_select(0, at::tensor(idx, at::kLong));
    }
    for (size_t r = 0; r < sl.size(); ++r) row_of[sl[r]] = static_cast<int64_t>(r), group_of[sl[r]] = static_cast<int64_t>(xs.size());
    xs.push_back(rows);
    gu_w.push_back(expert(m.gate_up, e));
    down_w.push_back(expert(m.down, e));
    touched.push_back(e);
  }
  const size_t G = xs.size();
  if (shared) {  // one more group on every row
    xs.push_back(x);
    gu_w.push_back(m.shared_gate_up);
    down_w.push_back(m.shared_down);
  }
  std::vector<at::Tensor> acts = specserve_quant::qgemm_grouped(xs, gu_w, impl);
  for (at::Tensor& a : acts) a = silu_mul.call(a);  // row-wise: one call per group keeps each group contiguous
  const std::vector<at::Tensor> ys = specserve_quant::qgemm_grouped(acts, down_w, impl);
  // out[t] = Σ_j weights[t, j] · y(t, j), in top-k order; NOTE: a product rounded, then a sum rounded (no FMA:
  // -ffp-contract=off), as torch's mul and add in models/moe.py's `_combine`
  at::Tensor out = at::empty({T, H}, x.options());
  float* o = out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const float* y = ys[group_of[s]].data_ptr<float>() + row_of[s] * H;
      const float wt = w[s];
      float* ot = o + t * H;
      if (j == 0) for (int64_t i = 0; i < H; ++i) ot[i] = y[i] * wt;
      else for (int64_t i = 0; i < H; ++i) ot[i] = ot[i] + y[i] * wt;
    }
  }
  if (shared) out = out + at::sigmoid(logits.narrow(1, E, 1)) * ys[G];
  return {out, at::tensor(touched, at::kLong)};
}

namespace {

// w / dims: as read_weights reads them.
std::tuple<at::Tensor, at::Tensor> moe_mlp(const at::Tensor& h, const at::Tensor& router_w,
                                           const c10::List<c10::optional<at::Tensor>>& w, at::IntArrayRef dims,
                                           int64_t top_k, bool norm, int64_t impl) {
  size_t wi = 0, di = 0;
  const MoEWeights m = read_weights(router_w, top_k, norm, w, wi, dims, di);
  TORCH_CHECK(wi == w.size() && di == dims.size(), "moe_mlp: weights/dims left over");
  auto [out, touched] = moe_forward(h, m, impl);
  return {out, touched};
}

}  // namespace
}  // namespace specserve_moe

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("moe_mlp(Tensor h, Tensor router_w, Tensor?[] w, int[] dims, int top_k, bool norm, int impl=-1) "
        "-> (Tensor, Tensor)");
  m.impl("moe_mlp", c10::DispatchKey::CPU, &specserve_moe::moe_mlp);
}
