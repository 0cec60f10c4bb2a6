#include "reference/token_rounding.hpp"

#include <algorithm>
#include <numeric>

#include "reference/router.hpp"

namespace machmoe::ref {

std::int64_t rounded_expert_count(std::int64_t f, std::int64_t T, std::int64_t tile_m, RoundingRule rule) {
  const std::int64_t down = (f / tile_m) * tile_m;
  const std::int64_t up = std::min(((f + tile_m - 1) / tile_m) * tile_m, T);
  switch (rule) {
    case RoundingRule::kDown: return down;
    case RoundingRule::kUp: return up;
    case RoundingRule::kNearest: return (up - f < f - down) ? up : down;
  }
  return f;
}

template <class R>
TokenRoundingResult<R> token_rounding(ScoreVariant variant, RoundingRule rule, std::int64_t tile_m,
                                      const R* logits, std::int64_t T, std::int64_t E, std::int64_t K) {
  const std::vector<std::int64_t> topk = topk_experts(logits, T, E, K);
  const std::vector<R> tc_score = topk_scores(variant, logits, topk.data(), T, E, K);
  const std::vector<R> p = softmax_rows(logits, T, E);

  // Token-choice-preferred score matrix S' and the token-choice counts f_e.
  std::vector<R> s_pref(static_cast<std::size_t>(T * E));
  std::vector<std::uint8_t> chosen(static_cast<std::size_t>(T * E), 0);
  for (std::int64_t i = 0; i < T * E; ++i) s_pref[i] = p[i] - R(1);
  std::vector<std::int64_t> f(static_cast<std::size_t>(E), 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = topk[t * K + k];
      s_pref[t * E + e] = tc_score[t * K + k];
      chosen[t * E + e] = 1;
      ++f[e];
    }

  // Per expert: keep the r_e best tokens by S'.
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(T * E), 0);
  std::vector<std::int64_t> order(static_cast<std::size_t>(T));
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t r = rounded_expert_count(f[e], T, tile_m, rule);
    std::iota(order.begin(), order.end(), 0);
    // The GPU keys' order, a total order of the tokens also where scores are NaN (a NaN logit makes its token's
    // softmax row NaN; `>` on S' alone was then no strict weak ordering: undefined behaviour in the sort).
    std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return token_rounding_ranks_before(chosen[a * E + e] != 0, s_pref[a * E + e], a, chosen[b * E + e] != 0,
                                         s_pref[b * E + e], b);
    });
    for (std::int64_t i = 0; i < r; ++i) keep[order[i] * E + e] = 1;
  }

  TokenRoundingResult<R> out;
  std::vector<R> tc_at(static_cast<std::size_t>(T * E), R(0));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) tc_at[t * E + topk[t * K + k]] = tc_score[t * K + k];
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      if (!keep[t * E + e]) continue;
      out.token.push_back(t);
      out.expert.push_back(e);
      out.score.push_back(chosen[t * E + e] ? tc_at[t * E + e] : p[t * E + e]);
      out.chosen.push_back(chosen[t * E + e]);
    }
  return out;
}

template <class R>
std::vector<R> token_rounding_backward(ScoreVariant variant, const R* logits, std::int64_t T, std::int64_t E,
                                       std::int64_t K, const std::int64_t* pair_token,
                                       const std::int64_t* pair_expert, std::int64_t num_pairs,
                                       const R* grad_score) {
  const std::vector<std::int64_t> topk = topk_experts(logits, T, E, K);
  const std::vector<R> tc_score = topk_scores(variant, logits, topk.data(), T, E, K);
  // Chosen pairs: gradient of the TC scores (zero for chosen pairs that rounding dropped).
  std::vector<R> grad_tc(static_cast<std::size_t>(T * K), R(0));
  // Padded pairs: gradient of raw softmax probabilities.
  std::vector<R> grad_p(static_cast<std::size_t>(T * E), R(0));
  for (std::int64_t i = 0; i < num_pairs; ++i) {
    const std::int64_t t = pair_token[i], e = pair_expert[i];
    bool chosen = false;
    for (std::int64_t k = 0; k < K; ++k)
      if (topk[t * K + k] == e) {
        grad_tc[t * K + k] += grad_score[i];
        chosen = true;
      }
    if (!chosen) grad_p[t * E + e] += grad_score[i];
  }
  std::vector<R> dz =
      topk_scores_backward(variant, logits, topk.data(), tc_score.data(), grad_tc.data(), T, E, K);
  const std::vector<R> p = softmax_rows(logits, T, E);
  softmax_backward_accumulate(p.data(), grad_p.data(), T, E, dz.data());
  return dz;
}

#define MACHMOE_INSTANTIATE(R)                                                                                  \
  template TokenRoundingResult<R> token_rounding<R>(ScoreVariant, RoundingRule, std::int64_t, const R*,          \
                                                    std::int64_t, std::int64_t, std::int64_t);                   \
  template std::vector<R> token_rounding_backward<R>(ScoreVariant, const R*, std::int64_t, std::int64_t,         \
                                                     std::int64_t, const std::int64_t*, const std::int64_t*,     \
                                                     std::int64_t, const R*);
MACHMOE_INSTANTIATE(float)
MACHMOE_INSTANTIATE(double)
#undef MACHMOE_INSTANTIATE

}  // namespace machmoe::ref
