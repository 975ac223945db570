// The grouped block-quantized GEMM (defined in quant_gemm_op.cpp), for ops in other files (moe.cpp).
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <vector>

namespace specserve_quant {

// A packed weight's row segment as qgemm_segs takes it: codes, scales, offsets (undefined: none), columns, format.
struct WeightSeg { at::Tensor wp, wd, wm; int64_t n, fmt; };
// ys[g] = xs[g] · W_gᵀ for every group g (xs[g] [M_g, K_g] float, W_g its row segments) → [M_g, Σ n] fp32, in one
// parallel loop over every group's column tiles: one thread hand-off for a batch of small GEMMs (an MoE step's
// experts, each on its own rows). NOTE: ys[g] is the bits qgemm_segs(xs[g], W_g) gives. impl as qgemm's.
std::vector<at::Tensor> qgemm_grouped(const std::vector<at::Tensor>& xs, const std::vector<std::vector<WeightSeg>>& ws,
                                      int64_t impl = -1);

// One projection's segments from an op's flat lists at (wi, di), advancing both: its segment count S in dims, then
// (n, fmt) per segment; three tensors (codes, scales, offsets or None) per segment in weights. S = 0: none.
std::vector<WeightSeg> read_segs(const c10::List<c10::optional<at::Tensor>>& w, size_t& wi, at::IntArrayRef dims,
                                 size_t& di);

}  // namespace specserve_quant
