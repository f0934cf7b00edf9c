// The EAGLE-style drafter's passes (medusa_core/eagle.py EagleDrafts) in one call each: reading the accepted rows
// (eagle_observe) and proposing a chain (eagle_chain). From Python a draft was nine calls (the 4-bit fc, an embedding,
// the layer, the projection, its top, the casts and slices between them): a chain of five drafts cost 3.24 ms, 2.61 ms
// in one call (docs/BENCH.md, "The drafter's chain in one call").
//
// Every value is the one those Python calls computed, in the same order: the fc's input is the state rounded to
// bfloat16 beside the token's embedding (Int4Linear's cast of the concatenated float32 row), the fc's and the
// projection's outputs bfloat16 read back as float32, the layer the lean decoder's (decoder.h), the draft's
// log-probability draft_top's (row_top at temperature 1) summed along the chain in double precision as Python's floats.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "decoder.h"
#include "draft_heads.h"

namespace medusa_lean {

// A bias-free 4-bit linear of `n` outputs from Int4Linear.kernel_weights (weights, scales).
inline Int4 bare_int4(const std::vector<Tensor>& weights, int64_t n) {
  TORCH_CHECK(weights.size() == 2, "a 4-bit linear's (weights, scales)");
  return Int4{weights[0], weights[1], c10::nullopt, n};
}

// The drafter's layer input fc([f_i, e(x_i)]) of r rows: states [r, H] float32 (rows H apart), tokens[i] the token
// after each, embed [V, H] the backbone's embedding table (bfloat16 or float32). Returns [1, r, H] float32.
inline Tensor drafter_input(const float* states, int64_t r, const int64_t* tokens, const Tensor& embed, const Int4& fc) {
  const int64_t h = fc.out_features, vocab = embed.size(0);
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == h && embed.is_contiguous(), "the embedding table: contiguous [V, ", h, "]");
  std::vector<uint16_t> x(r * 2 * h), product(r * h);
  for (int64_t i = 0; i < r; ++i) {
    uint16_t* row = x.data() + i * 2 * h;
    for (int64_t j = 0; j < h; ++j) row[j] = bf16_bits(states[i * h + j]);
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "token ", tokens[i], " is outside the embedding's ", vocab, " rows");
    if (embed.scalar_type() == at::kBFloat16) {
      std::memcpy(row + h, reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>()) + tokens[i] * h, h * sizeof(uint16_t));
    } else {
      TORCH_CHECK(embed.scalar_type() == at::kFloat, "the embedding table: bfloat16 or float32");
      const float* e = embed.data_ptr<float>() + tokens[i] * h;
      for (int64_t j = 0; j < h; ++j) row[h + j] = bf16_bits(e[j]);
    }
  }
  const Product out = int4_mm(x.data(), r, 2 * h, fc, product.data());
  Tensor result = at::empty({1, r, h}, at::kFloat);
  const Columns read = columns(out, 0, c10::nullopt, 0);
  for (int64_t i = 0; i < r; ++i) read.load(i, 0, h, result.data_ptr<float>() + i * h);
  return result;
}

// The drafter's layer over rows x [1, r, H] at positions length .. length + r − 1, each attending to the cache's
// entries before it and the rows before it; writes their keys and values there. cache [2, 1, heads, C, Dh] (keys,
// values); cos / sin [C, Dh] for positions 0 .. C − 1. Returns [1, r, H].
inline Tensor drafter_layer(LeanDecoder& layer, const Tensor& x, const Tensor& cache, const Tensor& cos, const Tensor& sin,
                            int64_t length) {
  const int64_t r = x.size(1);
  TORCH_CHECK(length + r <= cache.size(3) && length + r <= cos.size(0), "the drafter's cache holds ", cache.size(3),
              " entries; ", length + r, " asked");
  std::vector<int64_t> prefix(r), offsets(r + 1, 0);  // causal: row i sees keys 0 .. length + i
  for (int64_t i = 0; i < r; ++i) prefix[i] = length + i + 1;
  return layer.forward(x, cos.slice(0, length, length + r).unsqueeze(0), sin.slice(0, length, length + r).unsqueeze(0),
                       {cache.select(0, 0)}, {cache.select(0, 1)}, length, {}, {}, {}, prefix, offsets,
                       at::empty({0}, at::kLong), kModel);
}

// EagleDrafts.observe's pass: the accepted rows' states [r, H] float32 with the token after each, read by the layer
// `chunk` rows a call at positions length .. length + r − 1 (drafter_layer). fc: (weights, scales) of its H outputs.
// Returns the last row's output [1, H].
inline Tensor eagle_observe(LeanDecoder& layer, const std::vector<Tensor>& fc, const Tensor& embed, const Tensor& states,
                            const std::vector<int64_t>& tokens, const Tensor& cache, const Tensor& cos, const Tensor& sin,
                            int64_t length, int64_t chunk) {
  const int64_t r = states.size(0), h = states.size(1);
  TORCH_CHECK(r >= 1 && static_cast<int64_t>(tokens.size()) == r && chunk >= 1, "one token after each of ≥ 1 states");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous(), "states: contiguous float32 [r, H]");
  const Tensor x = drafter_input(states.data_ptr<float>(), r, tokens.data(), embed, bare_int4(fc, h));
  Tensor out;
  for (int64_t begin = 0; begin < r; begin += chunk) {
    const int64_t end = std::min(r, begin + chunk);
    out = drafter_layer(layer, x.slice(1, begin, end).contiguous(), cache, cos, sin, length + begin);
  }
  return out[0].slice(0, out.size(1) - 1).clone();
}

// EagleDrafts.propose's chain from the last output `last` [1, H] float32 (the cache holding `length` entries): each
// draft is the best column of projection(out) (its S draft tokens: draft_ids [S] int64, or empty for ids 0..S − 1),
// kept while the sum of the drafts' log-probabilities stays ≥ log_threshold, at most `most`; each draft but the last
// is read by the layer at the next position (its entry past `length`: the next observe writes over it). Returns the
// drafts' token ids. Its one-row products take the AVX512-BF16 dot products even where AMX runs (OneRowDots).
inline std::vector<int64_t> eagle_chain(LeanDecoder& layer, const std::vector<Tensor>& fc, const std::vector<Tensor>& projection,
                                        int64_t draft_vocabulary, const Tensor& draft_ids, const Tensor& embed,
                                        const Tensor& last, const Tensor& cache, const Tensor& cos, const Tensor& sin,
                                        int64_t length, int64_t most, double log_threshold) {
  const int64_t h = last.size(1), s = draft_vocabulary;
  TORCH_CHECK(last.dim() == 2 && last.size(0) == 1 && last.scalar_type() == at::kFloat, "last: float32 [1, H]");
  TORCH_CHECK(draft_ids.numel() == 0 || (draft_ids.numel() == s && draft_ids.scalar_type() == at::kLong && draft_ids.is_contiguous()),
              "draft_ids: empty or contiguous int64 [", s, "]");
  const OneRowDots dots;  // the chain's products are of one row each: the dot products, even where AMX runs
  const Int4 fc_w = bare_int4(fc, h), projection_w = bare_int4(projection, s);
  std::vector<uint16_t> x(h), product(s);
  std::vector<float> logits(s), scaled, best(1);
  std::vector<int64_t> drafts;
  Tensor out = last.contiguous();
  double log_chance = 0.0;
  while (static_cast<int64_t>(drafts.size()) < most) {
    const float* o = out.data_ptr<float>();
    for (int64_t j = 0; j < h; ++j) x[j] = bf16_bits(o[j]);
    const Product p = int4_mm(x.data(), 1, h, projection_w, product.data());
    columns(p, 0, c10::nullopt, 0).load(0, 0, s, logits.data());
    int64_t column;
    float log_p;
    row_top(logits.data(), s, 1, 1.0f, scaled, best.data(), &column, &log_p);
    log_chance += log_p;
    if (log_chance < log_threshold) break;
    const int64_t token = draft_ids.numel() ? draft_ids.data_ptr<int64_t>()[column] : column;
    drafts.push_back(token);
    if (static_cast<int64_t>(drafts.size()) < most) {
      const Tensor input = drafter_input(o, 1, &token, embed, fc_w);
      out = drafter_layer(layer, input, cache, cos, sin, length + static_cast<int64_t>(drafts.size()) - 1)[0];
    }
  }
  return drafts;
}

}  // namespace medusa_lean
