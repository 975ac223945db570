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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

std::atomic<int64_t> g_rows{0}, g_dots{0};  // (query row, head) pairs and q·k products computed

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }
template <typename A> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

#define SS_INLINE inline __attribute__((always_inline))

template <typename T, typename F>
SS_INLINE F dot(const F* q, const T* k, int64_t d) {
  F lane[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += q[i + l] * static_cast<F>(k[i + l]);
  for (; i < d; ++i) lane[i & 15] += q[i] * static_cast<F>(k[i]);
  F s = 0;
  for (int l = 0; l < 16; ++l) s += lane[l];
  return s;
}

constexpr int64_t RB = 8;  // query rows of one request that share each K/V read

template <typename T> struct Args {
  const T *qd, *kd, *vd;
  T* od;
  const int64_t *qs, *qpos, *slots, *cs, *first, *ms;
  const bool* mask;
  bool causal;
  int64_t window, H, D, KVH, G, qs0, qs1, ks0, ks1;
  double scale;
};

// Rows [r0, r1) of request b, kv head kvh. NOTE: every (row, head) keeps its own max/sum/acc and sees
// keys in ascending order through the same 16-lane dot: sharing a key's read between rows changes no
// row's arithmetic, so the result is the one the row gets alone (batch- and window-invariant).
template <typename T, typename F>
SS_INLINE int64_t item(const Args<T>& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, F* qf, F* sc, F* acc) {
  const int64_t D = a.D, G = a.G, c0 = a.cs[b], L = a.cs[b + 1] - c0, f = a.first[b], R = r1 - r0;
  int64_t jlo[RB], jhi[RB], lo = L, hi = 0, dots = 0;
  F mx[RB * 8], sum[RB * 8];
  for (int64_t i = 0; i < R; ++i) {
    const int64_t p = a.qpos[r0 + i];
    jlo[i] = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1 - f) : 0;
    jhi[i] = a.causal ? std::min<int64_t>(L, p - f + 1) : L;
    lo = std::min(lo, jlo[i]);
    hi = std::max(hi, jhi[i]);
    for (int64_t g = 0; g < G; ++g) {
      mx[i * G + g] = -INFINITY, sum[i * G + g] = F(0);
      for (int64_t d = 0; d < D; ++d)
        qf[(i * G + g) * D + d] = static_cast<F>(a.qd[(r0 + i) * a.qs0 + (kvh * G + g) * a.qs1 + d]) * static_cast<F>(a.scale);
    }
  }
  const int64_t n = std::max<int64_t>(hi - lo, 0);
  auto visible = [&](int64_t i, int64_t j) {
    return j >= jlo[i] && j < jhi[i] && (!a.mask || a.mask[a.ms[b] + (r0 + i - a.qs[b]) * L + j]);
  };
  for (int64_t j = lo; j < hi; ++j) {
    const T* k = a.kd + a.slots[c0 + j] * a.ks0 + kvh * a.ks1;
    for (int64_t i = 0; i < R; ++i) {
      if (!visible(i, j)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const F s = dot<T, F>(qf + (i * G + g) * D, k, D);
        sc[(i * G + g) * n + (j - lo)] = s;
        if (s > mx[i * G + g]) mx[i * G + g] = s;
      }
      dots += G;
    }
  }
  std::fill(acc, acc + R * G * D, F(0));
  for (int64_t j = lo; j < hi; ++j) {
    const T* v = a.vd + a.slots[c0 + j] * a.ks0 + kvh * a.ks1;
    for (int64_t i = 0; i < R; ++i) {
      if (!visible(i, j)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rg = i * G + g;
        const F e = std::exp(sc[rg * n + (j - lo)] - mx[rg]);
        sum[rg] += e;
        F* ac = acc + rg * D;
        for (int64_t d = 0; d < D; ++d) ac[d] += e * static_cast<F>(v[d]);
      }
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rg = i * G + g;
      T* o = a.od + (r0 + i) * a.H * D + (kvh * G + g) * D;
      const F inv = sum[rg] > 0 ? F(1) / sum[rg] : F(0);  // no visible key: zeros, never NaN from 0/0
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[rg * D + d] * inv);
    }
  return dots;
}

// The same item compiled for AVX-512 (chosen at run time): -ffp-contract=off and the fixed 16 lanes keep
// every sum in the same order, so both builds give bit-identical results.
#if defined(__x86_64__)
template <typename T, typename F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t item_avx512(
    const Args<T>& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, F* qf, F* sc, F* acc) {
  return item<T, F>(a, b, kvh, r0, r1, qf, sc, acc);
}
#endif
template <typename T, typename F>
int64_t item_default(const Args<T>& a, int64_t b, int64_t kvh, int64_t r0, int64_t r1, F* qf, F* sc, F* acc) {
  return item<T, F>(a, b, kvh, r0, r1, qf, sc, acc);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, int64_t nreq, const int64_t* qs,
         const int64_t* qpos, const int64_t* slots, const int64_t* cs, const int64_t* first,
         const bool* mask, const int64_t* ms, bool causal, int64_t window, double scale, at::Tensor& out) {
  using F = typename Acc<T>::type;
  const int64_t H = q.size(1), D = q.size(2), KVH = kc.size(1), G = H / KVH;
  TORCH_CHECK(G <= 8, "paged_attention: at most 8 query heads per kv head");
  const Args<T> a{q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), out.data_ptr<T>(), qs, qpos, slots, cs, first,
                  ms, mask, causal, window, H, D, KVH, G, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), scale};
  // work items: (request, block of up to RB of its rows), then kv head
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (request, first row)
  int64_t L_max = 0;
  for (int64_t b = 0; b < nreq; ++b) {
    for (int64_t r = qs[b]; r < qs[b + 1]; r += RB) blocks.emplace_back(b, r);
    L_max = std::max<int64_t>(L_max, cs[b + 1] - cs[b]);
  }
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  auto fn = avx512 ? &item_avx512<T, F> : &item_default<T, F>;
#else
  auto fn = &item_default<T, F>;
#endif
  std::atomic<int64_t> dots_acc{0};
  const int64_t nitems = static_cast<int64_t>(blocks.size()) * KVH;
  at::parallel_for(0, nitems, 1, [&](int64_t lo, int64_t hi) {
    std::vector<F> qf(RB * G * D), sc(RB * G * std::max<int64_t>(L_max, 1)), acc(RB * G * D);
    int64_t my_dots = 0;
    for (int64_t w = lo; w < hi; ++w) {
      const auto [b, r0] = blocks[w / KVH];
      my_dots += fn(a, b, w % KVH, r0, std::min<int64_t>(r0 + RB, qs[b + 1]), qf.data(), sc.data(), acc.data());
    }
    dots_acc += my_dots;
  });
  g_rows += q.size(0) * H;
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
    run<scalar_t>(q, k_cache, v_cache, fi.numel(), qs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
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
