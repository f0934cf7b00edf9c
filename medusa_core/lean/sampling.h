// Sampling at the app's chat settings in compiled calls: the filters of processors.py NodeProcessors decided on each
// row's top slice, and acceptance.py draw.
//
// Through ATen a one-row step at the chat preset (penalty, temperature, top-p) spent ~0.18 ms in the filters, two
// dozen small ops on [M, 64] slices after a top-k over the row, and ~0.1 ms drawing the token: a softmax over the
// 49,152 scores and a float64 cumulative sum over all of them, one dependent addition per token (docs/BENCH.md,
// "Sampling in compiled calls"). Here the slice is one pass over the row (top_columns), its decisions a loop over
// 64 values, and a draw sums the weights 16 at a time, then walks the sums of one block. The kept scores are the
// input's own values, so the filtered rows are HF's wherever the kept sets agree; they can differ only where a
// token's share lies within float rounding of a threshold (the sums run in another order), as with the ATen path.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_attention.h"
#include "top_columns.h"

namespace medusa_lean {

// softmax over a slice's kept values, or over the whole row gathered at the slice: p[j] for j < c.
//   best [c] (descending), keep [c], whole: over the kept values (those that remain of the row); else over the row,
//   whose largest value is best[0] and whose Σ e^(x − best[0]) is row_total.
inline void slice_probs(const float* best, const uint8_t* keep, int64_t c, bool whole, float row_total, float* p) {
  if (!whole) {
    for (int64_t j = 0; j < c; ++j) p[j] = std::exp(best[j] - best[0]) / row_total;
    return;
  }
  float top = -INFINITY, total = 0.0f;
  for (int64_t j = 0; j < c; ++j) top = keep[j] && best[j] > top ? best[j] : top;
  for (int64_t j = 0; j < c; ++j) total += keep[j] ? std::exp(best[j] - top) : 0.0f;
  for (int64_t j = 0; j < c; ++j) p[j] = keep[j] ? std::exp(best[j] - top) / total : 0.0f;
}

// NodeProcessors' repetition penalty and temperature in one call: logits [M, V] float32 -> scores [M, V] float32, a new
// tensor. Each score is the logit divided by `temperature` (TemperatureLogitsWarper; temperature 0: not divided, as
// greedy decoding applies no warper), except each id of its row's prefix (ids [M, L] int64; an id outside 0..V−1
// changes nothing, as in RepetitionPenaltyLogitsProcessor), whose logit is first multiplied by `penalty` where negative
// and divided by it elsewhere. Every step is the float32 operation ATen makes on a float32 tensor and a Python float
// (the scalar rounded to float32, no fused operations: the build's -ffp-contract=off), so the scores are the bits of
// the ATen path (processors.py _penalise, then div_), which took ~0.1 ms a call on the demo in eight small ops.
inline Tensor penalise_rows(const Tensor& logits_in, const Tensor& ids_in, double penalty, double temperature) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat, "penalise_rows: logits must be [M, V] float32");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.scalar_type() == at::kLong && ids_in.size(0) == logits_in.size(0),
              "penalise_rows: ids must be [M, L] int64, a row per logits row");
  TORCH_CHECK(penalty > 0 && temperature >= 0, "penalise_rows: need penalty > 0 and temperature >= 0");
  const Tensor logits = logits_in.contiguous(), ids = ids_in.contiguous();
  const int64_t M = logits.size(0), V = logits.size(1), L = ids.size(1);
  Tensor out = at::empty({M, V}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* id = ids.data_ptr<int64_t>();
  float* y = out.data_ptr<float>();
  const float p = static_cast<float>(penalty), t = static_cast<float>(temperature);
  const bool warp = temperature > 0;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * V;
      float* o = y + m * V;
      if (warp) {
        for (int64_t j = 0; j < V; ++j) o[j] = row[j] / t;
      } else {
        std::memcpy(o, row, V * sizeof(float));
      }
      for (int64_t i = 0; i < L; ++i) {
        const int64_t j = id[m * L + i];
        if (j < 0 || j >= V) continue;
        const float penalised = row[j] < 0 ? row[j] * p : row[j] / p;
        o[j] = warp ? penalised / t : penalised;
      }
    }
  });
  return out;
}

// NodeProcessors._filter_on_slice, in place on scores [M, V] float32 (after the penalty and the temperature): each
// row's top-k (k = top_k, 0: off), top-p (top_p ≥ 1: off) and min-p (min_p ≤ 0: off) decided on its `width` largest
// scores, in HF's order, every removed token set to −∞. Returns false, changing nothing, when some row's kept set may
// reach past its slice (top-k: a tie with the k-th past the slice; top-p: the slice holds less than top_p of the
// mass; min-p alone: the slice's last token passes); the caller then runs HF's filters over the whole rows.
inline bool filter_slice(Tensor scores, int64_t width, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "filter_slice: scores must be contiguous [M, V] float32");
  const int64_t M = scores.size(0), V = scores.size(1);
  TORCH_CHECK(width >= 1 && width <= V && top_k >= 0 && (top_k == 0 || top_k >= V || top_k < width),
              "filter_slice: need 1 <= width <= V and 0 <= top_k < width (or top_k >= V)");
  float* data = scores.data_ptr<float>();
  const int64_t c = width;
  std::vector<float> best(M * c);
  std::vector<int64_t> where(M * c);
  std::vector<uint8_t> keep(M * c, 1), cut_short(M, 0);
  const float p_top = static_cast<float>(top_p), p_min = static_cast<float>(min_p);
  // rows over torch's threads (each row start to end by one thread: the split changes no value)
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(c);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * V;
      float* b = best.data() + r * c;
      uint8_t* k = keep.data() + r * c;
      top_columns(row, V, c, b, where.data() + r * c);
      bool whole = c == V, short_row = false;  // whole: nothing of the row that is still kept lies past the slice
      const bool row_softmax = !whole && (top_p < 1 || min_p > 0) && !(top_k > 0 && top_k < V);
      const float row_total = row_softmax ? row_exp_sum(row, V, b[0]) : 0.0f;
      if (top_k > 0 && top_k < V) {  // HF removes the scores below the k-th
        const float kth = b[top_k - 1];
        for (int64_t j = 0; j < c; ++j) k[j] = b[j] >= kth;
        short_row |= !whole && b[c - 1] >= kth;  // a tie with the k-th may lie past the slice
        whole = true;
      }
      if (top_p < 1) {  // HF keeps a token while the mass of the more likely kept tokens is below top_p
        slice_probs(b, k, c, whole, row_total, p.data());
        float cumulative = 0.0f;
        for (int64_t j = 0; j < c; ++j) {
          const float above = cumulative;
          cumulative += p[j];
          k[j] = k[j] && above < p_top;
        }
        short_row |= !whole && cumulative < p_top;
        whole = true;
      }
      if (min_p > 0) {  // p over the kept tokens; the slice's first token is the most likely
        slice_probs(b, k, c, whole, row_total, p.data());
        const float floor = p_min * p[0];
        short_row |= !whole && p[c - 1] >= floor;  // min-p alone: a later token may pass too
        for (int64_t j = 0; j < c; ++j) k[j] = k[j] && p[j] >= floor;
      }
      cut_short[r] = short_row;
    }
  });
  for (int64_t r = 0; r < M; ++r)
    if (cut_short[r]) return false;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = data + r * V;
      std::fill(row, row + V, -INFINITY);
      for (int64_t j = 0; j < c; ++j)
        if (keep[r * c + j]) row[where[r * c + j]] = best[r * c + j];
    }
  });
  return true;
}

// One index i of values [V] float32 drawn with probability w_i / Σ w: w = values (finite, ≥ 0, not all zero), or with
// `logits` w = e^(values − max) (softmax's weights; −∞ gives 0), for u a uniform draw in [0, 1). The weights are summed
// 16 at a time (float32, a fixed tree) into block sums, accumulated in float64; the block where the running sum passes
// u · total is walked one weight at a time. An index of zero weight is never taken: where rounding leaves u · total at
// or past the end, the last index of nonzero weight is.
inline int64_t draw_index(const Tensor& values, double u, bool logits) {
  TORCH_CHECK(values.dim() == 1 && values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() > 0,
              "draw_index: values must be a contiguous [V] float32");
  const float* x = values.data_ptr<float>();
  const int64_t V = values.numel(), blocks = (V + kLanes - 1) / kLanes;
  const float top = logits ? row_max(x, V) : 0.0f;
  TORCH_CHECK(std::isfinite(top), "draw_index: every score is -inf or the largest is not finite");
  auto block_weights = [&](int64_t b, float* w) {  // the 16 weights of block b, zero past the end
    const int64_t j0 = b * kLanes, n = std::min<int64_t>(kLanes, V - j0);
    f16v wv;
    if (n == kLanes) {
      wv = load16(x + j0);
    } else {
      float v[kLanes];
      for (int l = 0; l < kLanes; ++l) v[l] = l < n ? x[j0 + l] : (logits ? -INFINITY : 0.0f);
      wv = load16(v);
    }
    if (logits) wv = exp16(wv - top);
    std::memcpy(w, &wv, sizeof wv);
  };
  std::vector<double> sums(blocks);
  double total = 0.0;
  float w[kLanes];
  for (int64_t b = 0; b < blocks; ++b) {
    if (logits && (b + 1) * kLanes <= V && all_minus_inf(load16(x + b * kLanes))) {  // sixteen weights of +0 (row_exp_sum)
      sums[b] = 0.0;
      continue;
    }
    block_weights(b, w);
    sums[b] = lane_sum(load16(w));
    total += sums[b];
  }
  TORCH_CHECK(total > 0, "draw_index: the weights sum to zero");
  const double target = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (running + sums[b] <= target) {
      running += sums[b];
      continue;
    }
    block_weights(b, w);
    for (int l = 0; l < kLanes; ++l) {
      running += w[l];
      if (w[l] > 0 && running > target) return b * kLanes + l;
    }  // rounding left the walk short of the block's sum: go on
  }
  for (int64_t b = blocks - 1; b >= 0; --b) {  // u · total at or past the end: the last index of nonzero weight
    if (sums[b] <= 0) continue;
    block_weights(b, w);
    for (int l = kLanes - 1; l >= 0; --l)
      if (w[l] > 0) return b * kLanes + l;
  }
  TORCH_CHECK(false, "draw_index: no index of nonzero weight");
  return -1;
}

// The first index of a row's largest value (torch.argmax's choice among equal ones): its maximum, then the first block
// of 16 that holds it.
inline int64_t row_argmax(const float* row, int64_t n) {
  const float top = row_max(row, n);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const i16v hit = load16(row + j) == splat(top);
    for (int l = 0; l < kLanes; ++l)
      if (hit[l]) return j + l;
  }
  for (; j < n; ++j)
    if (row[j] == top) return j;
  return 0;  // a NaN maximum (scores never hold one)
}

// acceptance.py verify_tree at greedy and in exact mode, in one call, for processed scores [N, V] float32 (node i's
// distribution is softmax(scores[i])), parents [N] int64 (−1 for the root; a node's children are the nodes naming it,
// tried in index order), tokens [N] int64 and retrieve [P, D + 1] int64 (each root-to-leaf path, padded with −1).
//   greedy: from the root, the child whose token is the node's argmax is walked into; the next token is the last
//     node's argmax. Siblings hold distinct tokens in every tree the engine builds (a head's ranks, a graft that
//     shares the node holding its token), so this is the one longest accepted prefix that ATen's ops find.
//   exact: uniforms [N − 1] float32 (candidate c is node c + 1) and u, the residual draw's uniform. Child c of node a
//     is accepted when u_c · (1 − Σ_{earlier siblings s} p_a(x_s)) < p_a(x_c) (try_children), the first accepted
//     child is walked into; at the walk's last node the next token is drawn from p with that node's children's tokens
//     removed (or from p itself where they held all of its mass).
// Only the walked rows are read. Returns int64 [2 + D + 1]: the accepted candidates, the next token, then the first
// path through the walk's last node (select_path's choice).
inline Tensor tree_walk(const Tensor& scores, const Tensor& parents_in, const Tensor& tokens_in, const Tensor& retrieve_in,
                        const Tensor& uniforms_in, double u, bool greedy) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "tree_walk: scores must be contiguous [N, V] float32");
  const int64_t N = scores.size(0), V = scores.size(1);
  const Tensor parents = parents_in.to(at::kLong).contiguous(), tokens = tokens_in.to(at::kLong).contiguous();
  const Tensor retrieve = retrieve_in.to(at::kLong).contiguous();
  const Tensor uniforms = uniforms_in.to(at::kFloat).contiguous();
  TORCH_CHECK(parents.numel() == N && tokens.numel() == N && (greedy || uniforms.numel() == N - 1),
              "tree_walk: parents and tokens [N], uniforms [N - 1] in exact mode");
  TORCH_CHECK(retrieve.dim() == 2 && retrieve.size(0) > 0, "tree_walk: retrieve must be [P, D + 1]");
  const int64_t* parent = parents.data_ptr<int64_t>();
  const int64_t* token = tokens.data_ptr<int64_t>();
  const float* uniform = greedy ? nullptr : uniforms.data_ptr<float>();
  const float* data = scores.data_ptr<float>();
  int64_t node = 0, next = -1, length = 0;  // the walked node, the next token, the accepted candidates
  float top = 0.0f;  // exact: the walked node's largest score
  while (true) {
    const float* row = data + node * V;
    int64_t taken = -1;
    if (greedy) {
      next = row_argmax(row, V);
      for (int64_t c = node + 1; c < N && taken < 0; ++c)
        if (parent[c] == node && token[c] == next) taken = c;
    } else {
      top = row_max(row, V);
      const float total = row_exp_sum(row, V, top);
      float rejected = 0.0f;  // Σ p(x_s) of the siblings tried so far
      for (int64_t c = node + 1; c < N && taken < 0; ++c) {
        if (parent[c] != node) continue;
        const int64_t x = token[c];
        TORCH_CHECK(x >= 0 && x < V, "tree_walk: node ", c, "'s token ", x, " is not a column of the scores");
        const float p = std::exp(row[x] - top) / total;
        const float left = std::max(1.0f - rejected, 0.0f);
        if (uniform[c - 1] * left < p) taken = c;
        rejected += p;
      }
    }
    if (taken < 0) break;
    node = taken;
    ++length;
  }
  if (!greedy) {  // the residual: p at the last node without its children's tokens
    std::vector<float> residual(data + node * V, data + (node + 1) * V);
    for (int64_t c = node + 1; c < N; ++c)
      if (parent[c] == node) residual[token[c]] = -INFINITY;
    const bool left = row_exp_sum(residual.data(), V, top) > 0;  // float rounding may leave none
    const Tensor weights = left ? at::from_blob(residual.data(), {V}, at::TensorOptions().dtype(at::kFloat)) : scores[node];
    next = draw_index(weights, u, true);
  }
  const int64_t P = retrieve.size(0), width = retrieve.size(1);
  TORCH_CHECK(length < width, "tree_walk: a walk of ", length + 1, " nodes is longer than retrieve's paths");
  const int64_t* paths = retrieve.data_ptr<int64_t>();
  int64_t best = 0;
  while (best < P && paths[best * width + length] != node) ++best;
  TORCH_CHECK(best < P, "tree_walk: no path of retrieve holds node ", node, " at depth ", length);
  Tensor out = at::empty({2 + width}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = length;
  o[1] = next;
  std::memcpy(o + 2, paths + best * width, width * sizeof(int64_t));
  return out;
}

}  // namespace medusa_lean
