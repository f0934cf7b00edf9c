// The lean decoding step (medusa_core/lean): the decoder layers of a Llama-family model with int4 linears,
// for the short passes of decoding (one token, or a tree's few rows), in one call from Python.
//
// Every value is computed as transformers' Llama modules and this project's layers (quant/layers.py Int4Linear,
// invariant.py rowwise_attention, kvcache.py GrowingLayer) compute it, so the results are the same bits
// (tests/test_lean.py compares the two paths bit for bit). SiLU and the final norm are the same ATen calls on the
// same shapes; the layers' RMS norm variance is summed here in ATen's order (sum_of_squares, checked against ATen
// when the step is built, ATen's calls where it differs); attention is the model's (row_attention.h, or SDPA calls);
// the 4-bit products are the same kernel as Int4Linear's (int4_matmul.h, or torch's int4-pack). A pass allocates its
// buffers once, not per operation. Chains of elementwise operations (RMSNorm after its mean, RoPE, casts, residual
// adds, the cache writes) are one loop each instead of one ATen kernel per operation: every step of such a chain
// is a single IEEE operation (a product, a sum, a negation, 1/√x, a cast rounded to nearest-even), rounded where
// ATen rounds it, in the same order, and the file is built with -ffp-contract=off so that no product and sum
// fuse into one rounding.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int4_matmul.h"
#include "row_attention.h"

namespace medusa_lean {

// How a pass attends (LeanDecoder::forward's `attention_mode`; medusa_core/lean/step.py names them).
constexpr int64_t kModel = 0, kRowGroups = 1, kReading = 2;

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

class LeanDecoder {
 public:
  LeanDecoder(std::vector<std::vector<Tensor>> layers, std::vector<double> eps, std::vector<int64_t> out_features,
              Tensor final_norm, double final_eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double scaling, bool row_kernel)
      : final_norm_(std::move(final_norm)), final_eps_(final_eps), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), scaling_(scaling), row_kernel_(row_kernel) {
    // Per layer: input_norm, post_norm, then (weights, scales, bias or empty) for q, k, v, o, gate, up, down.
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      TORCH_CHECK(t.size() == 2 + 3 * 7, "layer ", i, ": expected 23 tensors, got ", t.size());
      auto int4 = [&](int j) {
        const Tensor& bias = t[2 + 3 * j + 2];
        return Int4{t[2 + 3 * j], t[2 + 3 * j + 1],
                    bias.defined() && bias.numel() ? c10::optional<Tensor>(bias) : c10::nullopt,
                    out_features[j]};
      };
      Layer layer{t[0], t[1], eps[i], int4(0), int4(1), int4(2), int4(3), int4(4), int4(5), int4(6)};
      layer.qkv = fuse({&layer.q, &layer.k, &layer.v});
      layer.gate_up = fuse({&layer.gate, &layer.up});
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(!layers_.empty(), "a decoder of no layers");
    width_ = layers_[0].input_norm.size(0);
    TORCH_CHECK(final_norm_.numel() == 0 || final_norm_.size(0) == width_, "a final norm of the hidden width");
    own_mean_ = own_mean_matches(width_);
    // a pass's buffers per row (forward): a product's input (a norm's output, the attention's, the MLP's) and output
    widest_in_ = std::max(width_, num_heads_ * head_dim_);
    for (const Layer& w : layers_) {
      const int64_t inter = w.gate.out_features;
      inter_max_ = std::max(inter_max_, inter);
      widest_in_ = std::max(widest_in_, inter);
      widest_out_ = std::max({widest_out_, w.q.out_features + w.k.out_features + w.v.out_features, w.o.out_features,
                              2 * inter, w.down.out_features});
    }
  }

  // hidden [1, N, H] (the token embeddings), cos / sin [1, N, Dh] (the model's rotary embedding), the cache's
  // buffers [1, Hkv, C, Dh] per layer holding `length` entries (room for N more), and the keys each row sees: as
  // row groups for SDPA (invariant.py row_groups; none: one row that sees every key), or, with the row kernel
  // (invariant.py kernel_attention), as prefix / offsets / extras (invariant.py row_keys). `attention` says how this
  // pass attends: kModel as the model decodes (the row kernel, or SDPA calls over the row groups), kRowGroups by SDPA
  // calls over the row groups even with the row kernel (a prompt's short first pass, as transformers' pass reads it:
  // invariant.py rowwise_attention), kReading as one SDPA call over the cache (every other pass of a prompt's reading:
  // transformers' sdpa_attention_forward, `reading`). Writes the N new entries
  // at length .. length+N−1 of every buffer. Returns the final-norm hidden states [1, N, H] (the last layer's
  // output where the decoder has no final norm).
  Tensor forward(Tensor hidden, const Tensor& cos_in, const Tensor& sin_in, const std::vector<Tensor>& key_buffers,
                 const std::vector<Tensor>& value_buffers, int64_t length,
                 const std::vector<std::vector<int64_t>>& group_ints, const std::vector<Tensor>& group_index,
                 const std::vector<Tensor>& group_keys, const std::vector<int64_t>& prefix,
                 const std::vector<int64_t>& offsets, const Tensor& extras, int64_t attention_mode) {
    TORCH_CHECK(key_buffers.size() == layers_.size() && value_buffers.size() == layers_.size(),
                "one key and one value buffer per layer");
    at::NoGradGuard no_grad;
    const int64_t n = hidden.size(1);
    TORCH_CHECK(attention_mode >= kModel && attention_mode <= kReading, "attention mode ", attention_mode);
    const bool kernel = row_kernel_ && attention_mode == kModel;  // this pass's attention by row_attention, else SDPA
    std::vector<Group> groups;
    for (size_t g = 0; g < group_ints.size(); ++g) {
      const auto& v = group_ints[g];  // first, last, span, count, view
      groups.push_back(Group{v[0], v[1], v[2] != 0, group_index[g], v[3], v[4] != 0, group_keys[g]});
    }
    bool in_order = true;  // every group a span, each starting where the last ended: rows come out in order
    for (size_t g = 0; g < groups.size(); ++g) {
      in_order = in_order && groups[g].span && (g == 0 || groups[g - 1].last == groups[g].first);
    }
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous(), "hidden states: contiguous float32");
    const Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();  // [1, N, Dh]
    const float* cos_p = cos.data_ptr<float>();
    const float* sin_p = sin.data_ptr<float>();
    const bool gqa = num_heads_ != num_kv_heads_;
    // The pass's buffers, allocated once for all layers (per-op allocations cost ~0.2 ms a pass in malloc/free):
    // the residual stream (updated in place), the norms' squares and variances, a product's input and output,
    // the queries, the attention's output and scratch, SiLU's input and output.
    const int64_t width = hidden.size(2), attn_width = num_heads_ * head_dim_;
    TORCH_CHECK(width == width_, "hidden states of width ", width_, ", got ", width);
    hidden = hidden.clone();
    Tensor squares, variance;  // ATen's pow / mean outputs, where the variance is not computed here
    if (!own_mean_) squares = at::empty_like(hidden), variance = at::empty({1, n, 1}, hidden.options());
    std::vector<uint16_t> x(n * widest_in_), product(n * widest_out_);
    std::vector<float> var(n);
    std::vector<float> scratch(std::max({width, head_dim_, inter_max_})), attn_rows(kernel ? n * attn_width : 0), parts;
    Tensor query = at::empty({n, num_heads_, head_dim_}, hidden.options());  // as RoPE's output is laid out
    Tensor gate = at::empty({n, inter_max_}, hidden.options());
    const Tensor extra_ids = extras.to(at::kLong).contiguous();  // the row kernel's extra key positions
    const Tensor read_mask = attention_mode == kReading ? reading_mask(n, length + n) : Tensor();
    float* qp = query.data_ptr<float>();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      row_variance(hidden, own_mean_, squares, variance, var.data());
      norm_bf16(hidden, w.input_norm, w.eps, var.data(), x.data());  // [N, H]
      // LlamaAttention.forward: q, k, v (one product or three), RoPE, the cache's new entries
      Columns q, k, v;
      Product qkv, q_out, k_out, v_out;  // keep the products alive while their columns are read
      if (w.qkv) {
        qkv = int4_mm(x.data(), n, width, *w.qkv, product.data());
        const int64_t nq = w.q.out_features, nk = w.k.out_features;
        q = columns(qkv, 0, w.qkv->bias, 0), k = columns(qkv, nq, w.qkv->bias, nq), v = columns(qkv, nq + nk, w.qkv->bias, nq + nk);
      } else {
        uint16_t* out = product.data();
        q_out = int4_mm(x.data(), n, width, w.q, out);
        k_out = int4_mm(x.data(), n, width, w.k, out + n * w.q.out_features);
        v_out = int4_mm(x.data(), n, width, w.v, out + n * (w.q.out_features + w.k.out_features));
        q = columns(q_out, 0, w.q.bias, 0), k = columns(k_out, 0, w.k.bias, 0), v = columns(v_out, 0, w.v.bias, 0);
      }
      // GrowingLayer.update: the new entries written in place at length.., the cache read through views
      const Tensor& kb = key_buffers[i];
      const Tensor& vb = value_buffers[i];
      TORCH_CHECK(kb.scalar_type() == at::kFloat && vb.scalar_type() == at::kFloat && kb.stride(3) == 1 && vb.stride(3) == 1,
                  "the cache holds float32 entries, unit stride over Dh");
      float* kp = kb.data_ptr<float>();
      float* vp = vb.data_ptr<float>();
      const int64_t hs = kb.stride(1), ps = kb.stride(2), vhs = vb.stride(1), vps = vb.stride(2);
      for (int64_t r = 0; r < n; ++r) {
        const float* c = cos_p + r * head_dim_;
        const float* s = sin_p + r * head_dim_;
        for (int64_t h = 0; h < num_heads_; ++h) {
          q.load(r, h * head_dim_, head_dim_, scratch.data());
          rope_head(scratch.data(), head_dim_, c, s, qp + (r * num_heads_ + h) * head_dim_);
        }
        for (int64_t h = 0; h < num_kv_heads_; ++h) {
          k.load(r, h * head_dim_, head_dim_, scratch.data());
          rope_head(scratch.data(), head_dim_, c, s, kp + h * hs + (length + r) * ps);
          v.load(r, h * head_dim_, head_dim_, vp + h * vhs + (length + r) * vps);
        }
      }
      // o_proj's cast of the attention's output [N, Hq, Dh]
      const float* at_p;
      int64_t s1 = attn_width, s2 = head_dim_, s3 = 1;
      Tensor attn;  // SDPA's output [1, N, Hq, Dh], any strides
      if (kernel) {
        TORCH_CHECK(ps == vps, "row_attention: keys and values with the same position stride");
        const RowOperands in{qp, n, num_heads_, head_dim_, attn_width, head_dim_, kp, vp, num_kv_heads_,
                                          hs, vhs, ps, extra_ids.data_ptr<int64_t>()};
        row_attention_into(in, prefix, offsets, scaling_, attn_rows.data(), parts);
        at_p = attn_rows.data();
      } else if (attention_mode == kReading) {
        attn = reading(query.unsqueeze(0).transpose(1, 2), kb.slice(2, 0, length + n), vb.slice(2, 0, length + n), read_mask, gqa);
        at_p = attn.data_ptr<float>(), s1 = attn.stride(1), s2 = attn.stride(2), s3 = attn.stride(3);
      } else {
        attn = attention(query.unsqueeze(0).transpose(1, 2), kb.slice(2, 0, length + n), vb.slice(2, 0, length + n),
                         groups, in_order, gqa);
        at_p = attn.data_ptr<float>(), s1 = attn.stride(1), s2 = attn.stride(2), s3 = attn.stride(3);
      }
      uint16_t* ap = x.data();
      for (int64_t r = 0; r < n; ++r)
        for (int64_t h = 0; h < num_heads_; ++h) {
          const float* src = at_p + r * s1 + h * s2;
          uint16_t* dst = ap + (r * num_heads_ + h) * head_dim_;
          if (s3 == 1)
            for (int64_t d = 0; d < head_dim_; ++d) dst[d] = bf16_bits(src[d]);
          else
            for (int64_t d = 0; d < head_dim_; ++d) dst[d] = bf16_bits(src[d * s3]);
        }
      const Product o = int4_mm(ap, n, attn_width, w.o, product.data());
      residual_add(hidden, columns(o, 0, w.o.bias, 0), scratch.data());
      // LlamaMLP.forward: down(silu(gate(x)) * up(x))
      row_variance(hidden, own_mean_, squares, variance, var.data());
      norm_bf16(hidden, w.post_norm, w.eps, var.data(), x.data());
      const int64_t inter = w.gate.out_features;
      Product up_out, gate_out;
      Columns up, gate_in;
      if (w.gate_up) {
        up_out = int4_mm(x.data(), n, width, *w.gate_up, product.data());
        gate_in = columns(up_out, 0, w.gate_up->bias, 0);
        up = columns(up_out, inter, w.gate_up->bias, inter);
      } else {
        gate_out = int4_mm(x.data(), n, width, w.gate, product.data());
        up_out = int4_mm(x.data(), n, width, w.up, product.data() + n * inter);
        gate_in = columns(gate_out, 0, w.gate.bias, 0);
        up = columns(up_out, 0, w.up.bias, 0);
      }
      // gate_proj's output as float32 (`.to(float32)` + bias), a contiguous [N, I], then ATen's SiLU in place (its
      // vectorised exp: the one elementwise op not written out here)
      Tensor g = inter == inter_max_ ? gate : at::empty({n, inter}, hidden.options());
      float* gp = g.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) gate_in.load(r, 0, inter, gp + r * inter);
      at::silu_(g);
      uint16_t* actp = x.data();  // down_proj's cast
      for (int64_t r = 0; r < n; ++r) {
        up.load(r, 0, inter, scratch.data());
        const float* sr = gp + r * inter;
        uint16_t* dst = actp + r * inter;
        for (int64_t j = 0; j < inter; ++j) dst[j] = bf16_bits(sr[j] * scratch[j]);
      }
      const Product down = int4_mm(actp, n, inter, w.down, product.data());
      residual_add(hidden, columns(down, 0, w.down.bias, 0), scratch.data());
    }
    return final_norm_.numel() ? rms_norm(hidden, final_norm_, final_eps_) : hidden;
  }

  // True when the norms' variance is computed here (sum_of_squares, checked against ATen at construction).
  bool own_mean() const { return own_mean_; }

  // How many layers run q/k/v, and gate/up, as one product each.
  std::vector<int64_t> fused() const {
    int64_t qkv = 0, gate_up = 0;
    for (const Layer& w : layers_) qkv += w.qkv.has_value(), gate_up += w.gate_up.has_value();
    return {qkv, gate_up};
  }

 private:
  // The boolean mask [1, 1, N, L] transformers' sdpa_mask makes for a pass of a prompt's reading of N rows whose keys
  // are L, the pass's N entries last (row i sees keys 0 .. L-N+i), or an undefined tensor where it makes none (one row,
  // or an empty cache: is_causal does the work). One per pass: every layer's attention reads it.
  static Tensor reading_mask(int64_t n, int64_t length) {
    if (n == 1 || length == n) return Tensor();
    return at::arange(length).unsqueeze(0).le(at::arange(length - n, length).unsqueeze(1)).view({1, 1, n, length});
  }

  // transformers' sdpa_attention_forward as it runs for a pass of a prompt's reading (query [1, Hq, N, Dh], key /
  // value [1, Hkv, L, Dh] with the pass's N entries last, `mask` reading_mask's; returns [1, N, Hq, Dh]):
  // grouped-query attention by SDPA's enable_gqa without a mask and by repeat_kv's copies with one, and the output as
  // its transpose(1, 2).contiguous().
  Tensor reading(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& mask, bool gqa) const {
    const int64_t n = query.size(2), length = key.size(2);
    if (!mask.defined()) {
      return at::scaled_dot_product_attention(query, key, value, {}, 0.0, n > 1, scaling_, gqa).transpose(1, 2).contiguous();
    }
    Tensor k = key, v = value;
    if (gqa) {  // repeat_kv: [1, Hkv, L, Dh] -> [1, Hq, L, Dh]
      const int64_t groups = num_heads_ / num_kv_heads_;
      k = key.unsqueeze(2).expand({1, num_kv_heads_, groups, length, head_dim_}).reshape({1, num_heads_, length, head_dim_});
      v = value.unsqueeze(2).expand({1, num_kv_heads_, groups, length, head_dim_}).reshape({1, num_heads_, length, head_dim_});
    }
    return at::scaled_dot_product_attention(query, k, v, mask, 0.0, false, scaling_, false).transpose(1, 2).contiguous();
  }

  // invariant.py rowwise_attention for a pass of at most MAX_ROWWISE rows of one sequence.
  Tensor attention(const Tensor& query, const Tensor& key, const Tensor& value, const std::vector<Group>& groups,
                   bool in_order, bool gqa) const {
    const int64_t n = query.size(2);
    if (groups.empty()) {  // one-token decoding: every key, as a view of the cache
      TORCH_CHECK(n == 1, "a pass of ", n, " rows needs its row groups");
      Tensor out = at::scaled_dot_product_attention(query, key, value, {}, 0.0, false, scaling_, gqa);
      return out.transpose(1, 2);
    }
    std::vector<Tensor> outs;
    for (const Group& g : groups) {
      Tensor k, v;
      if (g.view) {
        k = key.slice(2, 0, g.count);
        v = value.slice(2, 0, g.count);
      } else {  // [Hkv, B·count, Dh] -> [B, Hkv, count, Dh]
        std::vector<int64_t> shape = {key.size(1), g.index.size(0), g.count, key.size(3)};
        k = key[0].index_select(1, g.keys).view(shape).transpose(0, 1);
        v = value[0].index_select(1, g.keys).view(shape).transpose(0, 1);
      }
      Tensor q = g.span ? query[0].slice(1, g.first, g.last) : query[0].index_select(1, g.index);  // [H, B, Dh]
      outs.push_back(at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(2), k, v, {}, 0.0, false,
                                                      scaling_, gqa));
    }
    Tensor rows = outs.size() == 1 ? outs[0] : at::cat(outs);  // [ΣB, H, 1, Dh]
    if (in_order) {
      return rows.view({1, n, query.size(1), query.size(3)});
    }
    std::vector<Tensor> indices;
    for (const Group& g : groups) indices.push_back(g.index);
    return rows.new_empty(rows.sizes()).index_copy_(0, at::cat(indices), rows).view({1, n, query.size(1), query.size(3)});
  }

  std::vector<Layer> layers_;
  Tensor final_norm_;  // empty: none (an EAGLE drafter's layer, medusa_core/eagle.py)
  double final_eps_;
  int64_t width_;  // the hidden width
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scaling_;
  int64_t widest_in_ = 0, widest_out_ = 0, inter_max_ = 0;  // a pass's buffer widths (the constructor)
  bool own_mean_;  // the norms' variance by sum_of_squares (ATen's bits, checked at construction), else ATen's calls
  bool row_kernel_;  // attention by row_attention (the model's attention is invariant.py kernel_attention)
};

}  // namespace medusa_lean
