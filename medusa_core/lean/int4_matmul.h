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
// The two paths live in int4_dots.h (AVX512-BF16 dot products) and int4_amx.h (AMX tiles); this file chooses
// between them per call.
#pragma once

#include <torch/extension.h>

#include <string>

#include "int4_amx.h"
#include "int4_dots.h"

namespace medusa_lean {

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
