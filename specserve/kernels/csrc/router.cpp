// A mixture-of-experts router's logits, x [T, H] · w [E, H]ᵀ in fp32, each logit one dot product summed in a
// fixed order (8 interleaved partial sums over H, then combined 0..7, then the tail). torch's F.linear picks its
// blocking from T, so a row's logits change in the last bits with the batch it is in, and a routing weight (or,
// at a tie, the expert) with them; this is what keeps a token's route, like the integer GEMMs, independent of its
// batch. NOTE: row-invariant by construction: (t, e) reads only row t of x and row e of w, in an order set by H.
#include <torch/library.h>
#include <torch/torch.h>

namespace {

float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (int64_t i = n8; i < n; ++i) s += a[i] * b[i];
  return s;
}

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "router_logits: x [T, H], w [E, H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "router_logits: float32 only");
  const auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), E = wc.size(0), H = xc.size(1);
  auto out = at::empty({T, E}, xc.options());
  const float *px = xc.data_ptr<float>(), *pw = wc.data_ptr<float>();
  float* po = out.data_ptr<float>();
#pragma omp parallel for collapse(2) if (T * E * H > (1 << 16))
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) po[t * E + e] = dot(px + t * H, pw + e * H, H);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("router_logits(Tensor x, Tensor w) -> Tensor");
  m.impl("router_logits", c10::DispatchKey::CPU, &router_logits);
}
