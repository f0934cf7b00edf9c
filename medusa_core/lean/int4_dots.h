// The AVX512-BF16 dot-product path of the 4-bit product (int4_matmul.h has the layout, the arithmetic and why):
// bfloat16 helpers, the records' size, Σ x per group, the tiles of up to 8 rows by a pair of blocks, int4_rows.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MEDUSA_LEAN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace medusa_lean {

using at::Tensor;

// c10::BFloat16(float): round to nearest even, NaN -> 0x7FC0, written without a branch so that loops of it vectorise.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  return f != f ? uint16_t(0x7FC0) : rounded;
}

// A bfloat16 value as float32 (exact).
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

constexpr int64_t kRecord = 320;  // bytes of one (block, group) record: 256 of codes, 32 of scales, 32 of zeros

#if defined(__AVX512BF16__)

// bfloat16 bits of (i & 15) − 8 for the 32 indices vpermw reads (it uses an index's low 5 bits).
inline __m512i code_values() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  return _mm512_load_si512(t);
}

inline __m512 bf16_to_float(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// How far ahead of the products, in bytes of a thread's stream, int4_group prefetches the weights (never past the end
// of the thread's share), for passes of one row and of more: a row's products keep pace with the read, where more rows'
// products slow the stream and lines fetched far ahead would leave the 48 KB L1 before their use. Interleaved in the
// demo's decoding loop (greedy, 2 threads): one row 2.08 ms a pass at 32 KB, 2.20 at 12 and 20 KB; two to five rows
// fastest at 12 KB (docs/BENCH.md, "The 4-bit weights as one stream").
template <int MR>
constexpr int64_t kAheadBytes = MR == 1 ? 32768 : 12288;

// Σ x over each group of 32 inputs of each row, x [M, K] bfloat16 (rows ldx apart) -> xsum [M, G]: each a float32 sum
// in input order from 0, as a scalar loop adds them, 16 groups at a time (a lane each, its two inputs a word gathered).
// A scalar loop is a chain of 32 dependent additions a group: ~4 µs of a layer's products on the demo, on one thread.
inline void group_sums(const uint16_t* x, int64_t M, int64_t ldx, int64_t G, float* xsum) {
  const __m512i words = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const __mmask16 lanes = G - g0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g0)) - 1);
      const int32_t* base = reinterpret_cast<const int32_t*>(x + m * ldx + g0 * 32);
      __m512 sum = _mm512_setzero_ps();
      for (int k = 0; k < 16; ++k) {  // word k of each group: inputs 2k (low half) and 2k + 1 (high half)
        const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, words, base + k, 4);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
      }
      _mm512_mask_storeu_ps(xsum + m * G + g0, lanes, sum);
    }
  }
}

// Group g of rows 0 .. MR − 1 by the H blocks of one pair (H = 2, or 1 for an unpaired last block), whose groups lie
// H · kRecord bytes apart from `pair` on, added to `total`. Each (row, block) accumulates its dot products in one chain
// of dependent instructions, the rows' and blocks' chains independent. The codes of a chunk are widened once and used
// by every row. Prefetches the stream kAheadBytes<MR> ahead while below `limit`.
template <int MR, int H>
inline void int4_group(const uint16_t* x, int64_t ldx, const uint8_t* pair, const float* xsum, int64_t G, int64_t g,
                       __m512 (&total)[MR][H], __m512i values, uintptr_t limit) {
  const uint8_t* records = pair + g * H * kRecord;
  // the stream kAheadBytes<MR> on, fetched while this group is computed, so that the products overlap the weights' read;
  // a prefetch changes no value (the address is an integer until it is known to lie in the weights)
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(records) + kAheadBytes<MR>;
  if (ahead < limit) {
    _Pragma("GCC unroll 10") for (int line = 0; line < H * kRecord / 64; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
    }
  }
  __m512 dot[MR][H];
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 2") for (int b = 0; b < H; ++b) dot[m][b] = _mm512_setzero_ps();
  }
  _Pragma("GCC unroll 2") for (int c = 0; c < 8; ++c) {
    __m512bh low[MR], high[MR];  // inputs k0, k0 + 1 and k0 + 2, k0 + 3 of each row, in every lane
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
      int32_t a, b;
      std::memcpy(&a, x + m * ldx + g * 32 + c * 4, 4);
      std::memcpy(&b, x + m * ldx + g * 32 + c * 4 + 2, 4);
      low[m] = (__m512bh)_mm512_set1_epi32(a);
      high[m] = (__m512bh)_mm512_set1_epi32(b);
    }
    _Pragma("GCC unroll 2") for (int b = 0; b < H; ++b) {
      const uint8_t* p = records + b * kRecord + c * 32;
      const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512bh w_low = (__m512bh)_mm512_permutexvar_epi16(codes, values);
      const __m512bh w_high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), values);
      _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
        dot[m][b] = _mm512_dpbf16_ps(dot[m][b], w_low, low[m]);
        dot[m][b] = _mm512_dpbf16_ps(dot[m][b], w_high, high[m]);
      }
    }
  }
  _Pragma("GCC unroll 2") for (int b = 0; b < H; ++b) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(records + b * kRecord + 256);
    const __m512 scale = bf16_to_float(s), zero = bf16_to_float(s + 16);
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
      total[m][b] = _mm512_fmadd_ps(dot[m][b], scale, total[m][b]);
      total[m][b] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * G + g]), total[m][b]);
    }
  }
}

// Rows 0 .. MR − 1 by the H blocks of one pair, group by group; the outputs rounded to bfloat16 once.
// Never inlined: each row count's pass is a function of its own, as the compiler laid out passes of up to 4 rows
// before int4_pass dispatched to 5–8 too (inlined there, 4 rows took 1.09–1.12× as long: scripts/int4_ab.py). Two
// groups a step (two chains a row and block in flight) made it slower since: one row 1.32× as long, two rows
// 1.17–1.22×, four 1.08–1.27× (docs/BENCH.md, "Two to four rows one group a step"), where two groups had made two to
// five rows 1–4 % faster while the passes were inlined; five to eight rows' accumulators fill the vector registers.
template <int MR, int H>
__attribute__((noinline)) void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* pair, const float* xsum, int64_t G,
                                         uint16_t* out, int64_t ldo, __m512i values, uintptr_t limit) {
  __m512 total[MR][H];
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 2") for (int b = 0; b < H; ++b) total[m][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) int4_group<MR, H>(x, ldx, pair, xsum, G, g, total, values, limit);
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 2") for (int b = 0; b < H; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + b * 16), (__m256i)_mm512_cvtneps_pbh(total[m][b]));
    }
  }
}

// A pass of `rows` (1 to 8) rows by the H blocks of one pair (int4_tile).
template <int H>
inline void int4_pass(int64_t rows, const uint16_t* x, int64_t ldx, const uint8_t* pair, const float* xsum, int64_t G,
                      uint16_t* out, int64_t ldo, __m512i values, uintptr_t limit) {
  switch (rows) {
    case 1: return int4_tile<1, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 2: return int4_tile<2, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 3: return int4_tile<3, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 4: return int4_tile<4, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 5: return int4_tile<5, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 6: return int4_tile<6, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    case 7: return int4_tile<7, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
    default: return int4_tile<8, H>(x, ldx, pair, xsum, G, out, ldo, values, limit);
  }
}

// The most rows int4_rows multiplies in one pass over a pair's weights. Each pass widens the codes anew and runs its
// rows' dot products, so a second pass over weights still in the cache costs nearly what the first did: with passes of
// at most 4 rows, 5 rows took 1.7–1.8× a one-row product on the demo's linears (2 threads, AMD EPYC); in one pass
// 0.76× of that, 6 rows 0.88×, 8 rows 0.92×, 10 rows (5 + 5) 0.91×, 16 rows (8 + 8) 1.02× (scripts/int4_ab.py;
// docs/BENCH.md, "Products of up to 8 rows in one pass").
constexpr int64_t kPassRows = 8;

// Rows 0 .. M − 1 by the pairs begin .. end − 1 (and, with `lone`, the unpaired block after them), pair by pair: in
// ⌈M / 8⌉ passes of as even a number of rows as can be (9 rows: 4 then 5), each pass's operations on a row the same in
// all (the pair's ≤ 30 KB on the demo stays in the cache for the next pass).
inline void int4_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint8_t* tiles, int64_t pair_bytes, const float* xsum,
                      int64_t G, int64_t begin, int64_t end, bool lone, uint16_t* out, int64_t ldo, __m512i values,
                      uintptr_t limit) {
  const int64_t passes = (M + kPassRows - 1) / kPassRows;
  for (int64_t p = begin; p < end + lone; ++p) {
    const uint8_t* pair = tiles + p * pair_bytes;
    for (int64_t i = 0, m = 0; i < passes; ++i) {
      const int64_t rows = (M - m) / (passes - i);  // the rows left shared evenly over the passes left, larger last
      uint16_t* o = out + m * ldo + 32 * p;
      if (p < end) {
        int4_pass<2>(rows, x + m * ldx, ldx, pair, xsum + m * G, G, o, ldo, values, limit);
      } else {
        int4_pass<1>(rows, x + m * ldx, ldx, pair, xsum + m * G, G, o, ldo, values, limit);
      }
      m += rows;
    }
  }
}

#endif

}  // namespace medusa_lean
