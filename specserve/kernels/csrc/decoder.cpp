// The lean layer loop in C++: every decoder layer of a Llama-family target whose projections are block-quantized
// (w4a8 / w8a8), as one op. The Python loop (models/llama.py, LlamaModel._forward_fused) calls the same ops in
// the same order, so results are bit-identical; what goes away is the interpreter between them (~60 Python-level
// calls per layer, about a third of a SmolLM2 decode step).
//
// Per layer: qkv = qgemm(h) [+ qkv_bias]; rope_kv_write; paged_attention; x += qgemm(o); h = add_rms_norm(x, ·);
// out = qgemm(silu_mul(qgemm(h))), or a mixture-of-experts layer's MLP (moe.cpp, models/moe.py); then the next
// layer's input norm fused with the residual add (the last layer adds `out` to x and leaves the final norm to the
// caller).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <optional>
#include <vector>

#include "moe.h"

namespace {

// Per layer, weights: qkv, o as (codes, scales, offsets?) per row segment, then input_norm, post_norm, qkv_bias?
// (Qwen2), q_norm?, k_norm? (Qwen3, OLMoE), router? (an MoE layer's), then the MLP: gate_up, down; an MoE layer:
// the shared expert's gate_up and down (no segments: none), then the experts' gate_up and down stacked [E, …].
// dims: per projection the segment count S, then (n, fmt) per segment (a fused q|k|v may mix formats: Q4_K | Q6_K);
// after o's, whether q/k are normed over the whole projection (OLMoE) rather than per head; an MoE layer's
// (top_k, norm) before its MLP projections.
constexpr int64_t PROJ = 4;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using QgemmSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            int64_t, int64_t, int64_t);
using AttnSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                           const c10::optional<at::Tensor>&, bool, int64_t, double);
using RopeSig = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using AddNormSig = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluSig = at::Tensor(const at::Tensor&);
using SegsSig = at::Tensor(const at::Tensor&, const c10::List<c10::optional<at::Tensor>>&, at::IntArrayRef, int64_t);

struct Proj {  // one projection: its segments' tensors and (n, fmt) pairs
  c10::List<c10::optional<at::Tensor>> w;
  std::vector<int64_t> dims;
};
struct Layer {
  Proj p[PROJ];  // qkv, o, gate_up, down (an MoE layer: qkv, o only)
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> qkv_bias, q_norm, k_norm;
  bool qk_whole = false;
  std::optional<specserve_moe::MoEWeights> moe;
};

// x: the residual stream [T, H] (updated in place); h = input_norm_0(x). weights, dims: per layer as above, then
// dims (heads, kv_heads, head_dim). Returns the hidden states after the layers in `capture` (copies: x keeps changing),
// then per MoE layer the experts it ran.
std::vector<at::Tensor> decoder_layers(at::Tensor& x, const at::Tensor& h0, const c10::List<c10::optional<at::Tensor>>& weights,
                                       at::IntArrayRef dims, const at::Tensor& cos, const at::Tensor& sin,
                                       const at::Tensor& positions, const at::Tensor& slot_mapping,
                                       at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& q_start,
                                       const at::Tensor& ctx_slots, const at::Tensor& ctx_start,
                                       const at::Tensor& ctx_first, const c10::optional<at::Tensor>& mask,
                                       const c10::optional<at::Tensor>& mask_start, bool causal, int64_t window,
                                       double scale, double eps, at::IntArrayRef capture) {
  static const auto qgemm = op<QgemmSig>("specserve::qgemm");
  static const auto qgemm_segs = op<SegsSig>("specserve::qgemm_segs");
  static const auto attention = op<AttnSig>("specserve::paged_attention");
  static const auto rope_kv_write = op<RopeSig>("specserve::rope_kv_write");
  static const auto add_rms_norm = op<AddNormSig>("specserve::add_rms_norm");
  static const auto silu_mul = op<SiluSig>("specserve::silu_mul");
  const int64_t L = static_cast<int64_t>(k_caches.size()), nw = static_cast<int64_t>(weights.size());
  const int64_t nd = static_cast<int64_t>(dims.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && nd >= 3, "decoder_layers: ", L, " layers, bad dims");
  std::vector<Layer> layers(L);
  int64_t wi = 0, di = 0;
  auto read_proj = [&](Proj& p) {
    TORCH_CHECK(di < nd - 3, "decoder_layers: dims too short");
    const int64_t S = dims[di++];
    TORCH_CHECK(S > 0 && wi + 3 * S <= nw && di + 2 * S <= nd - 3, "decoder_layers: weights/dims do not match");
    for (int64_t j = 0; j < 3 * S; ++j) p.w.push_back(weights.get(wi++));
    p.dims.assign(dims.begin() + di, dims.begin() + di + 2 * S);
    di += 2 * S;
  };
  const at::IntArrayRef layer_dims = dims.slice(0, nd - 3);
  for (Layer& l : layers) {
    read_proj(l.p[0]);
    read_proj(l.p[1]);
    TORCH_CHECK(wi + 6 <= nw && di < nd - 3, "decoder_layers: weights or dims too short");
    l.qk_whole = dims[di++] != 0;
    l.input_norm = weights.get(wi++).value();
    l.post_norm = weights.get(wi++).value();
    l.qkv_bias = weights.get(wi++);
    l.q_norm = weights.get(wi++);
    l.k_norm = weights.get(wi++);
    const c10::optional<at::Tensor> router = weights.get(wi++);
    if (!router) {
      read_proj(l.p[2]);
      read_proj(l.p[3]);
      continue;
    }
    TORCH_CHECK(di + 2 <= nd - 3, "decoder_layers: dims too short");
    size_t w = static_cast<size_t>(wi), d = static_cast<size_t>(di + 2);
    l.moe = specserve_moe::read_weights(*router, dims[di], dims[di + 1] != 0, weights, w, layer_dims, d);
    wi = static_cast<int64_t>(w), di = static_cast<int64_t>(d);
  }
  TORCH_CHECK(wi == nw && di == nd - 3, "decoder_layers: ", L, " layers do not use all weights and dims");
  const int64_t nq = dims[nd - 3], nkv = dims[nd - 2], hd = dims[nd - 1], T = x.size(0);
  auto linear = [&](const at::Tensor& in, int64_t layer, int j) {
    const Proj& p = layers[layer].p[j];
    if (p.dims.size() == 2) return qgemm.call(in, p.w.get(0).value(), p.w.get(1).value(), p.w.get(2), p.dims[0], p.dims[1], -1);
    return qgemm_segs.call(in, p.w, p.dims, -1);
  };
  std::vector<at::Tensor> captured, touched;
  at::Tensor h = h0;
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor qkv = linear(h, i, 0);
    if (layers[i].qkv_bias) qkv = qkv + *layers[i].qkv_bias;  // as quant.py's linear(x, w, bias): y + bias
    const auto parts = qkv.split_with_sizes({nq * hd, nkv * hd, nkv * hd}, -1);
    at::Tensor q = parts[0], k = parts[1];
    const Layer& l = layers[i];
    if (l.q_norm && l.qk_whole) {  // as models/llama.py `_qkv`: rms_norm over the projection, then per head
      q = at::rms_norm(q, {nq * hd}, *l.q_norm, eps);
      k = at::rms_norm(k, {nkv * hd}, *l.k_norm, eps);
    }
    q = q.reshape({T, nq, hd}), k = k.reshape({T, nkv, hd});
    const at::Tensor v = parts[2].view({T, nkv, hd});
    if (l.q_norm && !l.qk_whole) {
      q = at::rms_norm(q, {hd}, *l.q_norm, eps);
      k = at::rms_norm(k, {hd}, *l.k_norm, eps);
    }
    at::Tensor kc = k_caches[i], vc = v_caches[i];
    rope_kv_write.call(q, k, v, cos, sin, positions, kc, vc, slot_mapping);
    const at::Tensor o = linear(attention.call(q, kc, vc, q_start, positions, ctx_slots, ctx_start, ctx_first, mask,
                                               mask_start, causal, window, scale), i, 1);
    h = add_rms_norm.call(x, o, layers[i].post_norm, eps);
    at::Tensor out;
    if (layers[i].moe) {
      auto [y, ran] = specserve_moe::moe_forward(h, *layers[i].moe);
      out = y;
      touched.push_back(ran);
    } else {
      out = linear(silu_mul.call(linear(h, i, 2)), i, 3);
    }
    if (i + 1 < L) h = add_rms_norm.call(x, out, layers[i + 1].input_norm, eps);
    else x.add_(out);
    if (std::find(capture.begin(), capture.end(), i) != capture.end()) captured.push_back(x.clone());
  }
  captured.insert(captured.end(), touched.begin(), touched.end());
  return captured;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("decoder_layers(Tensor(a!) x, Tensor h, Tensor?[] weights, int[] dims, Tensor cos, Tensor sin, "
        "Tensor positions, Tensor slot_mapping, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor q_start, "
        "Tensor ctx_slots, Tensor ctx_start, Tensor ctx_first, Tensor? mask, Tensor? mask_start, bool causal, "
        "int window, float scale, float eps, int[] capture) -> Tensor[]");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
}
