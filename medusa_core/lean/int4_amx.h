// The AMX-BF16 tile path of the 4-bit product (int4_matmul.h has the layout and why), built where the compiler
// targets AMX: the tile registers asked of Linux, a record's codes widened into one tile, amx_rows.
#pragma once

#include "int4_dots.h"

#if defined(MEDUSA_LEAN_AMX)

namespace medusa_lean {

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

}  // namespace medusa_lean

#endif
