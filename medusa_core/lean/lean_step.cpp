// The lean decoding step (medusa_core/lean): the decoder layers of a Llama-family model with int4 linears,
// for the short passes of decoding (one token, or a tree's few rows), in one call from Python.
//
// Every tensor operation below is the ATen operation that transformers' Llama modules and this project's
// layers (quant/layers.py Int4Linear, invariant.py rowwise_attention, kvcache.py GrowingLayer) call, on the
// same shapes, in the same order, so the results are the same bits; only the Python between them is gone.
// tests/test_lean.py compares the two paths bit for bit.

#include <torch/extension.h>

#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kGroupSize = 32;  // quant/layers.py GROUP_SIZE

struct Int4 {
  Tensor packed, scale_zero;
  c10::optional<Tensor> bias;
  int64_t out_features;
};

// Int4Linear.forward: x rounded to bfloat16, the int4-pack kernel, back to x's dtype, then the bias.
Tensor int4_linear(const Tensor& x, const Int4& w) {
  auto shape = x.sizes().vec();
  Tensor flat = x.reshape({-1, x.size(-1)}).to(at::kBFloat16);
  Tensor out = at::_weight_int4pack_mm_for_cpu(flat, w.packed, kGroupSize, w.scale_zero);
  shape.back() = w.out_features;
  out = out.to(x.scalar_type()).reshape(shape);
  return w.bias ? out + w.bias->to(out.scalar_type()) : out;
}

// LlamaRMSNorm.forward.
Tensor rms_norm(const Tensor& h, const Tensor& weight, double eps) {
  Tensor x = h.to(at::kFloat);
  Tensor variance = x.pow(2).mean(-1, true);
  x = x * at::rsqrt(variance + eps);
  return weight * x.to(h.scalar_type());
}

// rotate_half / apply_rotary_pos_emb of modeling_llama (cos, sin already unsqueezed to [1, 1, N, Dh]).
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  int64_t half = x.size(-1) / 2;
  Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (rotated * sin);
}

// Several int4 linears of the same input as one: their packed rows and scales side by side. The int4-pack kernel
// computes every output on its own (one float32 accumulator, K never split), so each output keeps its bits;
// fewer, larger calls cost less on two cores (on the demo, q/k/v 34 -> 21 us, gate/up 60 -> 54 us a token).
// The packed layout comes in tiles of rows (64 on this CPU), so side by side is the same layout only when the
// parts fill whole tiles: a probe product decides, bit for bit. Linears that mix bias and no bias are not fused.
c10::optional<Int4> fuse(const std::vector<const Int4*>& parts) {
  std::vector<Tensor> packed, scale_zero, bias;
  int64_t out = 0;
  for (const Int4* p : parts) {
    if (p->bias.has_value() != parts[0]->bias.has_value()) return c10::nullopt;
    packed.push_back(p->packed);
    scale_zero.push_back(p->scale_zero);
    if (p->bias) bias.push_back(*p->bias);
    out += p->out_features;
  }
  Int4 fused{at::cat(packed, 0), at::cat(scale_zero, 1),
             bias.empty() ? c10::nullopt : c10::optional<Tensor>(at::cat(bias, 0)), out};
  Tensor probe = at::randn({3, parts[0]->packed.size(1) * 2});  // K = 2 × the packed bytes per row
  std::vector<Tensor> separate;
  for (const Int4* p : parts) separate.push_back(int4_linear(probe, *p));
  if (!at::equal(int4_linear(probe, fused), at::cat(separate, -1))) return c10::nullopt;
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
              double scaling)
      : final_norm_(std::move(final_norm)), final_eps_(final_eps), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), scaling_(scaling) {
    // Per layer: input_norm, post_norm, then (packed, scale_zero, bias or empty) for q, k, v, o, gate, up, down.
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
  }

  // hidden [1, N, H] (the token embeddings), cos / sin [1, N, Dh] (the model's rotary embedding), the cache's
  // buffers [1, Hkv, C, Dh] per layer holding `length` entries (room for N more), and the pass's row groups
  // (none: one row that sees every key). Writes the N new entries at length .. length+N−1 of every buffer.
  // Returns the final-norm hidden states [1, N, H].
  Tensor forward(Tensor hidden, const Tensor& cos_in, const Tensor& sin_in, const std::vector<Tensor>& key_buffers,
                 const std::vector<Tensor>& value_buffers, int64_t length,
                 const std::vector<std::vector<int64_t>>& group_ints, const std::vector<Tensor>& group_index,
                 const std::vector<Tensor>& group_keys) {
    TORCH_CHECK(key_buffers.size() == layers_.size() && value_buffers.size() == layers_.size(),
                "one key and one value buffer per layer");
    at::NoGradGuard no_grad;
    const int64_t n = hidden.size(1);
    std::vector<Group> groups;
    for (size_t g = 0; g < group_ints.size(); ++g) {
      const auto& v = group_ints[g];  // first, last, span, count, view
      groups.push_back(Group{v[0], v[1], v[2] != 0, group_index[g], v[3], v[4] != 0, group_keys[g]});
    }
    bool in_order = true;  // every group a span, each starting where the last ended: rows come out in order
    for (size_t g = 0; g < groups.size(); ++g) {
      in_order = in_order && groups[g].span && (g == 0 || groups[g - 1].last == groups[g].first);
    }
    Tensor cos = cos_in.unsqueeze(1), sin = sin_in.unsqueeze(1);  // [1, 1, N, Dh]
    const bool gqa = num_heads_ != num_kv_heads_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      Tensor residual = hidden;
      Tensor x = rms_norm(hidden, w.input_norm, w.eps);
      // LlamaAttention.forward
      Tensor q, k, v;
      if (w.qkv) {
        Tensor qkv = int4_linear(x, *w.qkv);
        q = qkv.narrow(-1, 0, w.q.out_features);
        k = qkv.narrow(-1, w.q.out_features, w.k.out_features);
        v = qkv.narrow(-1, w.q.out_features + w.k.out_features, w.v.out_features);
      } else {
        q = int4_linear(x, w.q), k = int4_linear(x, w.k), v = int4_linear(x, w.v);
      }
      q = q.view({1, n, -1, head_dim_}).transpose(1, 2);
      k = k.view({1, n, -1, head_dim_}).transpose(1, 2);
      v = v.view({1, n, -1, head_dim_}).transpose(1, 2);
      q = rotary(q, cos, sin);
      k = rotary(k, cos, sin);
      // GrowingLayer.update: the new entries written in place, the cache read through views
      key_buffers[i].slice(2, length, length + n).copy_(k);
      value_buffers[i].slice(2, length, length + n).copy_(v);
      Tensor keys = key_buffers[i].slice(2, 0, length + n), values = value_buffers[i].slice(2, 0, length + n);
      Tensor attn = attention(q, keys, values, groups, in_order, gqa);  // [1, N, Hq, Dh]
      attn = attn.reshape({1, n, -1}).contiguous();
      hidden = residual + int4_linear(attn, w.o);
      // LlamaMLP.forward
      residual = hidden;
      x = rms_norm(hidden, w.post_norm, w.eps);
      Tensor act;
      if (w.gate_up) {
        Tensor gate_up = int4_linear(x, *w.gate_up);
        act = at::silu(gate_up.narrow(-1, 0, w.gate.out_features)) * gate_up.narrow(-1, w.gate.out_features, w.up.out_features);
      } else {
        act = at::silu(int4_linear(x, w.gate)) * int4_linear(x, w.up);
      }
      hidden = residual + int4_linear(act, w.down);
    }
    return rms_norm(hidden, final_norm_, final_eps_);
  }

  // How many layers run q/k/v, and gate/up, as one product each.
  std::vector<int64_t> fused() const {
    int64_t qkv = 0, gate_up = 0;
    for (const Layer& w : layers_) qkv += w.qkv.has_value(), gate_up += w.gate_up.has_value();
    return {qkv, gate_up};
  }

 private:
  // invariant.py rowwise_attention for a pass of at most MAX_ROWWISE rows of one sequence.
  Tensor attention(const Tensor& query, const Tensor& key, const Tensor& value, const std::vector<Group>& groups,
                   bool in_order, bool gqa) const {
    const int64_t n = query.size(2);
    if (groups.empty()) {  // one-token decoding: every key, as a view of the cache
      TORCH_CHECK(n == 1, "a pass of ", n, " rows needs its row groups");
      Tensor out = at::scaled_dot_product_attention(query, key, value, {}, 0.0, false, scaling_, gqa);
      return out.transpose(1, 2).contiguous();
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
  Tensor final_norm_;
  double final_eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scaling_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LeanDecoder>(m, "LeanDecoder")
      .def(pybind11::init<std::vector<std::vector<Tensor>>, std::vector<double>, std::vector<int64_t>, Tensor, double,
                          int64_t, int64_t, int64_t, double>())
      .def("forward", &LeanDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("fused", &LeanDecoder::fused);
}
