// A mixture-of-experts MLP as one op (models/moe.py, MoEDecoderLayer._moe, on block-quantized experts stacked as
// llama.cpp stacks `ffn_*_exps`): router logits (router_logits: row-invariant), softmax in fp32 → top-k (at::topk,
// as the reference breaks ties) → renormalised; the rows sorted by expert, every touched expert's gate|up on its
// rows in one parallel loop (quant_gemm_op.cpp qgemm_experts: one activation quantization for all), silu_mul once
// over all of them, every down projection in a second loop; each token's k outputs scaled and summed in its top-k
// order; qwen2_moe's shared expert (one more pair in the same two loops) added, scaled by sigmoid of its gate logit.
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
  // slots s = (t, j) sorted by expert, tokens ascending within one (models/moe.py: a stable argsort): slot s's
  // row is pos[s] of the expert-sorted rows
  const int64_t* ex = experts.data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0), pos(T * k), token(T * k);
  for (int64_t s = 0; s < T * k; ++s) {
    TORCH_CHECK(ex[s] >= 0 && ex[s] < E, "moe: expert index out of range");
    ++count[ex[s]];
  }
  std::vector<int64_t> start(E, 0), touched;
  std::vector<specserve_quant::ExpertRows> groups;
  for (int64_t e = 0, r = 0; e < E; r += count[e++]) {
    start[e] = r;
    if (count[e]) touched.push_back(e), groups.push_back({e, r, count[e]});
  }
  for (int64_t s = 0; s < T * k; ++s) pos[s] = start[ex[s]]++, token[pos[s]] = s / k;
  const at::Tensor rows = T == 1 ? x.expand({k, H}).contiguous()
                                 : x.index_select(0, at::from_blob(token.data(), {T * k}, at::kLong));
  const at::Tensor none;
  const std::vector<at::Tensor> gu = specserve_quant::qgemm_experts(rows, m.gate_up, groups, x, m.shared_gate_up, impl);
  const at::Tensor act_shared = shared ? silu_mul.call(gu[1]) : none;  // row-wise: one call over every group
  const std::vector<at::Tensor> dn = specserve_quant::qgemm_experts(silu_mul.call(gu[0]), m.down, groups, act_shared,
                                                                    m.shared_down, impl);
  // out[t] = Σ_j weights[t, j] · y(t, j), in top-k order; NOTE: a product rounded, then a sum rounded (no FMA:
  // -ffp-contract=off), as torch's mul and add in models/moe.py's `_combine`
  at::Tensor out = at::empty({T, H}, x.options());
  float* o = out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const float* ys = dn[0].data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const float* y = ys + pos[s] * H;
      const float wt = w[s];
      float* ot = o + t * H;
      if (j == 0) for (int64_t i = 0; i < H; ++i) ot[i] = y[i] * wt;
      else for (int64_t i = 0; i < H; ++i) ot[i] = ot[i] + y[i] * wt;
    }
  }
  if (shared) out = out + at::sigmoid(logits.narrow(1, E, 1)) * dn[1];
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
