#include "reference/routing_metadata.hpp"

#include <algorithm>
#include <utility>

namespace machmoe::ref {

std::int64_t RoutingMetadata::expert_of_row(std::int64_t g) const {
  // Last e with expert_offsets[e] <= g; skips empty experts because their offsets repeat.
  auto it = std::upper_bound(expert_offsets.begin(), expert_offsets.end(), g);
  return static_cast<std::int64_t>(it - expert_offsets.begin()) - 1;
}

static std::vector<std::int64_t> token_offsets_of(std::int64_t T, const std::vector<std::int64_t>& pair_token) {
  std::vector<std::int64_t> off(static_cast<std::size_t>(T + 1), 0);
  for (std::int64_t t : pair_token) ++off[t + 1];
  for (std::int64_t t = 0; t < T; ++t) off[t + 1] += off[t];
  return off;
}

RoutingMetadata build_routing_metadata(std::int64_t T, std::int64_t E, std::vector<std::int64_t> pair_token,
                                       std::vector<std::int64_t> pair_expert) {
  RoutingMetadata m;
  m.T = T;
  m.E = E;
  const std::int64_t P = static_cast<std::int64_t>(pair_token.size());
  m.expert_counts.assign(static_cast<std::size_t>(E), 0);
  for (std::int64_t e : pair_expert) ++m.expert_counts[e];
  m.expert_offsets.assign(static_cast<std::size_t>(E + 1), 0);
  for (std::int64_t e = 0; e < E; ++e) m.expert_offsets[e + 1] = m.expert_offsets[e] + m.expert_counts[e];
  // Stable counting sort by expert.
  std::vector<std::int64_t> next(m.expert_offsets.begin(), m.expert_offsets.end() - 1);
  m.scatter.assign(static_cast<std::size_t>(P), 0);
  m.inverse.assign(static_cast<std::size_t>(P), 0);
  m.gather.assign(static_cast<std::size_t>(P), 0);
  for (std::int64_t p = 0; p < P; ++p) {
    const std::int64_t g = next[pair_expert[p]]++;
    m.scatter[g] = p;
    m.inverse[p] = g;
    m.gather[g] = pair_token[p];
  }
  m.token_offsets = token_offsets_of(T, pair_token);
  m.pair_token = std::move(pair_token);
  m.pair_expert = std::move(pair_expert);
  return m;
}

RoutingMetadata topk_routing_metadata(const std::int64_t* topk, std::int64_t T, std::int64_t E, std::int64_t K) {
  std::vector<std::int64_t> token(static_cast<std::size_t>(T * K)), expert(topk, topk + T * K);
  for (std::int64_t p = 0; p < T * K; ++p) token[p] = p / K;
  return build_routing_metadata(T, E, std::move(token), std::move(expert));
}

RoutingMetadata metadata_from_grouped(std::int64_t T, std::int64_t E, std::vector<std::int64_t> scatter,
                                      std::vector<std::int64_t> inverse, std::vector<std::int64_t> gather,
                                      std::vector<std::int64_t> expert_offsets) {
  RoutingMetadata m;
  m.T = T;
  m.E = E;
  m.expert_offsets = std::move(expert_offsets);
  m.expert_counts.resize(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) m.expert_counts[e] = m.expert_offsets[e + 1] - m.expert_offsets[e];
  const std::int64_t P = static_cast<std::int64_t>(scatter.size());
  m.pair_token.resize(static_cast<std::size_t>(P));
  m.pair_expert.resize(static_cast<std::size_t>(P));
  m.scatter = std::move(scatter);
  m.inverse = std::move(inverse);
  m.gather = std::move(gather);
  for (std::int64_t p = 0; p < P; ++p) {
    m.pair_token[p] = m.gather[m.inverse[p]];
    m.pair_expert[p] = m.expert_of_row(m.inverse[p]);
  }
  m.token_offsets = token_offsets_of(T, m.pair_token);
  return m;
}

}  // namespace machmoe::ref
