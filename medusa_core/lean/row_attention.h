// Row attention for the lean step (lean_step.cpp) and invariant.py kernel_attention: every query row of a decoding pass
// over exactly the keys it may see, in one call per layer.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <utility>
#include <vector>

namespace medusa_lean {

using at::Tensor;

// Batch invariance (invariant.py) needs row r's output to be the same bits whatever the other rows of its pass are:
// each (row, query head) reads the row's keys in cache order (0 .. prefix−1, then its listed positions), cut by rank
// into blocks of kKeyBlock whose partial softmaxes are combined in block order, every sum in a fixed order that
// depends only on the key's rank in that row's list. One-token decoding at position p and a tree row at the same place in a path see the same keys
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

// lane_sum of each of 16 vectors, as one vector (lane t: lane_sum(v[t]), the same operations in the same tree): the
// halves of two vectors side by side, then quarters of four, then pairs, so each level is two shuffles and one add
// for many vectors instead of a reduction per vector.
inline f16v lane_sums(const f16v* v) {
#if defined(__AVX512F__)
  __m512 b[8], c[4], d[2];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {  // lanes 0–7: v[2i]'s (0–7) + (8–15); lanes 8–15: v[2i+1]'s
    const __m512 x = (__m512)v[2 * i], y = (__m512)v[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < 4; ++i) {  // 128-bit chunk t: vector 4i + t's (0–3) + (4–7) of its 8
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < 2; ++i) {  // chunk t: (c0 + c2), (c1 + c3) of vectors 8i + t, then of 8i + 4 + t
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane 4t + u: (c0 + c2) + (c1 + c3) of vector 4u + t; put vector l in lane l
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return (f16v)_mm512_permutexvar_ps(order, sums);
#else
  f16v out;
  for (int t = 0; t < kLanes; ++t) out[t] = lane_sum(v[t]);
  return out;
#endif
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

// The largest of a row of n values (−∞ for none), 16 lanes at a time.
inline float row_max(const float* row, int64_t n) {
  f16v m = splat(-INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f16v v = load16(row + j);
    m = v > m ? v : m;
  }
  float top = -INFINITY;
  for (int l = 0; l < kLanes; ++l) top = m[l] > top ? m[l] : top;
  for (; j < n; ++j) top = row[j] > top ? row[j] : top;
  return top;
}

// Whether all 16 lanes are −∞: a block of a row that a filter removed (processors.py), whose e^(x − top) are all +0.
inline bool all_minus_inf(f16v x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ) == 0xFFFF;
#else
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != -INFINITY) return false;
  return true;
#endif
}

// Σ_j e^(row[j] − top) over a row of n values, 16 lanes (exp16) then a fixed tree. A block of −∞ adds +0 to each lane
// (a sum of terms ≥ +0 is never −0, so adding +0 leaves its bits): it is skipped, the same bits, and a row filtered
// to a few tokens (top-p at the chat preset keeps a handful of 49,152) takes a compare a block instead of an e^x.
inline float row_exp_sum(const float* row, int64_t n, float top) {
  f16v total{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f16v x = load16(row + j);
    if (!all_minus_inf(x)) total = total + exp16(x - top);
  }
  float tail = 0.0f;
  for (; j < n; ++j) tail += std::exp(row[j] - top);
  return lane_sum(total) + tail;
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

constexpr int kMaxChunks = 8;  // Dh / 16 up to which an item is compiled for its head size
constexpr int64_t kKeyBlock = 128;  // keys of a row one work item reads: ranks kKeyBlock·b .. kKeyBlock·(b+1) − 1
constexpr int64_t kParallelVisits = 1024;  // keys read in a call from which its items are split over the threads (waking them ~5 µs)

// Σ_j p_j · v_j over ranks lo .. lo + count − 1, lane-wise over Dh in key order, for NH heads at once (one value read
// for all): head a's probabilities at p + a·kKeyBlock, its sum written at outs[a].
template <int C, int NH, typename Position>
inline void weighted_values(const float* v, int64_t pos_stride, const Position& position, int64_t lo, int64_t count,
                            const float* p, float* const* outs) {
  f16v acc[NH][C];
  _Pragma("GCC unroll 8") for (int a = 0; a < NH; ++a) {
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[a][c] = f16v{};
  }
  for (int64_t j = 0; j < count; ++j) {
    const float* vj = v + position(lo + j) * pos_stride;
    f16v vv[C];
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) vv[c] = load16(vj + c * kLanes);
    _Pragma("GCC unroll 8") for (int a = 0; a < NH; ++a) {
      const f16v w = splat(p[a * kKeyBlock + j]);
      _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[a][c] = mul_add(w, vv[c], acc[a][c]);
    }
  }
  for (int a = 0; a < NH; ++a) std::memcpy(outs[a], acc[a], sizeof acc[a]);
}

// Query heads h = 0 .. heads − 1 (one KV head's group, of one row or of several rows that see the same keys here)
// over the ranks lo .. hi − 1 of their keys: each head's partial softmax over the block.
//   qs[h]: head h's Dh floats; keys: rank j < prefix is position j, else extra[j − prefix], of k / v (rows of Dh
//   floats, `pos_stride` apart). parts[h]: [2 + Dh] floats, written: the block's largest score m, Σ_j e^(s_j − m),
//   and Σ_j e^(s_j − m)·v_j. `s` holds heads · kKeyBlock scores.
// Each head's operations are those of the head alone: the heads only share the reading of a key (16 keys stay in the
// core's first cache while every head takes its scores from them; a value is read once for up to kValueHeads heads),
// so a row's bits do not depend on which rows share the call.
template <int C>
void attend_block(const float* const* qs, int64_t heads, const float* k, const float* v, int64_t pos_stride,
                  int64_t prefix, const int64_t* extra, int64_t lo, int64_t hi, float scale, float* const* parts, float* s) {
  constexpr int kValueHeads = C <= 4 ? 4 : 2;  // accumulators kValueHeads · C within the 32 vector registers
  const int64_t count = hi - lo, padded = (count + kLanes - 1) / kLanes * kLanes;
  auto position = [&](int64_t j) { return j < prefix ? j : extra[j - prefix]; };
  // scores: q · k_j, each a lane-wise product sum over Dh then a fixed-tree sum of the lanes (lane_sums: 16 keys at
  // once), times the scale; ranks past the block's end get −∞
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    const int64_t keys = std::min<int64_t>(kLanes, count - j0);
    const float* key_rows[kLanes];
    for (int64_t t = 0; t < keys; ++t) key_rows[t] = k + position(lo + j0 + t) * pos_stride;
    for (int64_t h = 0; h < heads; ++h) {
      f16v qv[C];
      _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) qv[c] = load16(qs[h] + c * kLanes);
      f16v acc[kLanes];
      auto dot = [&](int t) {
        acc[t] = qv[0] * load16(key_rows[t]);
        _Pragma("GCC unroll 8") for (int c = 1; c < C; ++c) acc[t] = mul_add(qv[c], load16(key_rows[t] + c * kLanes), acc[t]);
      };
      if (keys == kLanes) {
        _Pragma("GCC unroll 16") for (int t = 0; t < kLanes; ++t) dot(t);
      } else {
        for (int t = 0; t < kLanes; ++t) t < keys ? dot(t) : void(acc[t] = f16v{});
      }
      const f16v scores = lane_sums(acc) * scale;
      std::memcpy(s + h * kKeyBlock + j0, &scores, sizeof scores);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = s + h * kKeyBlock;
    for (int64_t j = count; j < padded; ++j) sh[j] = -INFINITY;
    f16v m = load16(sh);
    for (int64_t j = kLanes; j < padded; j += kLanes) {
      const f16v x = load16(sh + j);
      m = x > m ? x : m;
    }
    float top = m[0];
    for (int l = 1; l < kLanes; ++l) top = m[l] > top ? m[l] : top;
    // probabilities (unnormalised) in place, their sum lane-wise in key order then as a fixed tree
    f16v total{};
    for (int64_t j = 0; j < padded; j += kLanes) {
      const f16v p = exp16(load16(sh + j) - top);  // the padding's −∞ gives 0
      std::memcpy(sh + j, &p, sizeof p);
      total = total + p;
    }
    parts[h][0] = top;
    parts[h][1] = lane_sum(total);
  }
  // Σ_j p_j · v_j in key order, lane-wise over Dh
  for (int64_t h0 = 0; h0 < heads; h0 += kValueHeads) {
    const int64_t nh = std::min<int64_t>(kValueHeads, heads - h0);
    float* outs[kValueHeads];
    for (int64_t a = 0; a < nh; ++a) outs[a] = parts[h0 + a] + 2;
    const float* p = s + h0 * kKeyBlock;
    switch (nh) {
      case 1: weighted_values<C, 1>(v, pos_stride, position, lo, count, p, outs); break;
      case 2: weighted_values<C, 2>(v, pos_stride, position, lo, count, p, outs); break;
      case 3: weighted_values<C, 3>(v, pos_stride, position, lo, count, p, outs); break;
      default: weighted_values<C, kValueHeads>(v, pos_stride, position, lo, count, p, outs); break;
    }
  }
}

// A (row, query head)'s output from its blocks' partials [blocks, 2 + Dh], in block order: with M the largest
// block maximum and w_b = e^(m_b − M), out = (Σ_b w_b·acc_b) / (Σ_b w_b·sum_b).
template <int C>
void combine_blocks(const float* parts, int64_t blocks, int64_t stride, float* out) {
  float top = parts[0];
  for (int64_t b = 1; b < blocks; ++b) top = parts[b * stride] > top ? parts[b * stride] : top;
  f16v acc[C];
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[c] = f16v{};
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* part = parts + b * stride;
    const float w = exp16(splat(part[0] - top))[0];
    total = total + w * part[1];
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) acc[c] = mul_add(splat(w), load16(part + 2 + c * kLanes), acc[c]);
  }
  const float inv = 1.0f / total;
  _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) {
    const f16v o = acc[c] * inv;
    std::memcpy(out + c * kLanes, &o, sizeof o);
  }
}

using BlockFn = void (*)(const float* const*, int64_t, const float*, const float*, int64_t, int64_t, const int64_t*, int64_t,
                         int64_t, float, float* const*, float*);
using CombineFn = void (*)(const float*, int64_t, int64_t, float*);

template <int... C>
std::pair<BlockFn, CombineFn> item_for(int64_t chunks, std::integer_sequence<int, C...>) {
  std::pair<BlockFn, CombineFn> fn{nullptr, nullptr};
  ((chunks == C + 1 ? (fn = {&attend_block<C + 1>, &combine_blocks<C + 1>}, 0) : 0), ...);
  return fn;
}

// The attention's operands as raw float32 pointers with their strides (unit stride over Dh everywhere): query
// [N, Hq, Dh], keys and values [Hkv, L, Dh] (the same position stride), extras: int64.
struct RowOperands {
  const float* q;
  int64_t n, hq, dh, q_row, q_head;
  const float* k;
  const float* v;
  int64_t hkv, k_head, v_head, pos_stride;
  const int64_t* extras;
};

// Attention of N query rows [N, Hq, Dh] (float32, unit stride over Dh) over a cache's keys and values [Hkv, L, Dh]
// (float32, unit stride over Dh). Row r sees positions 0 .. prefix[r]−1 and then extras[offsets[r] .. offsets[r+1]−1]
// (ascending, each ≥ prefix[r]). Writes [N, Hq, Dh] float32 to out (contiguous); parts is scratch, grown as needed.
//
// A row's keys are cut by rank into blocks of kKeyBlock (flash-decoding's split): each block's partial softmax, then
// the blocks combined in order, so a row's bits depend on its own keys only. A work item is one KV head and one block
// rank for every row and every query head of that KV head: a key is read once for all the heads of its group, and
// once for all the rows whose prefix holds the whole block (a tree's rows share the cached context), and long rows
// split into many items for the threads. On this project's CPU a row over 2,000 cached keys of the demo's 30 layers
// took ~4 ms as one item per (row, query head) (docs/BENCH.md, "Attention by key blocks").
inline void row_attention_into(const RowOperands& in, const std::vector<int64_t>& prefix, const std::vector<int64_t>& offsets,
                               double scaling, float* op, std::vector<float>& parts) {
  const int64_t n = in.n, hq = in.hq, dh = in.dh, hkv = in.hkv;
  TORCH_CHECK(hq % hkv == 0 && dh % kLanes == 0 && dh <= kLanes * kMaxChunks,
              "row_attention: Hq a multiple of Hkv, Dh a multiple of 16 up to ", kLanes * kMaxChunks);
  const auto [attend, combine] = item_for(dh / kLanes, std::make_integer_sequence<int, kMaxChunks>{});
  TORCH_CHECK(static_cast<int64_t>(prefix.size()) == n && static_cast<int64_t>(offsets.size()) == n + 1,
              "row_attention: one prefix per row and N + 1 offsets");
  const int64_t* ex = in.extras;
  const int64_t group = hq / hkv, pos_stride = in.pos_stride, stride = 2 + dh;
  const float* qp = in.q;
  const float* kp = in.k;
  const float* vp = in.v;
  std::vector<int64_t> count(n);
  int64_t visits = 0, blocks = 0;  // keys read over all (row, head) pairs (the work, ~6 ns each); block ranks
  for (int64_t r = 0; r < n; ++r) {
    count[r] = prefix[r] + offsets[r + 1] - offsets[r];
    TORCH_CHECK(count[r] > 0, "row_attention: row ", r, " sees no key");
    visits += count[r] * hq;
    blocks = std::max(blocks, (count[r] + kKeyBlock - 1) / kKeyBlock);
  }
  const size_t need = n * hq * blocks * stride;  // [N, Hq, blocks, 2 + Dh]
  if (parts.size() < need) parts.resize(need);
  float* pp = parts.data();
  // Items are split over torch's threads when there is enough work to pay for waking them; each (row, head, block)
  // is computed start to end by one item, so the split does not change a bit.
  const int64_t items = hkv * blocks, grain = visits < kParallelVisits ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * n * kKeyBlock);
    std::vector<const float*> qs(group * n);
    std::vector<float*> outs(group * n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kv = i / blocks, b = i % blocks, lo = b * kKeyBlock, h = kv * group;
      // the heads of every row whose whole block lies in its prefix (the same keys, positions lo .. lo + kKeyBlock − 1:
      // a tree's rows over the cached context) in one call, which reads each key once for all of them; then the
      // other rows that reach this block, one call each
      auto add_row = [&](int64_t r, int64_t at) {  // row r's heads of this group as call heads at .. at + group − 1
        for (int64_t a = 0; a < group; ++a) {
          qs[at + a] = qp + r * in.q_row + (h + a) * in.q_head;
          outs[at + a] = pp + ((r * hq + h + a) * blocks + b) * stride;
        }
      };
      int64_t shared = 0;
      for (int64_t r = 0; r < n; ++r) {
        if (prefix[r] >= lo + kKeyBlock) add_row(r, shared), shared += group;
      }
      if (shared)
        attend(qs.data(), shared, kp + kv * in.k_head, vp + kv * in.v_head, pos_stride, lo + kKeyBlock, ex, lo,
               lo + kKeyBlock, static_cast<float>(scaling), outs.data(), scores.data());
      for (int64_t r = 0; r < n; ++r) {
        if (count[r] <= lo || prefix[r] >= lo + kKeyBlock) continue;
        add_row(r, 0);
        attend(qs.data(), group, kp + kv * in.k_head, vp + kv * in.v_head, pos_stride, prefix[r], ex + offsets[r],
               lo, std::min(count[r], lo + kKeyBlock), static_cast<float>(scaling), outs.data(), scores.data());
      }
    }
  });
  at::parallel_for(0, n * hq, visits < kParallelVisits ? n * hq : 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      combine(pp + i * blocks * stride, (count[i / hq] + kKeyBlock - 1) / kKeyBlock, stride, op + i * dh);
    }
  });
}

// row_attention_into on tensors: query [N, Hq, Dh], key / value [Hkv, L, Dh] float32 (unit stride over Dh, keys and
// values with the same position stride), extras integer -> [N, Hq, Dh] float32.
inline Tensor row_attention(const Tensor& query, const Tensor& key, const Tensor& value, const std::vector<int64_t>& prefix,
                            const std::vector<int64_t>& offsets, const Tensor& extras, double scaling) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "row_attention: query [N, Hq, Dh], key/value [Hkv, L, Dh]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "row_attention: float32 tensors");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1, "row_attention: unit stride over Dh");
  TORCH_CHECK(key.stride(1) == value.stride(1), "row_attention: keys and values with the same position stride");
  const Tensor extra = extras.to(at::kLong).contiguous();
  Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<float> parts;
  const RowOperands in{query.data_ptr<float>(), query.size(0), query.size(1), query.size(2), query.stride(0), query.stride(1),
                       key.data_ptr<float>(), value.data_ptr<float>(), key.size(0), key.stride(0), value.stride(0), key.stride(1),
                       extra.data_ptr<int64_t>()};
  row_attention_into(in, prefix, offsets, scaling, out.data_ptr<float>(), parts);
  return out;
}

}  // namespace medusa_lean
