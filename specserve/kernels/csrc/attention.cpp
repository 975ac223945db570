// Ragged paged attention over the packed query rows of many requests.
//
// Request b owns query rows [q_start[b], q_start[b+1]) and context entries
// [ctx_start[b], ctx_start[b+1]) of `ctx_slots` (KV pool slots, position ctx_first[b] + j).
// Each (query row, head) follows the arithmetic fixed in attention_math.h (keys in ascending order,
// 16-lane dots with a tree reduction, lane sums by position mod 16): it never depends on the batch, the
// other rows or the thread split (batch invariance), and the AVX-512 item (attention_avx512.h) and the
// portable item below give the same bits (SPECSERVE_ATTN_IMPL=portable|avx2 forces a lesser build; tests
// compare them). NOTE: only visible keys are read into sums, so a masked slot (another request's, or
// beyond a sliding window) never enters one, not even as 0·V, and no padded query row exists.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_avx512.h"
#include "attention_math.h"

namespace {
using namespace specserve_attn;

std::atomic<int64_t> g_rows{0}, g_dots{0};  // (query row, head) pairs and visible q·k products

template <typename T, typename F> SS_INLINE F dot16(const F* q, const T* k, int64_t D) {
  F lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = l < D ? q[l] * static_cast<F>(k[l]) : F(0);
  for (int64_t i = 16; i < D; ++i) lane[i & 15] = std::fma(q[i], static_cast<F>(k[i]), lane[i & 15]);
  return tree16(lane);
}

// The portable item: each (row, head) alone, in the order of attention_math.h.
template <typename T, typename C, typename F>
SS_INLINE int64_t item_portable(const Args<T, C>& a, const Rows& w, const F* qf, F* sc, F* acc,
                      const uint32_t* vis, int64_t nch, int64_t j00) {
  const int64_t D = a.D, G = w.Gn;
  int64_t dots = 0;
  auto row = [&](const C* base, int64_t j) { return base + a.slots[w.c0 + j] * a.ks0 + w.kvh * a.ks1; };
  for (int64_t i = 0; i < w.R; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const F* q = qf + (i * G + g) * D;
      F mx = -INFINITY, lane[16] = {0};
      for (int64_t ch = 0; ch < nch; ++ch)
        for (uint32_t b = vis[i * nch + ch]; b; b &= b - 1) {
          const int64_t k = 16 * ch + __builtin_ctz(b);
          sc[k] = dot16(q, row(a.kd, j00 + k), D);
          if (sc[k] > mx) mx = sc[k];
          ++dots;
        }
      std::fill(acc, acc + D, F(0));
      for (int64_t ch = 0; ch < nch; ++ch)
        for (uint32_t b = vis[i * nch + ch]; b; b &= b - 1) {
          const int64_t k = 16 * ch + __builtin_ctz(b);
          const F e = exp_poly(sc[k] - mx);
          lane[k & 15] = lane[k & 15] + e;
          const C* v = row(a.vd, j00 + k);
          for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(e, static_cast<F>(v[d]), acc[d]);
        }
      const F s = tree16(lane), inv = s > 0 ? F(1) / s : F(0);  // no visible key: zeros, never 0/0
      T* o = a.od + (w.r0 + i) * a.H * D + (w.h0 + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
    }
  return dots;
}

template <typename F> std::vector<F>& scratch() {  // per thread, grown once, reused by every call
  static thread_local std::vector<F> buf;
  return buf;
}

// Which build of the item runs: the portable C++ as is (libm fma on x86-64 without FMA), the same C++
// compiled for AVX2+FMA (auto-vectorized, fma inline), or the AVX-512 item. All three give the same bits.
enum Impl { PORTABLE, AVX2, AVX512 };

template <typename T, typename C, typename F, typename... A> int64_t item_portable_base(A... args) { return item_portable<T, C, F>(args...); }
#if defined(__x86_64__)
template <typename T, typename C, typename F, typename... A>
__attribute__((target("avx2,fma"))) int64_t item_portable_avx2(A... args) { return item_portable<T, C, F>(args...); }
#endif

Impl best_impl() {  // the CPU's best, lowered by SPECSERVE_ATTN_IMPL=portable|avx2 (read at call time: tests)
#if defined(__x86_64__)
  static const Impl cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                              ? AVX512
                          : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? AVX2
                                                                                            : PORTABLE;
#else
  static const Impl cpu = PORTABLE;
#endif
  const char* e = std::getenv("SPECSERVE_ATTN_IMPL");
  const Impl want = !e || !*e ? AVX512 : !std::strcmp(e, "portable") ? PORTABLE : !std::strcmp(e, "avx2") ? AVX2 : AVX512;
  return std::min(cpu, want);
}

struct Work { int64_t b, r0, r1, kvh, g0, g1; };  // one work item (see Rows)

template <typename T, typename C>
int64_t item(const Args<T, C>& a, const Work& wk, Impl impl) {
  using F = typename Acc<T>::type;
  const Rows w(a, wk.b, wk.r0, wk.r1, wk.kvh, wk.g0, wk.g1);
  const int64_t D = a.D, G = w.Gn, RG = w.R * G;
  // chunks of 16 keys aligned to absolute positions: lane k ≡ position mod 16, whatever the block
  const int64_t j00 = w.lo < w.hi ? w.lo - ((w.f + w.lo) & 15) : 0;
  const int64_t nch = w.lo < w.hi ? (w.hi - j00 + 15) / 16 : 0, span = 16 * nch;
  std::vector<F>& buf = scratch<F>();
  const size_t need = RG * D * 2 + RG * span + 16 * D + RB * nch;  // floats; vis bits take RB·nch
  if (buf.size() < need) buf.resize(need);
  F *qf = buf.data(), *acc = qf + RG * D, *sc = acc + RG * D, *stage = sc + RG * span;
  uint32_t* vis = reinterpret_cast<uint32_t*>(stage + 16 * D);  // sizeof(F) ≥ 4
  for (int64_t i = 0; i < w.R; ++i) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        qf[(i * G + g) * D + d] = static_cast<F>(a.qd[(w.r0 + i) * a.qs0 + (w.h0 + g) * a.qs1 + d]) * static_cast<F>(a.scale);
    for (int64_t ch = 0; ch < nch; ++ch) vis[i * nch + ch] = w.visible16(a, i, j00 + 16 * ch);
  }
#if defined(__x86_64__)
  if constexpr (std::is_same_v<F, float>)
    if (impl == AVX512 && D % 16 == 0) return item_avx512<T, C>(a, w, qf, acc, sc, stage, vis, nch, j00);
  if (impl != PORTABLE) return item_portable_avx2<T, C, F>(a, w, qf, sc, acc, vis, nch, j00);
#endif
  return item_portable_base<T, C, F>(a, w, qf, sc, acc, vis, nch, j00);
}

// Work items: per request, its rows in even blocks of at most `rb`, then per kv head, then (only when
// that leaves threads idle) halves of its query heads. Fewer rows or heads per item share fewer K/V
// reads but keep both threads of a small batch busy; no (row, head)'s arithmetic depends on the split.
std::vector<Work> plan(int64_t nreq, const int64_t* qs, int64_t KVH, int64_t G, int64_t threads) {
  auto blocks = [&](int64_t rb) {
    int64_t n = 0;
    for (int64_t b = 0; b < nreq; ++b) n += (qs[b + 1] - qs[b] + rb - 1) / rb;
    return n;
  };
  int64_t rb = RB;
  while (rb > 1 && blocks(rb) * KVH < 2 * threads) rb = (rb + 1) / 2;
  const int64_t hg = threads > 1 && blocks(rb) * KVH < 2 * threads ? (G + 1) / 2 : G;
  std::vector<Work> work;
  for (int64_t b = 0; b < nreq; ++b) {
    const int64_t n = qs[b + 1] - qs[b], nb = (n + rb - 1) / rb, per = nb ? (n + nb - 1) / nb : 0;
    for (int64_t r = qs[b]; r < qs[b + 1]; r += per)
      for (int64_t kvh = 0; kvh < KVH; ++kvh)
        for (int64_t g = 0; g < G; g += hg) work.push_back({b, r, std::min(r + per, qs[b + 1]), kvh, g, std::min(g + hg, G)});
  }
  return work;
}

template <typename T, typename C>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, int64_t nreq, const int64_t* qs,
         const int64_t* qpos, const int64_t* slots, const int64_t* cs, const int64_t* first,
         const bool* mask, const int64_t* ms, bool causal, int64_t window, double scale, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = kc.size(1), G = H / KVH;
  TORCH_CHECK(G <= 8, "paged_attention: at most 8 query heads per kv head");
  const Args<T, C> a{q.data_ptr<T>(), kc.data_ptr<C>(), vc.data_ptr<C>(), out.data_ptr<T>(), qs, qpos, slots, cs, first,
                  ms, mask, causal, window, H, D, KVH, G, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), scale};
  const Impl impl = best_impl();
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const std::vector<Work> work = plan(nreq, qs, KVH, G, threads);
  const int64_t n = static_cast<int64_t>(work.size());
  std::atomic<int64_t> next{0}, dots{0};
  // each thread takes the next item until none is left (items differ in cost: ragged rows, contexts)
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    int64_t my = 0;
    for (int64_t it; (it = next.fetch_add(1)) < n;) my += item<T, C>(a, work[it], impl);
    dots += my;
  });
  g_rows += q.size(0) * H;
  g_dots += dots.load();
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& q_start, const at::Tensor& positions, const at::Tensor& ctx_slots,
                           const at::Tensor& ctx_start, const at::Tensor& ctx_first,
                           const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& mask_start,
                           bool causal, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.stride(2) == 1, "paged_attention: q [T, H, D], cache [S, KVH, D]");
  // NOTE: any slot and head strides (the pool is head-major: each kv head's slots are contiguous), the same for K and V
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.strides() == v_cache.strides() && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: K and V pools of one layout, head dim contiguous");
  const bool bf16_pool = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || bf16_pool,
              "paged_attention: the KV pool must have q's dtype, or be bfloat16 under float32 queries");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads not a multiple of kv heads");
  // the index tensors are already contiguous int64 in the engine: no copy, no extra op then
  auto i64 = [](const at::Tensor& t) { return t.scalar_type() == at::kLong && t.is_contiguous() ? t : t.contiguous().to(at::kLong); };
  const at::Tensor qs = i64(q_start), pos = i64(positions), sl = i64(ctx_slots), cs = i64(ctx_start), fi = i64(ctx_first);
  TORCH_CHECK(qs.numel() == cs.numel() && qs.numel() == fi.numel() + 1, "paged_attention: q_start/ctx_start are [B+1]");
  TORCH_CHECK(qs.data_ptr<int64_t>()[fi.numel()] == q.size(0), "paged_attention: q_start[-1] != rows of q");
  at::Tensor m, mst;
  if (mask.has_value()) {
    m = mask->scalar_type() == at::kBool && mask->is_contiguous() ? *mask : mask->contiguous().to(at::kBool);
    mst = i64(*mask_start);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  auto go = [&](auto q_type, auto kv_type) {
    using T = decltype(q_type);
    using C = decltype(kv_type);
    run<T, C>(q, k_cache, v_cache, fi.numel(), qs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), sl.data_ptr<int64_t>(),
                  cs.data_ptr<int64_t>(), fi.data_ptr<int64_t>(), mask.has_value() ? m.data_ptr<bool>() : nullptr,
                  mask.has_value() ? mst.data_ptr<int64_t>() : nullptr, causal, window, scale, out);
  };
  if (bf16_pool) {
    go(float{}, c10::BFloat16{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] { go(scalar_t{}, scalar_t{}); });
  }
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
