// Ragged paged attention over the packed query rows of many requests.
//
// Request b owns query rows [q_start[b], q_start[b+1]) and context entries
// [ctx_start[b], ctx_start[b+1]) of `ctx_slots` (KV pool slots, position ctx_first[b] + j).
// Each (query row, head) is computed alone, keys in ascending order, with a fixed 16-lane dot
// product: its arithmetic never depends on the batch, the other rows or the thread split
// (batch invariance). NOTE: only visible keys are read, so a masked slot (another request's,
// or beyond a sliding window) never enters the sum, not even as 0·V, and no padded query row exists.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <vector>

namespace {

std::atomic<int64_t> g_rows{0}, g_dots{0};  // (query row, head) pairs and q·k products computed

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }
template <typename A> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T, typename F>
inline F dot(const F* q, const T* k, int64_t d) {
  F lane[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += q[i + l] * static_cast<F>(k[i + l]);
  for (; i < d; ++i) lane[i & 15] += q[i] * static_cast<F>(k[i]);
  F s = 0;
  for (int l = 0; l < 16; ++l) s += lane[l];
  return s;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const int64_t* qs,
         const int64_t* qpos, const int64_t* slots, const int64_t* cs, const int64_t* first,
         const bool* mask, const int64_t* ms, bool causal, int64_t window, double scale, at::Tensor& out) {
  using F = typename Acc<T>::type;
  const int64_t H = q.size(1), D = q.size(2), KVH = kc.size(1), G = H / KVH;
  const T* qd = q.data_ptr<T>();
  const T* kd = kc.data_ptr<T>();
  const T* vd = vc.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = kc.stride(0), ks1 = kc.stride(1);
  const int64_t T_rows = q.size(0);
  std::vector<int64_t> req(T_rows);  // request of each row (rows are grouped by request)
  for (int64_t b = 0, r = 0; r < T_rows; ++r) {
    while (qs[b + 1] <= r) ++b;
    req[r] = b;
  }
  std::atomic<int64_t> dots_acc{0};
  at::parallel_for(0, T_rows * KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<F> qf(G * D), sc, acc(G * D);
    int64_t my_dots = 0;
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / KVH, kvh = w % KVH, b = req[r];
      const int64_t c0 = cs[b], L = cs[b + 1] - c0, p = qpos[r], f = first[b];
      // visible range of context entries j (position f + j)
      int64_t jlo = 0, jhi = L;
      if (causal) jhi = std::min<int64_t>(L, p - f + 1);
      if (window > 0) jlo = std::max<int64_t>(0, p - window + 1 - f);
      const bool* mrow = mask ? mask + ms[b] + (r - qs[b]) * L : nullptr;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<F>(qd[r * qs0 + (kvh * G + g) * qs1 + d]) * static_cast<F>(scale);
      const int64_t n = std::max<int64_t>(jhi - jlo, 0);
      sc.assign(G * n, F(0));
      std::vector<F> mx(G, -INFINITY), sum(G, F(0));
      std::fill(acc.begin(), acc.end(), F(0));
      for (int64_t j = jlo; j < jhi; ++j) {
        if (mrow && !mrow[j]) continue;
        const T* k = kd + slots[c0 + j] * ks0 + kvh * ks1;
        for (int64_t g = 0; g < G; ++g) {
          F s = dot<T, F>(qf.data() + g * D, k, D);
          sc[g * n + (j - jlo)] = s;
          if (s > mx[g]) mx[g] = s;
        }
        my_dots += G;
      }
      for (int64_t j = jlo; j < jhi; ++j) {
        if (mrow && !mrow[j]) continue;
        const T* v = vd + slots[c0 + j] * ks0 + kvh * ks1;
        for (int64_t g = 0; g < G; ++g) {
          const F e = std::exp(sc[g * n + (j - jlo)] - mx[g]);
          sum[g] += e;
          F* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += e * static_cast<F>(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = od + r * H * D + (kvh * G + g) * D;
        const F inv = sum[g] > 0 ? F(1) / sum[g] : F(0);  // no visible key: zeros, never NaN from 0/0
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv);
      }
    }
    dots_acc += my_dots;
  });
  g_rows += T_rows * H;
  g_dots += dots_acc.load();
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& q_start, const at::Tensor& positions, const at::Tensor& ctx_slots,
                           const at::Tensor& ctx_start, const at::Tensor& ctx_first,
                           const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& mask_start,
                           bool causal, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.stride(2) == 1, "paged_attention: q [T, H, D], cache [S, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: contiguous KV pool");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention: q and cache dtypes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads not a multiple of kv heads");
  auto i64 = [](const at::Tensor& t) { return t.contiguous().to(at::kLong); };
  at::Tensor qs = i64(q_start), pos = i64(positions), sl = i64(ctx_slots), cs = i64(ctx_start), fi = i64(ctx_first);
  TORCH_CHECK(qs.numel() == cs.numel() && qs.numel() == fi.numel() + 1, "paged_attention: q_start/ctx_start are [B+1]");
  TORCH_CHECK(qs[-1].item<int64_t>() == q.size(0), "paged_attention: q_start[-1] != rows of q");
  at::Tensor m, mst;
  if (mask.has_value()) {
    m = mask->contiguous().to(at::kBool);
    mst = i64(*mask_start);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k_cache, v_cache, qs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                  cs.data_ptr<int64_t>(), fi.data_ptr<int64_t>(), mask.has_value() ? m.data_ptr<bool>() : nullptr,
                  mask.has_value() ? mst.data_ptr<int64_t>() : nullptr, causal, window, scale, out);
  });
  return out;
}

std::vector<int64_t> attention_counters(bool reset) {
  std::vector<int64_t> r{g_rows.load(), g_dots.load()};
  if (reset) g_rows = 0, g_dots = 0;
  return r;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_start, Tensor positions, "
        "Tensor ctx_slots, Tensor ctx_start, Tensor ctx_first, Tensor? mask, Tensor? mask_start, "
        "bool causal, int window, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.def("attention_counters(bool reset) -> int[]", &attention_counters);
}
