// The k largest values of a float32 row and their columns, in one pass: the heads' drafts (draft_heads.h draft_top)
// and the LM head's refinement (refine_top.h) both take a row's top-k this way.
#pragma once

#include <cstdint>

#include "row_attention.h"

namespace medusa_lean {

// best[0..k−1], where[0..k−1]: the k largest of row[0..n−1] and their columns, best first, ties to the lower column
// (1 ≤ k ≤ n). Starts from the first k columns, so every column is valid even in a row of NaNs; a 16-lane compare
// against the k-th best skips most of a long row.
inline void top_columns(const float* row, int64_t n, int64_t k, float* best, int64_t* where) {
  auto insert = [&](float v, int64_t j, int64_t p) {  // v at column j goes at or above slot p
    while (p > 0 && v > best[p - 1]) {
      best[p] = best[p - 1];
      where[p] = where[p - 1];
      --p;
    }
    best[p] = v;
    where[p] = j;
  };
  for (int64_t j = 0; j < k; ++j) insert(row[j], j, j);
  for (int64_t j = k; j < n; ++j) {
    if (j + kLanes <= n && (j % kLanes) == 0) {  // skip 16 columns at once when none beats the k-th best
      const i16v above = load16(row + j) > best[k - 1];
      bool any = false;
      for (int l = 0; l < kLanes; ++l) any |= above[l] != 0;
      if (!any) {
        j += kLanes - 1;
        continue;
      }
    }
    if (row[j] > best[k - 1]) insert(row[j], j, k - 1);
  }
}

}  // namespace medusa_lean
