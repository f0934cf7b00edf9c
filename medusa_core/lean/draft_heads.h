// The heads' proposal for the lean step (lean_step.cpp) and lean/drafting.py: the residual blocks of K Medusa heads
// over one hidden state, and each head's top-k with its log-probabilities, in two calls instead of a dozen ATen ops.
//
// A proposal runs once per step on weights the backbone's pass has just evicted from the caches (about 3 MB for the
// demo's depth-1 tree), so it is bound by how fast one matrix-vector product pulls its rows from memory: ATen's
// bfloat16 product of a [1, 576] by [576, 576] took 135 µs cold, this one (rows split over the threads, 32-pair
// bfloat16 dot products) 44 µs (docs/BENCH.md, "The heads' proposal"). Drafts only rank tokens: the backbone
// verifies every one, so these values need not be ATen's bits (they differ from them by bfloat16 rounding), only
// the same for the same input on the same CPU (each output row is one thread's fixed-order sum).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "row_attention.h"
#include "top_columns.h"

namespace medusa_lean {

// True where this build has the CPU's bfloat16 dot product (AVX512-BF16); elsewhere bf16_dot is a scalar loop.
inline bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Σ_i w[i]·x[i] over n bfloat16 pairs, accumulated in float32.
inline float bf16_dot(const at::BFloat16* w, const at::BFloat16* x, int64_t n) {
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
  }
  if (i < n) {
    const __mmask32 tail = (__mmask32)((1ull << (n - i)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + i), (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i));
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(w[i]) * static_cast<float>(x[i]);
  return acc;
#endif
}

// x[o] += f(Σ_i W[o, i]·v[i] + b[o]) for o < O (W [O, n] bfloat16, v n bfloat16), rows split over the threads.
template <typename F>
void matvec_add(const Tensor& W, const at::BFloat16* v, const float* b, float* x, F f) {
  const int64_t rows = W.size(0), n = W.size(1);
  const at::BFloat16* w = W.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) x[o] += f(bf16_dot(w + o * n, v, n) + (b ? b[o] : 0.0f));
  });
}

// The heads' inputs to their projections, [K, H] bfloat16 (MedusaHeads.block_states, paper 2.1.1): for head k,
// x = hidden (+ R_k · e for root-conditioned heads, e = row `root` of `embedding`), then for each of its L blocks
// x = x + SiLU(W x + b), x in float32, each product reading x rounded to bfloat16.
//   hidden [H] float32; embedding [V, H] bfloat16 (the root's row is read in place) or empty; root_weight [K, H, H]
//   bfloat16 or empty; weights: K·L tensors [H, H] bfloat16 (head-major); biases: K·L tensors [H] (any float dtype).
inline Tensor head_states(const Tensor& hidden, const Tensor& embedding, int64_t root, const Tensor& root_weight,
                          const std::vector<Tensor>& weights, const std::vector<Tensor>& biases, int64_t num_heads) {
  TORCH_CHECK(hidden.dim() == 1 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(), "hidden must be [H] float32");
  const int64_t H = hidden.size(0);
  TORCH_CHECK(num_heads >= 1 && weights.size() == biases.size() && weights.size() % num_heads == 0, "weights and biases must be K·L each");
  const int64_t L = static_cast<int64_t>(weights.size()) / num_heads;
  const bool rooted = embedding.numel() > 0;
  if (rooted) {
    TORCH_CHECK(embedding.scalar_type() == at::kBFloat16 && embedding.dim() == 2 && embedding.size(1) == H && embedding.is_contiguous(),
                "embedding must be contiguous [V, H] bfloat16");
    TORCH_CHECK(root >= 0 && root < embedding.size(0), "root must be a row of the embedding");
    TORCH_CHECK(root_weight.scalar_type() == at::kBFloat16 && root_weight.dim() == 3 && root_weight.size(0) >= num_heads &&
                root_weight.size(1) == H && root_weight.size(2) == H, "root_weight must be [≥ K, H, H] bfloat16");
  }
  const at::BFloat16* root_row = rooted ? embedding.data_ptr<at::BFloat16>() + root * H : nullptr;
  Tensor out = at::empty({num_heads, H}, hidden.options().dtype(at::kBFloat16));
  std::vector<float> x(H);
  std::vector<at::BFloat16> xb(H);
  auto identity = [](float u) { return u; };
  auto silu = [](float u) { return u / (1.0f + std::exp(-u)); };
  for (int64_t k = 0; k < num_heads; ++k) {
    std::memcpy(x.data(), hidden.data_ptr<float>(), H * sizeof(float));
    if (rooted) matvec_add(root_weight[k].contiguous(), root_row, nullptr, x.data(), identity);
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t i = 0; i < H; ++i) xb[i] = static_cast<at::BFloat16>(x[i]);  // the block reads x as it started
      const Tensor& W = weights[k * L + l];
      TORCH_CHECK(W.scalar_type() == at::kBFloat16 && W.is_contiguous() && W.size(0) == H && W.size(1) == H, "block weights must be [H, H] bfloat16");
      const Tensor bias = biases[k * L + l].to(at::kFloat).contiguous();
      matvec_add(W, xb.data(), bias.data_ptr<float>(), x.data(), silu);
    }
    at::BFloat16* o = out[k].data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < H; ++i) o[i] = static_cast<at::BFloat16>(x[i]);
  }
  return out;
}

// The top `k` of one row of logits [S] float32 and their log-probabilities under softmax(row · inv_t): columns into
// where[0..k−1] (best first, ties to the lower column), log-probabilities into log_p[0..k−1]; `scaled` holds S floats
// rounded up to whole 16 lanes and `best` k (draft_top's work on each row, and the EAGLE drafter's chain's).
inline void row_top(const float* row, int64_t S, int64_t k, float inv_t, std::vector<float>& scaled, float* best,
                    int64_t* where, float* log_p) {
  top_columns(row, S, k, best, where);
  scaled.assign((S + kLanes - 1) / kLanes * kLanes, -INFINITY);
  for (int64_t j = 0; j < S; ++j) scaled[j] = row[j] * inv_t;
  const int64_t padded = static_cast<int64_t>(scaled.size());  // a whole number of 16 lanes, −∞ past S
  const float top = row_max(scaled.data(), padded);
  const float lse = top + std::log(row_exp_sum(scaled.data(), padded, top));
  for (int64_t j = 0; j < k; ++j) log_p[j] = row[where[j]] * inv_t - lse;
}

// Each row's top `k` of logits [D, S] (bfloat16 or float32) and their log-probabilities under
// softmax(logits / temperatures[d]): (indices [D, k] int64, best first, ties to the lower index;
// log_p [D, k] float32). The log-sum-exp is a fixed-order sum (16 lanes, then a fixed tree).
inline std::tuple<Tensor, Tensor> draft_top(const Tensor& logits, int64_t k, const Tensor& temperatures) {
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "need logits [D, S] and 1 <= k <= S");
  const Tensor z = logits.to(at::kFloat).contiguous();
  const Tensor t = temperatures.to(at::kFloat).contiguous();
  TORCH_CHECK(t.numel() == z.size(0), "one temperature per row");
  const int64_t D = z.size(0), S = z.size(1);
  Tensor indices = at::empty({D, k}, z.options().dtype(at::kLong));
  Tensor log_p = at::empty({D, k}, z.options());
  std::vector<float> scaled, best(k);
  for (int64_t d = 0; d < D; ++d) {
    row_top(z.data_ptr<float>() + d * S, S, k, 1.0f / t.data_ptr<float>()[d], scaled, best.data(),
            indices.data_ptr<int64_t>() + d * k, log_p.data_ptr<float>() + d * k);
  }
  return {indices, log_p};
}

}  // namespace medusa_lean
