// The LM head's refinement (quant/layers.py BF16Linear with refine_top, set by invariant.make_batch_invariant): each
// row's k largest outputs of the 4-bit first pass recomputed in float32 from the bfloat16 weights, in one call.
//
// Through ATen this was a top-k over the row (~90 us for 49,152 logits on this project's CPU) and one gather, cast and
// gemv per row, about 0.2 ms a step in all; here a single pass over the row keeps its k largest (top_columns.h) and each of the k dot products is a fixed-order sum (16 lanes of fused
// multiply-adds over K, then a fixed tree), so a row's values do not depend on the other rows: batch-invariant.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "row_attention.h"
#include "top_columns.h"

namespace medusa_lean {

typedef uint16_t u16v __attribute__((vector_size(32)));
typedef uint32_t u32v __attribute__((vector_size(64)));

// 16 bfloat16 values as float32 (exact: a bfloat16 is the top half of a float32).
inline f16v load_bf16(const at::BFloat16* p) {
  u16v h;
  std::memcpy(&h, p, sizeof h);
  const u32v w = __builtin_convertvector(h, u32v) << 16;
  f16v f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// Σ_i w[i]·x[i] in float32 for a bfloat16 row w and a float32 x of n values: 16 lanes over i, then a fixed tree.
inline float dot_bf16_f32(const at::BFloat16* w, const float* x, int64_t n) {
  f16v acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = mul_add(load_bf16(w + i), load16(x + i), acc);
  if (i < n) {  // the tail, zero-padded to 16 lanes
    at::BFloat16 wt[kLanes] = {};
    float xt[kLanes] = {};
    std::memcpy(wt, w + i, (n - i) * sizeof(at::BFloat16));
    std::memcpy(xt, x + i, (n - i) * sizeof(float));
    acc = mul_add(load_bf16(wt), load16(xt), acc);
  }
  return lane_sum(acc);
}

// In place on logits [M, N] float32 (the first pass's): each row's k largest (ties to the lower column) become
// Σ_i weight[t, i]·x[r, i] (+ bias[t]), weight [N, K] bfloat16, x [M, K] float32, bias [N] bfloat16 or empty.
inline void refine_top(Tensor logits, const Tensor& weight, const Tensor& x, const Tensor& bias, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(), "logits must be contiguous [M, N] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "weight must be contiguous [N, K] bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous [M, K] float32");
  const int64_t M = logits.size(0), N = logits.size(1), K = x.size(1);
  TORCH_CHECK(weight.size(0) == N && weight.size(1) == K && x.size(0) == M && k >= 1 && k <= N, "shapes: logits [M, N], weight [N, K], x [M, K], 1 <= k <= N");
  const bool biased = bias.numel() > 0;
  if (biased) TORCH_CHECK(bias.scalar_type() == at::kBFloat16 && bias.numel() == N && bias.is_contiguous(), "bias must be [N] bfloat16");
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  std::vector<float> best(k);
  std::vector<int64_t> where(k);
  for (int64_t r = 0; r < M; ++r) {
    float* row = logits.data_ptr<float>() + r * N;
    top_columns(row, N, k, best.data(), where.data());
    const float* xr = x.data_ptr<float>() + r * K;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t t = where[j];
      float value = dot_bf16_f32(w + t * K, xr, K);
      if (biased) value += static_cast<float>(bias.data_ptr<at::BFloat16>()[t]);
      row[t] = value;
    }
  }
}

}  // namespace medusa_lean
