// Corpus drafts in one call: datastore.py Datastore.chain, the walk over the index of the model's own replies.
//
// In Python a chain cost ~90 µs a step in the decoding loop (each of its lookups hashes the context's last 1..6 tokens
// in Python integers and binary-searches 1.8 M keys with numpy, a dozen small calls read cold after the backbone's
// pass; docs/BENCH.md, "Corpus lookups in one call"). Here the same hashes (splitmix64-finished, as _context_hash) and
// the same binary searches run in a loop of machine words, so the chain is the Python one token for token
// (tests/test_datastore.py compares them on random and real contexts).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace medusa_lean {

using at::Tensor;

// datastore.py _context_hash of tokens [begin, end): the length seeds it, every token is mixed in (t + 1), then
// splitmix64's finaliser; all arithmetic modulo 2^64.
inline uint64_t context_hash(const int64_t* begin, const int64_t* end) {
  uint64_t h = static_cast<uint64_t>(end - begin);
  for (const int64_t* t = begin; t < end; ++t) h = h * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(*t + 1);
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

// Up to min(limit, max_tokens) tokens drafted after `context` (Datastore.chain under a CorpusRule): each lookup takes
// the longest suffix of ≤ max_context tokens whose key is in `keys`; the first token needs a share ≥ first_share after
// a match of ≥ first_context tokens, each later one a share ≥ next_share (share = counts / totals, in double).
//   keys [E] int64 (the sorted uint64 keys' bits), tokens / counts / totals [E] int32; bits: the keys' shift.
inline std::vector<int64_t> corpus_chain(const Tensor& keys, const Tensor& tokens, const Tensor& counts, const Tensor& totals,
                                         std::vector<int64_t> context, int64_t bits, int64_t max_context, int64_t limit,
                                         int64_t max_tokens, double first_share, int64_t first_context, double next_share) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous(), "keys must be [E] int64");
  for (const Tensor* column : {&tokens, &counts, &totals}) {
    TORCH_CHECK(column->dim() == 1 && column->scalar_type() == at::kInt && column->is_contiguous() &&
                column->size(0) == keys.size(0), "tokens, counts and totals must be [E] int32, as keys");
  }
  TORCH_CHECK(bits >= 0 && bits < 64 && max_context >= 1, "bits must be in [0, 64), max_context >= 1");
  const int64_t E = keys.size(0);
  const uint64_t* key = reinterpret_cast<const uint64_t*>(keys.data_ptr<int64_t>());
  const int32_t* token = tokens.data_ptr<int32_t>();
  const int32_t* count = counts.data_ptr<int32_t>();
  const int32_t* total = totals.data_ptr<int32_t>();
  std::vector<int64_t> chain;
  const int64_t wanted = std::min(limit, max_tokens);
  while (static_cast<int64_t>(chain.size()) < wanted && E > 0) {
    const int64_t longest = std::min<int64_t>(max_context, static_cast<int64_t>(context.size()));
    const int64_t* end = context.data() + context.size();
    int64_t found = -1, matched = 0;
    for (int64_t n = longest; n >= 1 && found < 0; --n) {
      const uint64_t k = context_hash(end - n, end) >> bits;
      const uint64_t* at = std::lower_bound(key, key + E, k);
      if (at != key + E && *at == k) found = at - key, matched = n;
    }
    if (found < 0) break;
    const double share = static_cast<double>(count[found]) / static_cast<double>(total[found]);
    const bool first = chain.empty();
    if (first ? (share < first_share || matched < first_context) : share < next_share) break;
    chain.push_back(token[found]);
    context.push_back(token[found]);
  }
  return chain;
}

}  // namespace medusa_lean
