// Fused elementwise steps of the decoder layer: one op (one dispatch) where the pure-torch layer
// takes several. Each row is computed alone in a fixed order (batch invariance); bf16 rounds at the
// same points as the torch reference (RoPE is bit-identical to it in every dtype).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "attention_avx512.h"
#include "attention_math.h"

namespace {

template <typename T> using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t n, double eps) {
  using F = Acc<T>;
  F lane[16] = {0};
  for (int64_t i = 0; i < n; ++i) {
    const F v = static_cast<F>(x[i]);
    lane[i & 15] += v * v;
  }
  F ss = 0;
  for (int l = 0; l < 16; ++l) ss += lane[l];
  const F r = F(1) / std::sqrt(ss / static_cast<F>(n) + static_cast<F>(eps));
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(static_cast<F>(x[i]) * r * static_cast<F>(w[i]));
}

// y = rms_norm(x) * w over the last dim of a [T, n] tensor.
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  at::Tensor x = x_.contiguous(), w = w_.contiguous(), y = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xd = x.data_ptr<scalar_t>(), *wd = w.data_ptr<scalar_t>();
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) norm_row(xd + r * n, wd, yd + r * n, n, eps);
    });
  });
  return y;
}

// x += delta (in place: the residual stream), then return rms_norm(x) * w.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta_, const at::Tensor& w_, double eps) {
  TORCH_CHECK(x.is_contiguous(), "add_rms_norm: residual must be contiguous");
  at::Tensor d = delta_.contiguous(), w = w_.contiguous(), y = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    using F = Acc<scalar_t>;
    scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t *dd = d.data_ptr<scalar_t>(), *wd = w.data_ptr<scalar_t>();
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        scalar_t* xr = xd + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = static_cast<scalar_t>(static_cast<F>(xr[i]) + static_cast<F>(dd[r * n + i]));
        norm_row(xr, wd, yd + r * n, n, eps);
      }
    });
  });
  return y;
}

// silu(x) = x·σ(x) in float with e = exp(−|x|) ≤ 1 (the attention kernels' exp_poly: defined for x ≤ 0,
// ≈1 ulp, and lane-wise bit-identical as exp16): x/(1 + e) for x ≥ 0, x·e/(1 + e) below. NaN stays NaN.
SS_INLINE float silu_f(float x) {
  const float e = specserve_attn::exp_poly(-std::fabs(x)), d = 1.0f + e;
  return x >= 0.0f ? x / d : (x * e) / d;
}

SS_INLINE void silu_mul_loop(const float* g, float* y, int64_t a, int64_t b, int64_t I) {
  for (int64_t r = a; r < b; ++r)
    for (int64_t i = 0; i < I; ++i) y[r * I + i] = silu_f(g[r * 2 * I + i]) * g[r * 2 * I + I + i];
}
void silu_mul_rows(const float* g, float* y, int64_t a, int64_t b, int64_t I) { silu_mul_loop(g, y, a, b, I); }
#if defined(__x86_64__)
// The same loop built for AVX2 + FMA (CPUs without AVX-512): exp_poly's fma is one instruction instead of a libm
// call, and lanes round as the scalar form does (no contraction: -ffp-contract=off), so the bits are the same.
__attribute__((target("avx2,fma"))) void silu_mul_rows_avx2(const float* g, float* y, int64_t a, int64_t b, int64_t I) {
  silu_mul_loop(g, y, a, b, I);
}
#endif

#if defined(__x86_64__)
// The same operations 16 lanes at a time (NOTE: mul, div, fma, max and sign flips round like their scalar
// forms, so rows match silu_mul_rows bit for bit). Prefill spends ~13 % of its time here with std::exp.
SS_AVX512 void silu_mul_rows_avx512(const float* g, float* y, int64_t a, int64_t b, int64_t I) {
  using namespace specserve_attn;
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t r = a; r < b; ++r)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = I - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(m, g + r * 2 * I + i), u = _mm512_maskz_loadu_ps(m, g + r * 2 * I + I + i);
      const __m512 neg = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));  // −|x|
      const __m512 e = exp16(neg), d = _mm512_add_ps(c(1.0f), e);
      const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
      const __m512 num = _mm512_mask_mul_ps(x, static_cast<__mmask16>(~pos), x, e);  // x where x ≥ 0, else x·e
      _mm512_mask_storeu_ps(y + r * I + i, m, _mm512_mul_ps(_mm512_div_ps(num, d), u));
    }
}
#endif

// silu(gate) * up for gate_up = [gate | up] of shape [T, 2I] → [T, I].
at::Tensor silu_mul(const at::Tensor& gu_) {
  at::Tensor gu = gu_.contiguous();
  const int64_t I = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(2 * I, 1);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  at::Tensor y = at::empty(sizes, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    const float* g = gu.data_ptr<float>();
    float* yd = y.data_ptr<float>();
#if defined(__x86_64__)
    static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const char* impl = std::getenv("SPECSERVE_ATTN_IMPL");  // portable|avx2 also lower this op (tests)
    if (avx512 && !(impl && *impl && std::strcmp(impl, "auto") != 0)) {
      at::parallel_for(0, rows, 4, [&](int64_t a, int64_t b) { silu_mul_rows_avx512(g, yd, a, b, I); });
      return y;
    }
    static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && !(impl && !std::strcmp(impl, "portable"))) {
      at::parallel_for(0, rows, 4, [&](int64_t a, int64_t b) { silu_mul_rows_avx2(g, yd, a, b, I); });
      return y;
    }
#endif
    at::parallel_for(0, rows, 4, [&](int64_t a, int64_t b) { silu_mul_rows(g, yd, a, b, I); });
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {  // bf16, fp64 (float: above)
    using F = Acc<scalar_t>;
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* yd = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r)
        for (int64_t i = 0; i < I; ++i) {
          const F x = static_cast<F>(g[r * 2 * I + i]);
          const scalar_t s = static_cast<scalar_t>(x / (F(1) + std::exp(-x)));
          yd[r * I + i] = static_cast<scalar_t>(static_cast<F>(s) * static_cast<F>(g[r * 2 * I + I + i]));
        }
    });
  });
  return y;
}

// Rotate-half RoPE of q (in place) and k, and write k, v into the KV pool at `slots`:
// x·cos + rotate_half(x)·sin, rounded like the reference (each product, then the sum, in T). A bfloat16 pool
// under float32 q/k/v stores each value rounded to nearest even, as torch's .to(torch.bfloat16).
void rope_kv_write(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots_) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rope_kv_write: head dim must be contiguous");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rope_kv_write: contiguous tables, pool head dim contiguous");
  const bool same = k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type();
  TORCH_CHECK(same || (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16 &&
                       v_cache.scalar_type() == at::kBFloat16),
              "rope_kv_write: the KV pool must have q's dtype, or be bfloat16 under float32 q");
  at::Tensor pos = positions.contiguous().to(at::kLong), slots = slots_.contiguous().to(at::kLong);
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), h2 = D / 2;
  const int64_t kc0 = k_cache.stride(0), kc1 = k_cache.stride(1), vc0 = v_cache.stride(0), vc1 = v_cache.stride(1);
  TORCH_CHECK(D <= 1024 && D % 2 == 0, "rope_kv_write: head dim must be even and <= 1024");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rope_kv_write", [&] {
    using S = scalar_t;
    using F = Acc<S>;
    S* qd = q.data_ptr<S>();
    const S *kd = k.data_ptr<S>(), *vd = v.data_ptr<S>(), *cd = cos.data_ptr<S>(), *sd = sin.data_ptr<S>();
    const int64_t *pd = pos.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
    auto rot = [&](const S* x, S* y, const S* c, const S* s) {
      for (int64_t i = 0; i < D; ++i) {
        const F xr = i < h2 ? -static_cast<F>(x[i + h2]) : static_cast<F>(x[i - h2]);
        const S a = static_cast<S>(static_cast<F>(x[i]) * static_cast<F>(c[i]));
        const S b = static_cast<S>(static_cast<S>(xr) * static_cast<F>(s[i]));
        y[i] = static_cast<S>(static_cast<F>(a) + static_cast<F>(b));
      }
    };
    auto write = [&](auto* kc, auto* vc) {  // the pool's element type: S, or bf16 under float
      using C = std::remove_pointer_t<decltype(kc)>;
      at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
        S tmp[1024];
        for (int64_t r = a; r < b; ++r) {
          const S *c = cd + pd[r] * D, *s = sd + pd[r] * D;
          for (int64_t h = 0; h < H; ++h) {
            S* x = qd + r * q.stride(0) + h * q.stride(1);
            rot(x, tmp, c, s);
            std::copy(tmp, tmp + D, x);
          }
          for (int64_t h = 0; h < KVH; ++h) {
            rot(kd + r * k.stride(0) + h * k.stride(1), tmp, c, s);
            C* ko = kc + sl[r] * kc0 + h * kc1;
            const S* vi = vd + r * v.stride(0) + h * v.stride(1);
            C* vo = vc + sl[r] * vc0 + h * vc1;
            for (int64_t i = 0; i < D; ++i) ko[i] = static_cast<C>(tmp[i]), vo[i] = static_cast<C>(vi[i]);
          }
        }
      });
    };
    if (same) write(k_cache.data_ptr<S>(), v_cache.data_ptr<S>());
    else write(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.def("rope_kv_write(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots) -> ()");
  m.impl("rope_kv_write", c10::DispatchKey::CPU, &rope_kv_write);
}
