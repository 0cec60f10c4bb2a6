// Routing metadata of the CPU reference (docs/SPEC.md §2.2): per-expert counts and offsets, scatter (grouped row ->
// pair), its inverse, gather (grouped row -> token) and per-token pair offsets. Deterministic: pairs of one
// expert keep ascending pair order (a stable counting sort), the order the GPU build must reproduce.
#pragma once

#include <cstdint>
#include <vector>

namespace machmoe::ref {

struct RoutingMetadata {
  std::int64_t T = 0, E = 0;
  std::vector<std::int64_t> pair_token;      // (P) token of pair p; ascending
  std::vector<std::int64_t> pair_expert;     // (P) expert of pair p
  std::vector<std::int64_t> expert_counts;   // (E)
  std::vector<std::int64_t> expert_offsets;  // (E + 1), expert_offsets[E] = P
  std::vector<std::int64_t> scatter;         // (P) sigma: grouped row g -> pair p
  std::vector<std::int64_t> inverse;         // (P) sigma^-1: pair p -> grouped row g
  std::vector<std::int64_t> gather;          // (P) gamma: grouped row g -> token
  std::vector<std::int64_t> token_offsets;   // (T + 1): pairs of token t are [token_offsets[t], token_offsets[t+1])

  std::int64_t num_pairs() const { return static_cast<std::int64_t>(pair_token.size()); }
  /// Expert owning grouped row g (the segment of expert_offsets holding g).
  std::int64_t expert_of_row(std::int64_t g) const;
};

/// Builds the metadata from pairs given in pair order. pair_token must be ascending (checked by the public API).
RoutingMetadata build_routing_metadata(std::int64_t T, std::int64_t E, std::vector<std::int64_t> pair_token,
                                       std::vector<std::int64_t> pair_expert);

/// Top-K token choice: pair p = t*K + k routes token t to topk[t*K + k].
RoutingMetadata topk_routing_metadata(const std::int64_t* topk, std::int64_t T, std::int64_t E, std::int64_t K);

/// Rebuilds the full metadata from what the forward keeps (scatter, inverse, gather, expert offsets); pair
/// tokens and experts are derived, as the GPU backward derives them.
RoutingMetadata metadata_from_grouped(std::int64_t T, std::int64_t E, std::vector<std::int64_t> scatter,
                                      std::vector<std::int64_t> inverse, std::vector<std::int64_t> gather,
                                      std::vector<std::int64_t> expert_offsets);

}  // namespace machmoe::ref
