// gguf_repack: one GGUF tensor's raw block bytes straight into qgemm's packed layout (wp, wd, wm), parallel over
// column tiles, with an optional row order (output row r reads source row order[r]: the llama q/k un-permutation).
// NOTE: bit-equal to quant_ref.pack / pack_kquant of gguf_blocks' BlockCodes (tests/test_gguf_repack.py); byte
// layouts of the file: specserve/models/gguf_blocks.py; packed layout: quant_ref._layout and pack_kquant.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {
constexpr int64_t QK = 32, QK_K = 256, NR = 16;

struct Type {
  const char* name;
  int64_t size, per, bits;  // bytes per block, elements per block, code bits
  bool has_m, kquant;
};
const Type TYPES[] = {{"Q8_0", 34, QK, 8, false, false},   {"Q4_0", 18, QK, 4, true, false},
                      {"Q4_1", 20, QK, 4, true, false},    {"Q5_0", 22, QK, 5, false, false},
                      {"Q5_1", 24, QK, 5, true, false},    {"Q4_K", 144, QK_K, 4, true, true},
                      {"Q5_K", 176, QK_K, 5, true, true},  {"Q6_K", 210, QK_K, 6, false, true}};

const Type& type_of(const std::string& name) {
  for (const Type& t : TYPES)
    if (name == t.name) return t;
  TORCH_CHECK(false, "gguf_repack: block type ", name, " has no packed form (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
              "Q5_K, Q6_K)");
}

uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// fp16 bits → fp32 as numpy converts them (gguf_blocks._f16): exact, a NaN keeps its payload unquieted
float half_to_float(uint16_t h) {
  if ((h & 0x7c00u) != 0x7c00u) return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  const uint32_t b = (static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7f800000u | (static_cast<uint32_t>(h & 0x3ffu) << 13);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool exact_half(float v) { return static_cast<float>(c10::Half(v)) == v; }  // false for NaN, as torch.equal

// One block of 32 stored codes (what _layout packs: 8-bit code + 128; Q5_0's signed code + 16, i.e. the file's
// 5-bit value; others the code) for 16 columns u[c][k] → `out` (bits·64 bytes, quant_ref._layout).
void layout_block(const uint8_t (*u)[QK], int64_t ustride, int64_t bits, uint8_t* out) {
  auto at = [&](int64_t c, int64_t k) { return u[c * ustride][k]; };
  if (bits == 8) {
    for (int64_t g = 0; g < 8; ++g)
      for (int64_t c = 0; c < NR; ++c)
        for (int64_t j = 0; j < 4; ++j) out[(g * NR + c) * 4 + j] = at(c, 4 * g + j);
    return;
  }
  for (int64_t g = 0; g < 4; ++g)
    for (int64_t c = 0; c < NR; ++c)
      for (int64_t j = 0; j < 4; ++j)
        out[(g * NR + c) * 4 + j] = static_cast<uint8_t>((at(c, 4 * g + j) & 15) | ((at(c, 4 * g + 16 + j) & 15) << 4));
  uint8_t* hi = out + 256;
  for (int64_t c = 0; c < NR; ++c)
    for (int64_t j = 0; j < 4; ++j) {
      if (bits == 5) {
        uint8_t v = 0;
        for (int64_t g = 0; g < 8; ++g) v |= static_cast<uint8_t>(((at(c, 4 * g + j) >> 4) & 1) << g);
        hi[c * 4 + j] = v;
      } else if (bits == 6) {
        for (int64_t h = 0; h < 2; ++h) {
          uint8_t v = 0;
          for (int64_t jj = 0; jj < 4; ++jj) v |= static_cast<uint8_t>(((at(c, 4 * (4 * h + jj) + j) >> 4) & 3) << (2 * jj));
          hi[h * 64 + c * 4 + j] = v;
        }
      }
    }
}

// Per-block formats: one block's stored codes, d and m (gguf_blocks._per_block).
void decode_block(const Type& t, const uint8_t* b, uint8_t* u, float& d, float& m) {
  d = half_to_float(u16(b));
  if (t.bits == 8) {
    for (int64_t i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(b[2 + i] ^ 0x80);  // int8 + 128
    m = 0.f;
    return;
  }
  const bool q4_0 = t.size == 18;
  m = q4_0 ? -8.f * d : t.has_m ? half_to_float(u16(b + 2)) : 0.f;
  const uint8_t* qs = b + t.size - 16;
  for (int64_t i = 0; i < 16; ++i) {
    u[i] = qs[i] & 15;
    u[i + 16] = qs[i] >> 4;
  }
  if (t.bits == 5) {
    const uint8_t* qh = b + 2 + 2 * t.has_m;  // bit i of a little-endian uint32: element i's bit 4
    for (int64_t i = 0; i < QK; ++i) u[i] |= static_cast<uint8_t>(((qh[i >> 3] >> (i & 7)) & 1) << 4);
  }
}

// Super-block formats: one super-block's codes u[256], scale codes sc (8; Q6_K: 16 int8), mins mn (8), d, dmin bits.
void decode_super(const Type& t, const uint8_t* b, uint8_t* u, uint8_t* sc, uint8_t* mn, uint16_t& d, uint16_t& dmin) {
  if (t.bits == 6) {  // ql[128], qh[64], scales[16] int8, d
    const uint8_t *ql = b, *qh = b + 128;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t e = 0; e < 128; ++e) {
        const uint8_t lo = e < 64 ? (ql[64 * h + e] & 15) : (ql[64 * h + e - 64] >> 4);
        const uint8_t hi = (qh[32 * h + (e & 31)] >> (2 * (e >> 5))) & 3;
        u[128 * h + e] = static_cast<uint8_t>(lo | (hi << 4));
      }
    std::memcpy(sc, b + 192, 16);
    d = u16(b + 208);
    dmin = 0;
    return;
  }
  d = u16(b);
  dmin = u16(b + 2);
  const uint8_t* s = b + 4;
  for (int64_t j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
  const uint8_t* qs = b + t.size - 128;
  for (int64_t c = 0; c < 4; ++c)
    for (int64_t i = 0; i < 32; ++i) {
      u[64 * c + i] = qs[32 * c + i] & 15;
      u[64 * c + 32 + i] = qs[32 * c + i] >> 4;
    }
  if (t.bits == 5) {
    const uint8_t* qh = b + 16;  // element 32j + i: bit j of qh[i]
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t i = 0; i < 32; ++i) u[32 * j + i] |= static_cast<uint8_t>(((qh[i] >> j) & 1) << 4);
  }
}

// fp16 of an fp16 value that went through fp32 (pack_kquant's _tile(d.float(), ..., float16)): the same bits;
// a NaN comes back quieted, as the hardware conversion torch uses gives it
uint16_t half_roundtrip(uint16_t h) { return ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) ? h | 0x200u : h; }

// data: uint8, N rows of row_bytes; order: int64 [N] or undefined. Returns [wp, wd] or [wp, wd, wm].
std::vector<at::Tensor> gguf_repack(const at::Tensor& data_, const std::string& qtype, int64_t N, int64_t K,
                                    const c10::optional<at::Tensor>& order_) {
  const Type& t = type_of(qtype);
  TORCH_CHECK(N > 0 && K > 0 && K % t.per == 0, "gguf_repack: ", qtype, " needs K % ", t.per, " == 0, got ", K);
  const int64_t nper = K / t.per, row_bytes = nper * t.size;
  TORCH_CHECK(data_.scalar_type() == at::kByte && data_.numel() == N * row_bytes,
              "gguf_repack: data must be uint8 with N·row bytes = ", N * row_bytes, " elements, got ", data_.numel());
  const at::Tensor data = data_.contiguous();
  at::Tensor order;
  if (order_.has_value() && order_->defined()) {
    order = order_->to(at::kLong).contiguous();
    TORCH_CHECK(order.dim() == 1 && order.size(0) == N, "gguf_repack: row order must be [N] int64");
    TORCH_CHECK(N == 0 || (order.min().item<int64_t>() >= 0 && order.max().item<int64_t>() < N),
                "gguf_repack: row order out of range");
  }
  const uint8_t* src = data.data_ptr<uint8_t>();
  const int64_t* ord = order.defined() ? order.data_ptr<int64_t>() : nullptr;
  const int64_t tiles = (N + NR - 1) / NR;
  const auto u8 = data.options().dtype(at::kByte);
  auto row = [&](int64_t n) { return src + (ord ? ord[n] : n) * row_bytes; };

  if (t.kquant) {
    const int64_t nsb = nper, cb = t.bits * 64, sb_bytes = 8 * (cb + 32);
    at::Tensor wp = at::empty({tiles, nsb, sb_bytes}, u8);
    at::Tensor wd = at::empty({tiles, nsb, NR}, u8.dtype(at::kHalf));
    at::Tensor wm = t.has_m ? at::empty({tiles, nsb, NR}, u8.dtype(at::kHalf)) : at::Tensor();
    uint8_t* pp = wp.data_ptr<uint8_t>();
    uint16_t* pd = reinterpret_cast<uint16_t*>(wd.data_ptr<at::Half>());
    uint16_t* pm = t.has_m ? reinterpret_cast<uint16_t*>(wm.data_ptr<at::Half>()) : nullptr;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      uint8_t u[NR][QK_K], sc[NR][16], mn[NR][8];
      for (int64_t ti = t0; ti < t1; ++ti)
        for (int64_t s = 0; s < nsb; ++s) {
          const int64_t at_ = ti * nsb + s;
          for (int64_t c = 0; c < NR; ++c) {
            const int64_t n = ti * NR + c;
            uint16_t d = 0, dmin = 0;
            if (n < N) {
              decode_super(t, row(n) + s * t.size, u[c], sc[c], mn[c], d, dmin);
            } else {  // zero columns past N (pack_kquant pads codes and scales with 0)
              std::memset(u[c], 0, QK_K);
              std::memset(sc[c], 0, 16);
              std::memset(mn[c], 0, 8);
            }
            pd[at_ * NR + c] = half_roundtrip(d);
            if (pm) pm[at_ * NR + c] = half_roundtrip(dmin);
          }
          uint8_t* out = pp + at_ * sb_bytes;
          for (int64_t bb = 0; bb < 8; ++bb) {
            layout_block(reinterpret_cast<const uint8_t(*)[QK]>(&u[0][bb * QK]), QK_K / QK, t.bits, out + bb * cb);
            uint8_t* subs = out + 8 * cb + bb * 32;
            for (int64_t c = 0; c < NR; ++c) {
              subs[c] = t.bits == 6 ? sc[c][2 * bb] : sc[c][bb];
              subs[NR + c] = t.bits == 6 ? sc[c][2 * bb + 1] : mn[c][bb];
            }
          }
        }
    });
    return t.has_m ? std::vector<at::Tensor>{wp, wd, wm} : std::vector<at::Tensor>{wp, wd};
  }

  // Per-block formats: fp16 scales when every d (and m) is exactly an fp16 (quant_ref.pack), else fp32.
  // Only Q4_0's m = −8·d can leave fp16's range, and a NaN is never "exact".
  const int64_t nb = nper;
  bool exact = true;
  for (int64_t n = 0; n < N && exact; ++n)
    for (int64_t b = 0; b < nb && exact; ++b) {
      const uint8_t* p = src + n * row_bytes + b * t.size;
      const float d = half_to_float(u16(p));
      const float m = t.size == 18 ? -8.f * d : t.has_m ? half_to_float(u16(p + 2)) : 0.f;
      exact = exact_half(d) && exact_half(m);
    }
  const auto sdt = exact ? at::kHalf : at::kFloat;
  at::Tensor wp = at::empty({tiles, nb, t.bits * 64}, u8);
  at::Tensor wd = at::empty({tiles, nb, NR}, u8.dtype(sdt));
  at::Tensor wm = t.has_m ? at::empty({tiles, nb, NR}, u8.dtype(sdt)) : at::Tensor();
  uint8_t* pp = wp.data_ptr<uint8_t>();
  at::Half* dh = exact ? wd.data_ptr<at::Half>() : nullptr;
  at::Half* mh = exact && t.has_m ? wm.data_ptr<at::Half>() : nullptr;
  float* df = exact ? nullptr : wd.data_ptr<float>();
  float* mf = !exact && t.has_m ? wm.data_ptr<float>() : nullptr;
  // stored codes of a zero column past N: 8-bit 0 + 128, Q5_0's signed 0 + 16, else 0
  const uint8_t pad = t.bits == 8 ? 128 : (t.bits == 5 && !t.has_m) ? 16 : 0;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    uint8_t u[NR][QK];
    float d[NR], m[NR];
    for (int64_t ti = t0; ti < t1; ++ti)
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t c = 0; c < NR; ++c) {
          const int64_t n = ti * NR + c;
          if (n < N) {
            decode_block(t, row(n) + b * t.size, u[c], d[c], m[c]);
          } else {
            std::memset(u[c], pad, QK);
            d[c] = m[c] = 0.f;
          }
        }
        const int64_t at_ = ti * nb + b;
        layout_block(u, 1, t.bits, pp + at_ * t.bits * 64);
        for (int64_t c = 0; c < NR; ++c) {
          if (dh) dh[at_ * NR + c] = c10::Half(d[c]);
          if (mh) mh[at_ * NR + c] = c10::Half(m[c]);
          if (df) df[at_ * NR + c] = d[c];
          if (mf) mf[at_ * NR + c] = m[c];
        }
      }
  });
  return t.has_m ? std::vector<at::Tensor>{wp, wd, wm} : std::vector<at::Tensor>{wp, wd};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("gguf_repack(Tensor data, str qtype, int n, int k, Tensor? order=None) -> Tensor[]", &gguf_repack);
}
