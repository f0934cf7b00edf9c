// The 4-bit product of the lean step (lean_step.cpp) and quant/layers.py Int4Linear, on CPUs with AVX512-BF16:
// x [M, K] bfloat16 times 4-bit weights [N, K] (groups of 32 inputs, w = (q − 8)·scale + zero) -> [M, N] bfloat16.
//
// Why not torch's int4-pack kernel: it multiplies in float32 (16 products per instruction) and costs more per row than
// the weights' read (docs/BENCH.md, "The compiled int4 product"). Here each instruction is one AVX512-BF16 dot
// product of 32 pairs: the codes become exact bfloat16 integers (q − 8 ∈ −8..7), so every product x·(q − 8) is
// exact; per group of 32 inputs a row accumulates Σ x·(q − 8) in float32, then
//   out += scale · Σ x·(q − 8)        (one fused multiply-add)
//   out += zero · Σ x                 (one fused multiply-add; Σ x per row and group, a fixed-order float32 sum)
// and the output is rounded to bfloat16 once. Each (row, 16 outputs) is one fixed sequence of operations whatever the
// other rows or columns of the call: a row's bits do not depend on M (batch invariance, invariant.py), and a column's
// not on which other linears share the call (q/k/v fused, lean_step.cpp fuse).
//
// Layout (quant/layers.py int4_tiles): tiles [N/16, K/32, 8, 32] uint8 — for 16 outputs j, one group g and chunk c
// (inputs k0 = 32g + 4c .. k0 + 3), byte 2j + s holds code (j, k0 + s) in its low and (j, k0 + 2 + s) in its high
// nibble; widened to 16-bit words, they are the [16 outputs × 2 inputs] operand of one dot product each. tile_scales
// [N/16, K/32, 2, 16] bfloat16: the 16 outputs' scales, then their zeros.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

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

// How many groups ahead int4_tile prefetches its weights. Without it a pass waited on each group's read, then
// computed: the products did not overlap the reads (a second row cost ~0.1 of a one-row pass where its arithmetic
// alone is ~0.03). Measured interleaved on the demo's 24 held-out prompts (greedy, 2 threads, 2026-11-27): 4 and 6
// groups ahead ~1.05× the plain loop's tokens/s and ~1.07× heads + corpus's, 8 less, 2 nothing (docs/BENCH.md,
// "Prefetched 4-bit weights, a prompt's first pass in one call, the drafter compiled").
constexpr int64_t kAhead = 6;

// Rows m0 .. m0 + MR − 1 by the 16-output blocks b0 .. b0 + NB − 1: MR·NB accumulators over the groups, the codes of a
// chunk widened once and used by every row.
template <int MR, int NB>
inline void int4_tile(const uint16_t* x, int64_t ldx, const uint8_t* tiles, const uint16_t* scales, const float* xsum,
                      int64_t G, int64_t b0, uint16_t* out, int64_t ldo, __m512i values) {
  __m512 total[MR][NB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) total[m][b] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    // the codes (256 bytes) and scales (64) kAhead groups on (past a block's last group: the next block's first),
    // fetched while this group is computed, so that the products overlap the weights' read. A prefetch changes no
    // value and never faults; the addresses are integers, as they may lie past the weights' end.
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
      const uintptr_t ahead = static_cast<uintptr_t>(((b0 + b) * G + g + kAhead));
      const uintptr_t codes_ahead = reinterpret_cast<uintptr_t>(tiles) + ahead * 256;
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(codes_ahead + 64 * line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(scales) + ahead * 64), _MM_HINT_T0);
    }
    __m512 dot[MR][NB];
    _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
      _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) dot[m][b] = _mm512_setzero_ps();
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
      _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
        const uint8_t* p = tiles + (((b0 + b) * G + g) * 8 + c) * 32;
        const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512bh w_low = (__m512bh)_mm512_permutexvar_epi16(codes, values);
        const __m512bh w_high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), values);
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
          dot[m][b] = _mm512_dpbf16_ps(dot[m][b], w_low, low[m]);
          dot[m][b] = _mm512_dpbf16_ps(dot[m][b], w_high, high[m]);
        }
      }
    }
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
      const uint16_t* s = scales + ((b0 + b) * G + g) * 32;
      const __m512 scale = bf16_to_float(s), zero = bf16_to_float(s + 16);
      _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
        total[m][b] = _mm512_fmadd_ps(dot[m][b], scale, total[m][b]);
        total[m][b] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * G + g]), total[m][b]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 8") for (int b = 0; b < NB; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + (b0 + b) * 16), (__m256i)_mm512_cvtneps_pbh(total[m][b]));
    }
  }
}

// Blocks begin .. end − 1 of rows m0 .. m0 + MR − 1, NB blocks at a time, the rest NB/2, NB/4, … at a time.
template <int MR, int NB>
inline void int4_blocks(const uint16_t* x, int64_t ldx, const uint8_t* tiles, const uint16_t* scales, const float* xsum,
                        int64_t G, int64_t begin, int64_t end, uint16_t* out, int64_t ldo, __m512i values) {
  int64_t b = begin;
  for (; b + NB <= end; b += NB) int4_tile<MR, NB>(x, ldx, tiles, scales, xsum, G, b, out, ldo, values);
  if constexpr (NB > 1) int4_blocks<MR, NB / 2>(x, ldx, tiles, scales, xsum, G, b, end, out, ldo, values);
}

#endif

// True where this build computes int4_matmul with AVX512-BF16; elsewhere the engine keeps torch's int4-pack kernel.
inline bool has_int4_matmul() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 (rows ldx apart), tiles [N/16, K/32, 8, 32] uint8, tile_scales [N/16, K/32, 2, 16] bfloat16 ->
// out [M, N] bfloat16 (rows N apart), as raw bfloat16 bits: the product without a tensor allocated (the lean step's
// buffers). Output blocks are split over torch's threads. Raises (TORCH_CHECK) on other shapes or dtypes, or in a
// build without AVX512-BF16 (has_int4_matmul).
inline void int4_matmul_into(const uint16_t* xp, int64_t M, int64_t K, int64_t ldx, const Tensor& tiles,
                             const Tensor& tile_scales, uint16_t* op) {
  TORCH_CHECK(tiles.dim() == 4 && tiles.scalar_type() == at::kByte && tiles.size(2) == 8 && tiles.size(3) == 32 && tiles.is_contiguous(),
              "int4_matmul: tiles must be contiguous [N/16, K/32, 8, 32] uint8");
  const int64_t blocks = tiles.size(0), G = tiles.size(1), N = blocks * 16;
  TORCH_CHECK(K == G * 32, "int4_matmul: x has ", K, " inputs, the weights ", G * 32);
  TORCH_CHECK(tile_scales.scalar_type() == at::kBFloat16 && tile_scales.is_contiguous() && tile_scales.dim() == 4 &&
                  tile_scales.size(0) == blocks && tile_scales.size(1) == G && tile_scales.size(2) == 2 && tile_scales.size(3) == 16,
              "int4_matmul: tile_scales must be contiguous [N/16, K/32, 2, 16] bfloat16");
#if defined(__AVX512BF16__)
  std::vector<float> xsum(M * G);  // Σ x over each row's groups, in input order
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = 0; k < 32; ++k) s += bf16_float(xp[m * ldx + g * 32 + k]);
      xsum[m * G + g] = s;
    }
  }
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(tile_scales.data_ptr<at::BFloat16>());
  const float* xs = xsum.data();
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    const __m512i values = code_values();
    int64_t m = 0;
    // rows in passes of 4, the last pass 1 to 3 rows: each pass reads the weights once (a row's operations are the same
    // in all). Blocks per tile, measured on the demo's 30 layers (2 threads, 2026-11-26): 8 for one or two rows, 6 for
    // three or four (1 row: 1.69 ms vs 1.90 with 4; 3 rows: 2.06 vs 2.95 with 2; scratch benchmark, docs/BENCH.md).
    for (; m + 4 <= M; m += 4) int4_blocks<4, 6>(xp + m * ldx, ldx, tp, sp, xs + m * G, G, begin, end, op + m * N, N, values);
    if (M - m == 3) int4_blocks<3, 6>(xp + m * ldx, ldx, tp, sp, xs + m * G, G, begin, end, op + m * N, N, values);
    if (M - m == 2) int4_blocks<2, 8>(xp + m * ldx, ldx, tp, sp, xs + m * G, G, begin, end, op + m * N, N, values);
    if (M - m == 1) int4_blocks<1, 8>(xp + m * ldx, ldx, tp, sp, xs + m * G, G, begin, end, op + m * N, N, values);
  });
#else
  TORCH_CHECK(false, "int4_matmul needs a build with AVX512-BF16 (has_int4_matmul() is false here)");
#endif
}

// x [M, K] bfloat16, tiles [N/16, K/32, 8, 32] uint8, tile_scales [N/16, K/32, 2, 16] bfloat16 -> [M, N] bfloat16
// (int4_matmul_into on tensors).
inline Tensor int4_matmul(const Tensor& x_in, const Tensor& tiles, const Tensor& tile_scales) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "int4_matmul: x must be [M, K] bfloat16");
  TORCH_CHECK(tiles.dim() == 4, "int4_matmul: tiles must be contiguous [N/16, K/32, 8, 32] uint8");
  const Tensor x = x_in.contiguous();
  Tensor out = at::empty({x.size(0), tiles.size(0) * 16}, x.options());
  int4_matmul_into(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), x.size(1), x.size(1), tiles,
                   tile_scales, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace medusa_lean
