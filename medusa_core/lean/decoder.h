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

#include "decoder_ops.h"
#include "row_attention.h"

namespace medusa_lean {

// How a pass attends (LeanDecoder::forward's `attention_mode`; medusa_core/lean/step.py names them).
constexpr int64_t kModel = 0, kRowGroups = 1, kReading = 2;

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
