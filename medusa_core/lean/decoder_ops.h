// The lean decoding step's operations around its decoder layers (decoder.h LeanDecoder): the 4-bit products as the
// layers call them (Int4, Product, Columns, fuse), the RMS norm's variance in ATen's order, the norm and cast, RoPE and
// the residual add, each computed as transformers' Llama modules and this project's layers compute it: every step a
// single IEEE operation, rounded where ATen rounds it, in the same order (the build's -ffp-contract=off keeps products
// and sums apart), so the results are the same bits (tests/test_lean.py).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int4_matmul.h"

namespace medusa_lean {

constexpr int64_t kGroupSize = 32;  // quant/layers.py GROUP_SIZE

// An Int4Linear's weights as its forward reads them: (tiles, an empty tensor) for the compiled int4_matmul, or torch's
// (packed, scale_zero) where this build has no AVX512-BF16 (quant/layers.py Int4Linear.kernel_weights).
struct Int4 {
  Tensor weights, scales;
  c10::optional<Tensor> bias;
  int64_t out_features;
};

// Int4Linear.forward's product alone: x [M, K] bfloat16 -> [M, N] bfloat16 (the bias and the cast back are the caller's).
inline Tensor int4_mm(const Tensor& x, const Int4& w) {
  if (w.weights.dim() == 3) return int4_matmul(x, w.weights);  // tiles
  return at::_weight_int4pack_mm_for_cpu(x, w.weights, kGroupSize, w.scales);
}

// A product's output [M, N] bfloat16 as raw bits, rows `stride` apart; `keep` holds it when torch's kernel made it.
struct Product {
  const uint16_t* data;
  int64_t stride;
  Tensor keep;
};

// int4_mm of x [M, K] (raw bfloat16, rows K apart) into the buffer `out` (room for [M, N]): the compiled product
// writes there; torch's kernel returns a tensor of its own.
inline Product int4_mm(const uint16_t* x, int64_t m, int64_t k, const Int4& w, uint16_t* out) {
  if (w.weights.dim() == 3) {
    int4_matmul_into(x, m, k, k, w.weights, out);
    return Product{out, w.out_features, Tensor()};
  }
  Tensor view = at::from_blob(const_cast<uint16_t*>(x), {m, k}, at::TensorOptions().dtype(at::kBFloat16));
  Tensor r = at::_weight_int4pack_mm_for_cpu(view, w.weights, kGroupSize, w.scales);
  return Product{reinterpret_cast<const uint16_t*>(r.data_ptr<c10::BFloat16>()), r.stride(0), r};
}

// A bfloat16 matrix [M, ≥ offset + width] read as float32, with a float32 bias [width] added (Int4Linear's
// `.to(float32)` then `+ bias`): columns offset .. offset + width − 1.
struct Columns {
  const uint16_t* data;
  int64_t row_stride;
  const float* bias;  // nullptr: none
  // Row r's columns j0 .. j0 + count − 1 as float32, into dst.
  void load(int64_t r, int64_t j0, int64_t count, float* dst) const {
    const uint16_t* src = data + r * row_stride + j0;
    for (int64_t j = 0; j < count; ++j) dst[j] = bf16_float(src[j]);
    if (bias)
      for (int64_t j = 0; j < count; ++j) dst[j] += bias[j0 + j];
  }
};

inline Columns columns(const Product& m, int64_t offset, const c10::optional<Tensor>& bias, int64_t bias_offset) {
  return Columns{m.data + offset, m.stride, bias ? bias->data_ptr<float>() + bias_offset : nullptr};
}

// ATen's float32 sum of a contiguous row's squares, in its order (SumKernel.cpp cascade_sum on 8-lane vectors, which
// is what this ATen runs for a float32 row on x86: vectors of 8 summed in 4 interleaved rows of multi_row_sum's
// levels, the rows added, a scalar tail, the 8 lanes added in order, added to the zeroed output). Each lane step is one
// IEEE sum of one rounded square, so the result is ATen's bit for bit; LeanDecoder checks that on random rows when it
// is built (own_mean_) and keeps ATen's pow / mean where it is not.
inline float sum_of_squares(const float* x, int64_t width) {
  constexpr int L = 8, kRows = 4, kLevels = 4;
  const int64_t vectors = width / L, size = vectors / kRows;
  int64_t ceil_log2 = 1;  // ATen's CeilLog2: 1 up to 2, else ⌈log2⌉
  while ((int64_t(1) << ceil_log2) < size) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels), level_step = int64_t(1) << level_power;
  float acc[kLevels][kRows][L] = {};
  auto add = [&](float* a, int64_t v) {
    for (int l = 0; l < L; ++l) {
      const float e = x[v * L + l];
      a[l] = a[l] + e * e;
    }
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kRows; ++k) add(acc[0][k], kRows * i + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kRows; ++k)
        for (int l = 0; l < L; ++l) acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
      if ((i & ((level_step - 1) << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kRows; ++k) add(acc[0][k], kRows * i + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kRows; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
  for (int64_t v = size * kRows; v < vectors; ++v) add(acc[0][0], v);
  for (int k = 1; k < kRows; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
  float total = 0.0f;
  for (int64_t k = vectors * L; k < width; ++k) total = total + x[k] * x[k];
  for (int l = 0; l < L; ++l) total = total + acc[0][0][l];
  return 0.0f + total;
}

// LlamaRMSNorm.forward's variance of each row of hidden [1, N, H]: `hidden.pow(2).mean(-1, keepdim=True)`, ATen's
// bits, into var [N]: by sum_of_squares / H where `own` (checked), else by ATen's calls into `squares` [1, N, H] and
// `variance` [1, N, 1].
inline void row_variance(const Tensor& hidden, bool own, Tensor& squares, Tensor& variance, float* var) {
  const int64_t n = hidden.size(1), width = hidden.size(2);
  const float* h = hidden.data_ptr<float>();
  if (own) {
    for (int64_t r = 0; r < n; ++r) var[r] = sum_of_squares(h + r * width, width) / static_cast<float>(width);
    return;
  }
  at::pow_out(squares, hidden, 2);
  at::mean_out(variance, squares, {-1}, true);
  std::memcpy(var, variance.data_ptr<float>(), n * sizeof(float));
}

// LlamaRMSNorm.forward, then Int4Linear's cast: bf16(w · (h · 1/√(var + eps))) into out [N, H] (raw bfloat16), var the
// rows' variances (row_variance); 1/√ is what at::rsqrt computes (1 / sqrt, both correctly rounded).
inline void norm_bf16(const Tensor& hidden, const Tensor& weight, double eps, const float* var, uint16_t* out) {
  const int64_t n = hidden.size(1), width = hidden.size(2);
  const float* h = hidden.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);  // ATen adds a Python float to a float32 tensor in float32
  for (int64_t r = 0; r < n; ++r) {
    const float inv = 1.0f / std::sqrt(var[r] + e);
    const float* hr = h + r * width;
    uint16_t* orow = out + r * width;
    for (int64_t i = 0; i < width; ++i) orow[i] = bf16_bits(w[i] * (hr[i] * inv));
  }
}

// True when sum_of_squares / H gives ATen's `pow(2).mean(-1, keepdim=True)` bit for bit on rows of this width: 64
// pseudo-random rows (no generator state used) of magnitudes 1e-3 .. 1e3.
inline bool own_mean_matches(int64_t width) {
  if (width < 32) return false;
  Tensor rows = at::sin(at::arange(64 * width, at::kFloat) * 12.9898f).mul(43758.547f).frac().sub(0.5f).view({1, 64, width}) *
                at::pow(10.0, at::linspace(-3, 3, 64).view({1, 64, 1}));
  Tensor expected = rows.pow(2).mean(-1, true);
  Tensor squares = at::empty_like(rows), variance = at::empty({1, 64, 1});
  std::vector<float> var(64);
  row_variance(rows, true, squares, variance, var.data());
  return std::memcmp(var.data(), expected.data_ptr<float>(), 64 * sizeof(float)) == 0;
}

// apply_rotary_pos_emb on one head of one row: out = x·cos + rotate_half(x)·sin, rotate_half(x) = (−x₂, x₁);
// x is the head's dh values, out may not alias it.
inline void rope_head(const float* x, int64_t dh, const float* cos, const float* sin, float* out) {
  const int64_t half = dh / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
  for (int64_t d = half; d < dh; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// hidden += float(out) over [N, H], in place: the residual add after a product (Int4Linear's cast and bias, then
// `residual + out`, the same sums); scratch holds H floats.
inline void residual_add(Tensor& hidden, const Columns& out, float* scratch) {
  const int64_t n = hidden.size(1), width = hidden.size(2);
  float* h = hidden.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    out.load(r, 0, width, scratch);
    for (int64_t i = 0; i < width; ++i) h[r * width + i] = h[r * width + i] + scratch[i];
  }
}

// LlamaRMSNorm.forward.
inline Tensor rms_norm(const Tensor& h, const Tensor& weight, double eps) {
  Tensor x = h.to(at::kFloat);
  Tensor variance = x.pow(2).mean(-1, true);
  x = x * at::rsqrt(variance + eps);
  return weight * x.to(h.scalar_type());
}

// Several int4 linears of the same input as one: their weights and scales side by side. Both int4 kernels compute
// every output on its own (one float32 accumulator, K never split), so each output keeps its bits; fewer, larger
// calls cost less on two cores (on the demo, q/k/v 34 -> 21 us, gate/up 60 -> 54 us a token with torch's kernel).
// int4_matmul's tiles are pairs of blocks of 16 outputs, so side by side is its layout when every part but the last
// has whole pairs (the demo's q/k/v: 36, 12 and 12 blocks); torch's packed layout comes in tiles of rows (64 on this
// CPU), the same layout only when the parts fill whole tiles. A probe product decides, bit for bit. Linears that mix
// bias and no bias are not fused.
inline c10::optional<Int4> fuse(const std::vector<const Int4*>& parts) {
  std::vector<Tensor> weights, scales, bias;
  int64_t out = 0;
  for (const Int4* p : parts) {
    if (p->bias.has_value() != parts[0]->bias.has_value()) return c10::nullopt;
    weights.push_back(p->weights);
    scales.push_back(p->scales);
    if (p->bias) bias.push_back(*p->bias);
    out += p->out_features;
  }
  const bool tiled = parts[0]->weights.dim() == 3;  // scales in the tiles, else torch's [K/32, N, 2]
  Int4 fused{at::cat(weights, 0), tiled ? scales[0] : at::cat(scales, 1),
             bias.empty() ? c10::nullopt : c10::optional<Tensor>(at::cat(bias, 0)), out};
  const int64_t inputs = tiled ? parts[0]->weights.size(1) * 32 : parts[0]->weights.size(1) * 2;  // K
  Tensor probe = at::randn({3, inputs}).to(at::kBFloat16);
  std::vector<Tensor> separate;
  for (const Int4* p : parts) separate.push_back(int4_mm(probe, *p));
  if (!at::equal(int4_mm(probe, fused), at::cat(separate, -1))) return c10::nullopt;
  return fused;
}

struct Layer {
  Tensor input_norm, post_norm;
  double eps;
  Int4 q, k, v, o, gate, up, down;
  c10::optional<Int4> qkv, gate_up;  // fused, when possible
};

// A group of query rows that see the same number of keys (invariant.py _RowGroup).
struct Group {
  int64_t first, last;  // rows first..last−1 when span
  bool span;
  Tensor index;  // [B] the rows
  int64_t count;  // keys each row sees
  bool view;  // a single row whose keys are 0 .. count−1
  Tensor keys;  // [B·count] each row's key positions (when not view)
};

}  // namespace medusa_lean
