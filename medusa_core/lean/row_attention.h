// Row attention for the lean step (lean_step.cpp) and invariant.py kernel_attention: every query row of a decoding pass
// over exactly the keys it may see, in one call per layer.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace medusa_lean {

using at::Tensor;

// Batch invariance (invariant.py) needs row r's output to be the same bits whatever the other rows of its pass are:
// here each (row, query head) is one work item computed start to end, over the row's keys in cache order
// (0 .. prefix−1, then its listed positions), with every sum in a fixed order that depends only on the key's rank in
// that row's list. One-token decoding at position p and a tree row at the same place in a path see the same keys
// (the same bits) in the same order, so they get the same output.
// The arithmetic is written with GCC vector types (16 float lanes), every lane operation one IEEE operation; the
// products summed over Dh use the CPU's fused multiply-add where it has AVX-512 (mul_add), so a build is for one
// CPU (build.py keys its folder on the CPU) and every row of every pass on it runs the same operations.

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
constexpr int kLanes = 16;

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f16v splat(float x) { return f16v{} + x; }

// Σ of the 16 lanes, as a fixed tree: (lanes 0–7 + 8–15), then halves again, then pairs.
inline float lane_sum(f16v a) {
  const f8v b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// e^x for x ≤ 0 (scores minus their maximum), 16 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
// polynomial, the power of two built in the exponent bits); below −87.3 the result is 0. Relative error ≲ 2 ulp.
inline f16v exp16(f16v x) {
  const i16v under = x < -87.3f;
  x = under ? splat(-87.3f) : x;
  const f16v fx = x * 1.44269504088896341f + 0.5f;
  i16v n = __builtin_convertvector(fx, i16v);  // truncation toward zero
  n = n + (__builtin_convertvector(n, f16v) > fx);  // floor: one less where truncation rounded up (a true mask is −1)
  const f16v nf = __builtin_convertvector(n, f16v);
  x = x - nf * 0.693359375f;
  x = x - nf * -2.12194440e-4f;
  const f16v z = x * x;
  f16v y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const i16v bits = (n + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? splat(0.0f) : y * scale;
}

// a · b + c in one rounding where the CPU has AVX-512 (its fused multiply-add), else as a product then a sum: either way
// one fixed operation per lane, the same for every row.
inline f16v mul_add(f16v a, f16v b, f16v c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

constexpr int kMaxChunks = 8;
constexpr int64_t kParallelVisits = 4096;  // keys read in a call from which its items are split over the threads  // Dh / 16 up to which an item is compiled for its head size

// One (row, query head) item over the row's keys, for Dh = 16 · C.
//   q: the query head's Dh floats; out: its output's Dh floats.
//   keys: positions 0 .. prefix−1, then extra[0 .. n_extra−1], of k / v (rows of Dh floats, `pos_stride` apart): the
//   query head's KV head. `scratch` holds the scores.
template <int C>
void attend_item(const float* q, const float* k, const float* v, int64_t pos_stride, int64_t prefix,
                 const int64_t* extra, int64_t n_extra, float scale, float* out, std::vector<float>& scratch) {
  const int64_t count = prefix + n_extra, padded = (count + kLanes - 1) / kLanes * kLanes;
  scratch.resize(padded);
  float* s = scratch.data();
  auto position = [&](int64_t j) { return j < prefix ? j : extra[j - prefix]; };
  f16v qv[C];
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) qv[c] = load16(q + c * kLanes);
  // scores: q · k_j, each a lane-wise product sum over Dh then a fixed-tree sum of the lanes, times the scale
  for (int64_t j = 0; j < count; ++j) {
    const float* kj = k + position(j) * pos_stride;
    f16v acc = qv[0] * load16(kj);
    _Pragma("GCC unroll 8") for (int c = 1; c < C; ++c) acc = mul_add(qv[c], load16(kj + c * kLanes), acc);
    s[j] = lane_sum(acc) * scale;
  }
  for (int64_t j = count; j < padded; ++j) s[j] = -INFINITY;
  f16v m = load16(s);
  for (int64_t j = kLanes; j < padded; j += kLanes) {
    const f16v x = load16(s + j);
    m = x > m ? x : m;
  }
  float top = m[0];
  for (int l = 1; l < kLanes; ++l) top = m[l] > top ? m[l] : top;
  // probabilities (unnormalised) in place, their sum lane-wise in key order then as a fixed tree
  f16v total{};
  for (int64_t j = 0; j < padded; j += kLanes) {
    const f16v p = exp16(load16(s + j) - top);  // the padding's −∞ gives 0
    std::memcpy(s + j, &p, sizeof p);
    total = total + p;
  }
  const float inv = 1.0f / lane_sum(total);
  // Σ_j p_j · v_j in key order, lane-wise over Dh, then times 1 / Σ p
  f16v acc[C];
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[c] = f16v{};
  for (int64_t j = 0; j < count; ++j) {
    const float* vj = v + position(j) * pos_stride;
    const f16v p = splat(s[j]);
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[c] = mul_add(p, load16(vj + c * kLanes), acc[c]);
  }
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) {
    const f16v o = acc[c] * inv;
    std::memcpy(out + c * kLanes, &o, sizeof o);
  }
}

using ItemFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, const int64_t*, int64_t, float, float*,
                        std::vector<float>&);

template <int... C>
ItemFn item_for(int64_t chunks, std::integer_sequence<int, C...>) {
  ItemFn fn = nullptr;
  ((chunks == C + 1 ? (fn = &attend_item<C + 1>, 0) : 0), ...);
  return fn;
}

// Attention of N query rows [N, Hq, Dh] (float32, unit stride over Dh) over a cache's keys and values [Hkv, L, Dh]
// (float32, unit stride over Dh). Row r sees positions 0 .. prefix[r]−1 and then extras[offsets[r] .. offsets[r+1]−1]
// (ascending, each ≥ prefix[r]). Returns [N, Hq, Dh] float32. One work item per (row, query head): one row over
// 1,000 keys took ~55 us on one thread of this project's CPU, where SDPA with two threads took ~75 us.
inline Tensor row_attention(const Tensor& query, const Tensor& key, const Tensor& value, const std::vector<int64_t>& prefix,
                     const std::vector<int64_t>& offsets, const Tensor& extras, double scaling) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "row_attention: query [N, Hq, Dh], key/value [Hkv, L, Dh]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "row_attention: float32 tensors");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "row_attention: unit stride over Dh");
  const int64_t n = query.size(0), hq = query.size(1), dh = query.size(2), hkv = key.size(0);
  TORCH_CHECK(hq % hkv == 0 && dh % kLanes == 0 && dh <= kLanes * kMaxChunks,
              "row_attention: Hq a multiple of Hkv, Dh a multiple of 16 up to ", kLanes * kMaxChunks);
  const ItemFn attend = item_for(dh / kLanes, std::make_integer_sequence<int, kMaxChunks>{});
  TORCH_CHECK(static_cast<int64_t>(prefix.size()) == n && static_cast<int64_t>(offsets.size()) == n + 1,
              "row_attention: one prefix per row and N + 1 offsets");
  TORCH_CHECK(key.stride(1) == value.stride(1), "row_attention: keys and values with the same position stride");
  const Tensor extra = extras.to(at::kLong).contiguous();
  const int64_t* ex = extra.data_ptr<int64_t>();
  const int64_t group = hq / hkv, pos_stride = key.stride(1);
  Tensor out = at::empty({n, hq, dh}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t visits = 0;  // keys read over all items: the work, ~6 ns each
  for (int64_t r = 0; r < n; ++r) visits += (prefix[r] + offsets[r + 1] - offsets[r]) * hq;
  // Items are split over torch's threads when there is enough work to pay for waking them; each item runs start to
  // end on one thread, so the split does not change a bit.
  const int64_t items = n * hq, grain = visits < kParallelVisits ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / hq, h = i % hq;
      attend(qp + r * query.stride(0) + h * query.stride(1), kp + h / group * key.stride(0),
             vp + h / group * value.stride(0), pos_stride, prefix[r], ex + offsets[r], offsets[r + 1] - offsets[r],
             static_cast<float>(scaling), op + (r * hq + h) * dh, scratch);
    }
  });
  return out;
}

}  // namespace medusa_lean
