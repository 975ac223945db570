// The grouped block-quantized GEMM over stacked experts (defined in quant_gemm_op.cpp), for moe.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <vector>

namespace specserve_quant {

// A packed weight's row segment as qgemm_segs takes it: codes, scales, offsets (undefined: none), columns, format.
struct WeightSeg { at::Tensor wp, wd, wm; int64_t n, fmt; };
// Expert `expert` of a stacked projection on rows [r0, r0 + m) of qgemm_experts' x.
struct ExpertRows { int64_t expert, r0, m; };
// An MoE projection on rows sorted by expert: ys[0] [M, Σ n] holds, for every group, x[r0 : r0 + m] · W_expertᵀ in
// the same rows (`stacked`: every segment's tensors [E, …]); the rows no group names are left unwritten. One
// quantization of x serves every group of few rows; `extra_w` (none: empty): one more pair (extra_x, extra_w) in
// the same parallel loop, its product ys[1] (qwen2_moe's shared expert). NOTE: each row's bits are
// qgemm_segs(x[row], W_expert)'s; no expert is indexed by a tensor op (a step's experts cost no dispatcher calls).
std::vector<at::Tensor> qgemm_experts(const at::Tensor& x, const std::vector<WeightSeg>& stacked,
                                      const std::vector<ExpertRows>& groups, const at::Tensor& extra_x,
                                      const std::vector<WeightSeg>& extra_w, int64_t impl = -1);

// One projection's segments from an op's flat lists at (wi, di), advancing both: its segment count S in dims, then
// (n, fmt) per segment; three tensors (codes, scales, offsets or None) per segment in weights. S = 0: none.
std::vector<WeightSeg> read_segs(const c10::List<c10::optional<at::Tensor>>& w, size_t& wi, at::IntArrayRef dims,
                                 size_t& di);

}  // namespace specserve_quant
