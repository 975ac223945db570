// A mixture-of-experts MLP on block-quantized experts, shared by the moe_mlp op and the decoder_layers loop.
#pragma once
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "quant_gemm_grouped.h"

namespace specserve_moe {

using specserve_quant::WeightSeg;

struct MoEWeights {
  at::Tensor router;                     // [E (+ 1: the shared expert's gate row), H] float32
  std::vector<WeightSeg> gate_up, down;  // stacked over experts: wp [E, …], wd [E, …], wm [E, …] or undefined
  std::vector<WeightSeg> shared_gate_up, shared_down;  // qwen2_moe's shared expert (empty: none)
  int64_t top_k = 0;
  bool norm = false;                     // renormalise the top-k weights to sum to 1
};

// h [T, H] float32 (the normed rows) → (the MLP's output [T, H], the experts it ran, ascending int64).
std::pair<at::Tensor, at::Tensor> moe_forward(const at::Tensor& h, const MoEWeights& m, int64_t impl = -1);

// An MoE block's weights from an op's flat lists (weights, dims) at (wi, di), advancing both: the shared expert's
// gate_up and down (no segments: none), then the experts' gate_up and down (stacked); each projection its
// segment count S in dims, then (n, fmt) per segment, and three tensors (codes, scales, offsets or None) per
// segment in weights.
MoEWeights read_weights(const at::Tensor& router, int64_t top_k, bool norm,
                        const c10::List<c10::optional<at::Tensor>>& w, size_t& wi, at::IntArrayRef dims, size_t& di);

}  // namespace specserve_moe
