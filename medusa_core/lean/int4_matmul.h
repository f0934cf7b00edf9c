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
// not on which other linears share the call (q/k/v fused, decoder_ops.h fuse).
//
// Layout (quant/layers.py int4_tiles): a block is 16 outputs; a record (block b, group g) is 320 bytes: 256 bytes of
// codes, [8 chunks, 32] — for chunk c (inputs k0 = 32g + 4c .. k0 + 3), byte 2j + s holds code (j, k0 + s) in its low
// and (j, k0 + 2 + s) in its high nibble; widened to 16-bit words, they are the [16 outputs × 2 inputs] operand of one
// dot product each — then the 16 outputs' scales and their 16 zeros (bfloat16). tiles [N/16, K/32, 320] uint8 holds the
// records pair-major: blocks 2p and 2p + 1 group by group (g = 0: block 2p, block 2p + 1; g = 1: …), and an unpaired
// last block alone. A pair is read as one contiguous stream, which the prefetches below keep ahead of the products:
// 16 streams of codes and scales a thread (8 blocks) read ~33 GB/s where the machine reads ~46 (docs/BENCH.md, "The
// 4-bit weights as one stream").
//
// On CPUs with AMX-BF16 (Intel Sapphire Rapids and later), where Linux lets the process use the tile registers, every
// call runs amx_rows instead: a record's codes are widened as above into the [16 × 2-input pair] rows of one tile, and
// one tile product (TDPBF16PS) multiplies them by up to 16 rows' 32 inputs at once, so that the codes are widened once
// for every row of the call and a row's products cost the tile unit a sixteenth of an instruction. The scale and zero
// then follow as above, per row and group. The tile unit adds a group's products in its own order, so its bits differ
// from the AVX512-BF16 chain's (about half the groups' float32 sums, by an ulp; within one bfloat16 rounding either
// way): all rows of every call take the same path, so a row's bits still do not depend on M or the other columns.
// docs/BENCH.md, "AMX tiles for the 4-bit product", has the figures.
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


#if defined(MEDUSA_LEAN_AMX)

// True once Linux has let this process use the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// Linux ≥ 5.16; process-wide, asked once), unless $MEDUSA_LEAN_AMX is 0 (build.py AMX_ENV): a build for an AMX CPU
// runs the AVX512-BF16 path where it is refused or turned off. Decided at a process's first product, for good.
inline bool amx_permitted() {
  static const bool permitted = [] {
    const char* env = std::getenv("MEDUSA_LEAN_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return permitted;
}

// The tiles amx_rows uses: 0 and 1 the two blocks' sums [R, 16] float32 for a pass of R = min(M, 16) rows, 2 those
// rows' 32 inputs [R, 32] bfloat16, 3 and 4 the two blocks' widened codes [16 pairs, 16 × 2] bfloat16; 5, 6 and 7 as
// 0, 1 and 2 for the last pass's `tail` rows when M > 16 and M % 16 > 0.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure(int64_t R, int64_t tail) {
  TileConfig c;
  for (int t : {0, 1, 2, 3, 4}) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[2] = static_cast<uint8_t>(R);
  c.rows[3] = c.rows[4] = 16;
  if (tail > 0) {
    for (int t : {5, 6, 7}) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(tail);
  }
  _tile_loadconfig(&c);
}

// One record's codes widened to bfloat16 q − 8 as a tile's rows: row 2c (inputs 4c, 4c + 1 of the group) and 2c + 1
// (4c + 2, 4c + 3) of chunk c, each [16 outputs × 2 inputs], the words int4_group multiplies.
inline void widen_record(const uint8_t* record, uint16_t* rows, __m512i values) {
  _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + c * 32)));
    _mm512_store_si512(rows + 64 * c, _mm512_permutexvar_epi16(codes, values));
    _mm512_store_si512(rows + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), values));
  }
}

// How far ahead amx_rows prefetches its stream, in bytes (as kAheadBytes).
constexpr int64_t kAmxAheadBytes = 16384;
// Groups whose tile sums amx_rows keeps before it scales them (a row's total stays in a register over a slab): with 2,
// passes of 16 rows ran 1.10× as fast as with 1 on the demo's linears, 4 to 16 no faster (docs/BENCH.md, "AMX tiles").
constexpr int64_t kSlab = 2;

// The tile sums of one slab of groups g0 .. g0 + n − 1 for a pass of `rows` rows: each group's records widened into
// tiles 3 and 4, multiplied by the rows' inputs (tile 2 into the sums tiles 0 and 1; 7 into 5 and 6 for a `Tail`
// pass), stored as sums [n][H][rows][16] float32. The tile intrinsics take their registers as literal numbers, which
// a macro can pass on and a template parameter cannot.
#define MEDUSA_AMX_GROUP(A, C0, C1)  \
  _tile_loadd(A, xg, ldx * 2);      \
  _tile_zero(C0);                   \
  _tile_dpbf16ps(C0, A, 3);         \
  _tile_stored(C0, s0, 64);         \
  if (H == 2) {                     \
    _tile_zero(C1);                 \
    _tile_dpbf16ps(C1, A, 4);       \
    _tile_stored(C1, s1, 64);       \
  }
template <bool Tail>
inline void amx_slab(const uint16_t* x, int64_t ldx, int64_t rows, int H, const uint8_t* pair, int64_t g0, int64_t n,
                     float* sums, uint16_t* widened, __m512i values, uintptr_t limit) {
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t* records = pair + (g0 + k) * H * kRecord;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(records) + kAmxAheadBytes;  // as int4_group's prefetch
    if (ahead < limit) {
      for (int line = 0; line < H * kRecord / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * line), _MM_HINT_T0);
    }
    const uint16_t* xg = x + (g0 + k) * 32;
    float* s0 = sums + k * H * rows * 16;
    float* s1 = s0 + rows * 16;
    uint16_t* w = widened + (k & 1) * 2 * 16 * 32;  // two buffers in turn: a group's widening need not wait for the last tile loads
    widen_record(records, w, values);
    _tile_loadd(3, w, 64);
    if (H == 2) {
      widen_record(records + kRecord, w + 16 * 32, values);
      _tile_loadd(4, w + 16 * 32, 64);
    }
    if constexpr (Tail) {
      MEDUSA_AMX_GROUP(7, 5, 6)
    } else {
      MEDUSA_AMX_GROUP(2, 0, 1)
    }
  }
}
#undef MEDUSA_AMX_GROUP

// A pass of `rows` ≤ 16 rows by the H blocks of one pair, slab by slab: per row and block, group by group,
// total += scale · sum, total += zero · Σ x (int4_group's operations, in its order), the total in a register over a
// slab; the outputs rounded to bfloat16 once.
template <bool Tail>
inline void amx_pass(const uint16_t* x, int64_t ldx, int64_t rows, int H, const uint8_t* pair, const float* xsum, int64_t G,
                     uint16_t* out, int64_t ldo, float* sums, float* total, uint16_t* widened, __m512i values, uintptr_t limit) {
  alignas(64) float factors[kSlab][2][2][16];  // the slab's scales and zeros as float32: [group][block][scale, zero]
  for (int64_t g0 = 0; g0 < G; g0 += kSlab) {
    const int64_t n = std::min(kSlab, G - g0);
    amx_slab<Tail>(x, ldx, rows, H, pair, g0, n, sums, widened, values, limit);
    for (int64_t k = 0; k < n; ++k) {
      for (int b = 0; b < H; ++b) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(pair + ((g0 + k) * H + b) * kRecord + 256);
        _mm512_store_ps(factors[k][b][0], bf16_to_float(s));
        _mm512_store_ps(factors[k][b][1], bf16_to_float(s + 16));
      }
    }
    for (int b = 0; b < H; ++b) {
      for (int64_t m = 0; m < rows; ++m) {
        __m512 t = g0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(total + (m * 2 + b) * 16);
        const float* xs = xsum + m * G + g0;
        for (int64_t k = 0; k < n; ++k) {
          t = _mm512_fmadd_ps(_mm512_load_ps(sums + ((k * H + b) * rows + m) * 16), _mm512_load_ps(factors[k][b][0]), t);
          t = _mm512_fmadd_ps(_mm512_load_ps(factors[k][b][1]), _mm512_set1_ps(xs[k]), t);
        }
        _mm512_store_ps(total + (m * 2 + b) * 16, t);
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int b = 0; b < H; ++b) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(total + (m * 2 + b) * 16)));
    }
  }
}

// Rows 0 .. M − 1 by the pairs begin .. end − 1 (and, with `lone`, the unpaired block after them), pair by pair, in
// passes of 16 rows (the last pass's M % 16 with tiles 5–7): each record widened once a pass and multiplied by all
// its rows at once. Configures the tiles and releases them.
inline void amx_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint8_t* tiles, int64_t pair_bytes, const float* xsum,
                     int64_t G, int64_t begin, int64_t end, bool lone, uint16_t* out, int64_t ldo, __m512i values,
                     uintptr_t limit) {
  const int64_t R = std::min<int64_t>(M, 16), full = M / 16 * 16, tail = M > 16 ? M % 16 : 0;
  amx_configure(R, tail);
  alignas(64) uint16_t widened[2 * 2 * 16 * 32];
  alignas(64) float sums[kSlab * 2 * 16 * 16];
  alignas(64) float total[16 * 2 * 16];
  for (int64_t p = begin; p < end + lone; ++p) {
    const int H = p < end ? 2 : 1;
    const uint8_t* pair = tiles + p * pair_bytes;
    if (M <= 16) {
      amx_pass<false>(x, ldx, M, H, pair, xsum, G, out + 32 * p, ldo, sums, total, widened, values, limit);
      continue;
    }
    for (int64_t m = 0; m < full; m += 16) {
      amx_pass<false>(x + m * ldx, ldx, 16, H, pair, xsum + m * G, G, out + m * ldo + 32 * p, ldo, sums, total, widened,
                      values, limit);
    }
    if (tail > 0) {
      amx_pass<true>(x + full * ldx, ldx, tail, H, pair, xsum + full * G, G, out + full * ldo + 32 * p, ldo, sums, total,
                     widened, values, limit);
    }
  }
  _tile_release();
}

#endif

#endif

// True where this build computes int4_matmul with AVX512-BF16; elsewhere the engine keeps torch's int4-pack kernel.
inline bool has_int4_matmul() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Which kernel int4_matmul runs in this process: "amx" (amx_rows), "avx512-bf16" (int4_rows), or "" where it has none
// (has_int4_matmul).
inline std::string int4_kernel() {
#if defined(MEDUSA_LEAN_AMX)
  if (amx_permitted()) return "amx";
#endif
  return has_int4_matmul() ? "avx512-bf16" : "";
}

// Whether this thread's one-row products take the AVX512-BF16 dot products even where AMX runs every other call
// (OneRowDots). The EAGLE drafter's chain (eagle_chain.h) is one-row products whose drafts the backbone verifies: their
// bits need not match any other call's, only be the same every time, and on the AMX Xeon its products of one row ran
// faster on the dot products (the 8,192-row projection 142 µs against 295 warm; docs/BENCH.md, "The drafter's chain
// tuned per machine").
inline bool& one_row_dots() {
  thread_local bool on = false;
  return on;
}

// Within its scope, this thread's one-row products take the dot products (one_row_dots); restores the flag after.
struct OneRowDots {
  bool before = one_row_dots();
  OneRowDots() { one_row_dots() = true; }
  ~OneRowDots() { one_row_dots() = before; }
};

// Sets one_row_dots for this thread (tests: the Python calls an eagle_chain must match); returns the previous value.
inline bool set_one_row_dots(bool on) {
  const bool before = one_row_dots();
  one_row_dots() = on;
  return before;
}

// x [M, K] bfloat16 (rows ldx apart), tiles [N/16, K/32, 320] uint8 (the layout above) -> out [M, N] bfloat16 (rows N
// apart), as raw bfloat16 bits: the product without a tensor allocated (the lean step's buffers). Pairs of blocks are
// split over torch's threads; every call takes AMX where it runs, but a one-row call inside OneRowDots. Raises
// (TORCH_CHECK) on other shapes or dtypes, or in a build without AVX512-BF16 (has_int4_matmul).
inline void int4_matmul_into(const uint16_t* xp, int64_t M, int64_t K, int64_t ldx, const Tensor& tiles, uint16_t* op) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.size(2) == kRecord && tiles.is_contiguous(),
              "int4_matmul: tiles must be contiguous [N/16, K/32, 320] uint8");
  const int64_t blocks = tiles.size(0), G = tiles.size(1), N = blocks * 16;
  TORCH_CHECK(K == G * 32, "int4_matmul: x has ", K, " inputs, the weights ", G * 32);
#if defined(__AVX512BF16__)
  std::vector<float> xsum(M * G);  // Σ x over each row's groups, in input order
  group_sums(xp, M, ldx, G, xsum.data());
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const float* xs = xsum.data();
  const int64_t pair_bytes = 2 * G * kRecord, pairs = blocks / 2;
  const bool odd = blocks % 2 == 1;
#if defined(MEDUSA_LEAN_AMX)
  const bool amx = amx_permitted() && !(M == 1 && one_row_dots());
#endif
  at::parallel_for(0, pairs + odd, 4, [&](int64_t begin, int64_t end) {
    const __m512i values = code_values();
    const bool lone = odd && end == pairs + 1;  // this share ends with the unpaired block
    const uintptr_t limit = reinterpret_cast<uintptr_t>(tp) + std::min(end * pair_bytes, blocks * G * kRecord);
#if defined(MEDUSA_LEAN_AMX)
    if (amx) return amx_rows(xp, M, ldx, tp, pair_bytes, xs, G, begin, lone ? pairs : end, lone, op, N, values, limit);
#endif
    int4_rows(xp, M, ldx, tp, pair_bytes, xs, G, begin, lone ? pairs : end, lone, op, N, values, limit);
  });
#else
  TORCH_CHECK(false, "int4_matmul needs a build with AVX512-BF16 (has_int4_matmul() is false here)");
#endif
}

// x [M, K] bfloat16, tiles [N/16, K/32, 320] uint8 -> [M, N] bfloat16 (int4_matmul_into on tensors).
inline Tensor int4_matmul(const Tensor& x_in, const Tensor& tiles) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "int4_matmul: x must be [M, K] bfloat16");
  TORCH_CHECK(tiles.dim() == 3, "int4_matmul: tiles must be contiguous [N/16, K/32, 320] uint8");
  const Tensor x = x_in.contiguous();
  Tensor out = at::empty({x.size(0), tiles.size(0) * 16}, x.options());
  int4_matmul_into(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.size(0), x.size(1), x.size(1), tiles,
                   reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace medusa_lean
