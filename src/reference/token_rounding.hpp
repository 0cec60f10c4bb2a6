// Token rounding (tile-aware routing, docs/SPEC.md §5) in the CPU reference.
//
// 1. Token choice: each token's top-K experts by logit, scored by the problem's score variant ("TC scores").
// 2. f_e = number of tokens choosing expert e; its target r_e is floor_M(f_e) or up_M(f_e) by the rounding rule,
//    where up_M(f) = min(ceil(f / M) * M, T) (an expert cannot take more tokens than exist).
// 3. Per expert, rank tokens by S'[t, e] = TC score if t chose e, else softmax(z_t)[e] - 1, so every choosing token
//    ranks above every other; ties go to the lower token index. Keep the first r_e. NaN scores (a NaN logit makes
//    its token's softmax row NaN) rank first among the chosen or among the others: token_rounding_ranks_before.
// 4. Emit (token, expert, score) triples sorted by (token, expert). Chosen pairs keep their TC score; padded pairs
//    get their raw softmax probability softmax(z_t)[e]. Selection is not differentiated; scores are.
// Choices documented in docs/ROUTING.md: ties of "nearest" round down (the paper's strict "<", not the code's
// round-half-even); TC scores are the variant's scores (renormalised for the paper's setting) as in the paper.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "machmoe/problem.hpp"

namespace machmoe::ref {

template <class R>
struct TokenRoundingResult {
  std::vector<std::int64_t> token;   // (P), ascending
  std::vector<std::int64_t> expert;  // (P), ascending within a token
  std::vector<R> score;              // (P)
  std::vector<std::uint8_t> chosen;  // (P): 1 if the pair is one of the token's top-K choices, 0 if padded
};

/// Token rounding's rank order of one expert's candidates: whether token a (chosen_a: one of its top-K choices; s_a
/// its S', the TC score or p - 1) ranks before token b. It is the order of the GPU's 32-bit keys
/// (src/gpu/token_rounding_kernels.cu: chosen -> 0x80000000 | bits(TC score), else bits(p); larger unsigned key
/// first, ties to the lower token), NaN included, so the reference stays the GPU's oracle:
///  * every chosen pair before every other (a TC score of 0 still ranks before a p of 1, whose S' is 0 too);
///  * within each class a NaN first: the GPU's arithmetic returns the canonical NaN 0x7fffffff whatever the sign of
///    the NaN logit, whose bits rank above those of every p in [0, 1] (and, with the chosen bit, 0xffffffff above
///    every chosen key); NaNs tie with each other, so the lower token goes first;
///  * then the larger S' (-0 and +0 equal), ties to the lower token.
/// A strict weak ordering (a total order of distinct tokens) for any scores, unlike `s_a > s_b` on NaN.
template <class R>
inline bool token_rounding_ranks_before(bool chosen_a, R s_a, std::int64_t a, bool chosen_b, R s_b, std::int64_t b) {
  if (chosen_a != chosen_b) return chosen_a;
  const bool an = std::isnan(s_a), bn = std::isnan(s_b);
  if (an != bn) return an;
  if (!an && s_a != s_b) return s_a > s_b;
  return a < b;
}

/// The rounded count r_e for an expert chosen by f tokens out of T.
std::int64_t rounded_expert_count(std::int64_t f, std::int64_t T, std::int64_t tile_m, RoundingRule rule);

template <class R>
TokenRoundingResult<R> token_rounding(ScoreVariant variant, RoundingRule rule, std::int64_t tile_m,
                                      const R* logits, std::int64_t T, std::int64_t E, std::int64_t K);

/// Gradient w.r.t. the logits (T, E) given dL/dscore of the routed pairs (pair_token[i], pair_expert[i]),
/// i < num_pairs. Which pairs were token choices is recomputed from the logits (the forward keeps the logits
/// for token rounding, not a per-pair flag).
template <class R>
std::vector<R> token_rounding_backward(ScoreVariant variant, const R* logits, std::int64_t T, std::int64_t E,
                                       std::int64_t K, const std::int64_t* pair_token,
                                       const std::int64_t* pair_expert, std::int64_t num_pairs,
                                       const R* grad_score);

}  // namespace machmoe::ref
