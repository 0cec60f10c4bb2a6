// Random inputs of combine_rows / combine_rows_backward (include/machmoe/combine.hpp) and a float64 oracle written
// pair by pair (the library's reference goes token by token).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace machmoe::test {

struct CombineCase {
  std::int64_t T = 0, d = 0, R = 0, top_k = 0, P = 0;  // top_k 0: token_offsets give the pairs
  std::vector<std::int32_t> token_offsets;              // (T + 1) or empty
  std::vector<std::int32_t> row_of_pair;                // (P): a row, or -1
  std::vector<double> rows, scores, grad_out;           // (R, d), (P), (T, d)
};

struct CombineCaseOptions {
  std::int64_t T = 16, d = 64, top_k = 4;  // top_k 0: 0..max_pairs pairs per token
  std::int64_t max_pairs = 6;              // with top_k 0
  std::int64_t padding_pairs = 0;          // with top_k 0: pairs after the last token's
  double unsent = 0.0;                     // share of the pairs that read no row (-1)
  std::int64_t spare_rows = 0;             // rows no pair reads
  std::uint64_t seed = 1;
};

/// Realistic magnitudes: rows and grad_out ~ N(0, 1), scores in (0, 1) (softmax-like).
inline CombineCase make_combine_case(const CombineCaseOptions& o) {
  std::mt19937_64 rng(o.seed);
  CombineCase c;
  c.T = o.T, c.d = o.d, c.top_k = o.top_k;
  if (o.top_k > 0) {
    c.P = o.T * o.top_k;
  } else {
    std::uniform_int_distribution<std::int64_t> n(0, o.max_pairs);
    c.token_offsets.push_back(0);
    for (std::int64_t t = 0; t < o.T; ++t) c.token_offsets.push_back(c.token_offsets.back() + static_cast<std::int32_t>(n(rng)));
    c.P = c.token_offsets.back() + o.padding_pairs;
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<bool> sent(static_cast<std::size_t>(c.P));
  std::int64_t used = 0;
  for (std::int64_t p = 0; p < c.P; ++p) used += (sent[p] = u(rng) >= o.unsent) ? 1 : 0;
  c.R = used + o.spare_rows;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(c.R));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.row_of_pair.assign(static_cast<std::size_t>(c.P), -1);
  for (std::int64_t p = 0, next = 0; p < c.P; ++p)
    if (sent[p]) c.row_of_pair[p] = perm[next++];
  std::normal_distribution<double> normal(0.0, 1.0);
  c.rows.resize(static_cast<std::size_t>(c.R * c.d));
  for (double& v : c.rows) v = normal(rng);
  c.grad_out.resize(static_cast<std::size_t>(c.T * c.d));
  for (double& v : c.grad_out) v = normal(rng);
  c.scores.resize(static_cast<std::size_t>(c.P));
  for (double& v : c.scores) v = 0.05 + 0.9 * u(rng);
  return c;
}

struct CombineOracle {
  std::vector<double> out, grad_rows, grad_scores;  // grad_rows: 0 where no pair reads the row
};

inline CombineOracle combine_oracle(const CombineCase& c) {
  CombineOracle o;
  o.out.assign(static_cast<std::size_t>(c.T * c.d), 0.0);
  o.grad_rows.assign(static_cast<std::size_t>(c.R * c.d), 0.0);
  o.grad_scores.assign(static_cast<std::size_t>(c.P), 0.0);
  for (std::int64_t p = 0; p < c.P; ++p) {
    std::int64_t t = -1;
    if (c.top_k > 0) {
      t = p / c.top_k;
    } else {
      const auto it = std::upper_bound(c.token_offsets.begin(), c.token_offsets.end(), static_cast<std::int32_t>(p));
      if (it != c.token_offsets.end()) t = (it - c.token_offsets.begin()) - 1;  // else a padding pair
    }
    const std::int32_t r = c.row_of_pair[p];
    if (t < 0 || r < 0) continue;
    for (std::int64_t k = 0; k < c.d; ++k) {
      o.out[t * c.d + k] += c.scores[p] * c.rows[r * c.d + k];
      o.grad_rows[r * c.d + k] = c.scores[p] * c.grad_out[t * c.d + k];
      o.grad_scores[p] += c.grad_out[t * c.d + k] * c.rows[r * c.d + k];
    }
  }
  return o;
}

}  // namespace machmoe::test
