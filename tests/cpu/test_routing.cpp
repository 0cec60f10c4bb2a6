// Routing metadata and token rounding invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>

#include "reference/routing_metadata.hpp"
#include "reference/token_rounding.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

void expect_metadata_invariants(const ref::RoutingMetadata& m) {
  const std::int64_t P = m.num_pairs();
  ASSERT_EQ(static_cast<std::int64_t>(m.scatter.size()), P);
  ASSERT_EQ(m.expert_offsets.front(), 0);
  ASSERT_EQ(m.expert_offsets.back(), P);
  for (std::int64_t e = 0; e < m.E; ++e) {
    EXPECT_EQ(m.expert_offsets[e + 1] - m.expert_offsets[e], m.expert_counts[e]);
    for (std::int64_t g = m.expert_offsets[e]; g < m.expert_offsets[e + 1]; ++g) {
      EXPECT_EQ(m.pair_expert[m.scatter[g]], e) << "row " << g << " is in expert " << e << "'s segment";
      EXPECT_EQ(m.expert_of_row(g), e);
      if (g > m.expert_offsets[e]) { EXPECT_LT(m.scatter[g - 1], m.scatter[g]) << "ascending pair order in a segment"; }
    }
  }
  std::vector<std::int64_t> sorted = m.scatter;
  std::sort(sorted.begin(), sorted.end());
  for (std::int64_t i = 0; i < P; ++i) { EXPECT_EQ(sorted[i], i) << "scatter is a permutation"; }
  for (std::int64_t p = 0; p < P; ++p) { EXPECT_EQ(m.scatter[m.inverse[p]], p) << "inverse"; }
  for (std::int64_t g = 0; g < P; ++g) { EXPECT_EQ(m.gather[g], m.pair_token[m.scatter[g]]) << "gather"; }
  ASSERT_EQ(static_cast<std::int64_t>(m.token_offsets.size()), m.T + 1);
  EXPECT_EQ(m.token_offsets.back(), P);
  for (std::int64_t t = 0; t < m.T; ++t)
    for (std::int64_t p = m.token_offsets[t]; p < m.token_offsets[t + 1]; ++p) { EXPECT_EQ(m.pair_token[p], t); }
}

TEST(RoutingMetadata, TopKInvariants) {
  const std::int64_t T = 37, E = 9, K = 3;
  std::mt19937_64 rng(1);
  const std::vector<double> z = normal<double>(rng, T * E, 1.0);
  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), T, E, K);
  const ref::RoutingMetadata m = ref::topk_routing_metadata(topk.data(), T, E, K);
  expect_metadata_invariants(m);
  for (std::int64_t p = 0; p < T * K; ++p) { EXPECT_EQ(m.pair_token[p], p / K); }
}

TEST(RoutingMetadata, VariableKWithEmptyTokensAndExperts) {
  // Token 1 and 4 route nowhere; experts 0 and 5 get nothing.
  const ref::RoutingMetadata m =
      ref::build_routing_metadata(6, 6, {0, 0, 2, 3, 3, 3, 5}, {3, 1, 1, 4, 2, 3, 1});
  expect_metadata_invariants(m);
  EXPECT_EQ(m.expert_counts, (std::vector<std::int64_t>{0, 3, 1, 2, 1, 0}));
  EXPECT_EQ(m.token_offsets, (std::vector<std::int64_t>{0, 2, 2, 3, 6, 6, 7}));
  EXPECT_EQ(m.scatter, (std::vector<std::int64_t>{1, 2, 6, 4, 0, 5, 3}));
}

TEST(RoutingMetadata, RebuiltFromWhatTheForwardKeeps) {
  const ref::RoutingMetadata m =
      ref::build_routing_metadata(6, 6, {0, 0, 2, 3, 3, 3, 5}, {3, 1, 1, 4, 2, 3, 1});
  const ref::RoutingMetadata r = ref::metadata_from_grouped(6, 6, m.scatter, m.inverse, m.gather, m.expert_offsets);
  EXPECT_EQ(r.pair_token, m.pair_token);
  EXPECT_EQ(r.pair_expert, m.pair_expert);
  EXPECT_EQ(r.token_offsets, m.token_offsets);
  EXPECT_EQ(r.expert_counts, m.expert_counts);
}

TEST(TokenRounding, RoundedCountRules) {
  using ref::rounded_expert_count;
  // f=10, M=8: down 8, up 16; 10 is closer to 8.
  EXPECT_EQ(rounded_expert_count(10, 100, 8, RoundingRule::kDown), 8);
  EXPECT_EQ(rounded_expert_count(10, 100, 8, RoundingRule::kUp), 16);
  EXPECT_EQ(rounded_expert_count(10, 100, 8, RoundingRule::kNearest), 8);
  EXPECT_EQ(rounded_expert_count(13, 100, 8, RoundingRule::kNearest), 16);
  EXPECT_EQ(rounded_expert_count(12, 100, 8, RoundingRule::kNearest), 8) << "ties round down (paper's strict <)";
  EXPECT_EQ(rounded_expert_count(16, 100, 8, RoundingRule::kUp), 16);
  EXPECT_EQ(rounded_expert_count(16, 100, 8, RoundingRule::kDown), 16);
  EXPECT_EQ(rounded_expert_count(0, 100, 8, RoundingRule::kUp), 0);
  EXPECT_EQ(rounded_expert_count(18, 20, 16, RoundingRule::kUp), 20) << "cannot exceed the token count";
  EXPECT_EQ(rounded_expert_count(3, 5, 8, RoundingRule::kNearest), 5) << "up to all 5 tokens is nearer than 0";
}

struct TrCase {
  RoundingRule rule;
  ScoreVariant score;
  std::int64_t T, E, K, M;
};

class TokenRoundingInvariants : public testing::TestWithParam<TrCase> {};

TEST_P(TokenRoundingInvariants, Hold) {
  const TrCase c = GetParam();
  std::mt19937_64 rng(static_cast<std::uint64_t>(c.T * 31 + c.E));
  const std::vector<double> z = normal<double>(rng, c.T * c.E, 1.0);
  const ref::TokenRoundingResult<double> tr = ref::token_rounding(c.score, c.rule, c.M, z.data(), c.T, c.E, c.K);
  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), c.T, c.E, c.K);
  const std::vector<double> tc_score = ref::topk_scores(c.score, z.data(), topk.data(), c.T, c.E, c.K);
  const std::vector<double> p = ref::softmax_rows(z.data(), c.T, c.E);

  std::vector<std::int64_t> f(c.E, 0), r(c.E, 0);
  std::set<std::pair<std::int64_t, std::int64_t>> tc, kept;
  for (std::int64_t i = 0; i < c.T * c.K; ++i) {
    ++f[topk[i]];
    tc.insert({i / c.K, topk[i]});
  }
  const std::size_t P = tr.token.size();
  for (std::size_t i = 0; i < P; ++i) {
    ++r[tr.expert[i]];
    kept.insert({tr.token[i], tr.expert[i]});
    if (i > 0) {
      EXPECT_TRUE(tr.token[i - 1] < tr.token[i] || (tr.token[i - 1] == tr.token[i] && tr.expert[i - 1] < tr.expert[i]))
          << "triples sorted by (token, expert), no duplicates";
    }
    const bool is_tc = tc.count({tr.token[i], tr.expert[i]}) > 0;
    EXPECT_EQ(tr.chosen[i] != 0, is_tc);
    if (is_tc) {
      for (std::int64_t k = 0; k < c.K; ++k)
        if (topk[tr.token[i] * c.K + k] == tr.expert[i]) { EXPECT_EQ(tr.score[i], tc_score[tr.token[i] * c.K + k]); }
    } else {
      EXPECT_EQ(tr.score[i], p[tr.token[i] * c.E + tr.expert[i]]) << "padded pairs carry their softmax probability";
    }
  }
  for (std::int64_t e = 0; e < c.E; ++e) {
    EXPECT_EQ(r[e], ref::rounded_expert_count(f[e], c.T, c.M, c.rule));
    EXPECT_TRUE(r[e] % c.M == 0 || r[e] == c.T) << "expert " << e << " count " << r[e] << " is a tile multiple";
    EXPECT_LT(std::abs(r[e] - f[e]), c.M) << "at most one tile differs from top-K";
    // Within an expert: every kept token scores at least as high (by S') as every dropped one.
    double worst_kept = 2, best_dropped = -2;
    for (std::int64_t t = 0; t < c.T; ++t) {
      double s = p[t * c.E + e] - 1;
      for (std::int64_t k = 0; k < c.K; ++k)
        if (topk[t * c.K + k] == e) s = tc_score[t * c.K + k];
      if (kept.count({t, e})) worst_kept = std::min(worst_kept, s);
      else best_dropped = std::max(best_dropped, s);
    }
    EXPECT_GE(worst_kept, best_dropped);
  }
  if (c.rule == RoundingRule::kDown)
    for (const auto& pr : kept) { EXPECT_TRUE(tc.count(pr)) << "rounding down never adds a pair"; }
  if (c.rule == RoundingRule::kUp)
    for (const auto& pr : tc) { EXPECT_TRUE(kept.count(pr)) << "rounding up never drops a chosen pair"; }
  // The buffer bound holds.
  MoEProblem pb;
  pb.T = c.T, pb.E = c.E, pb.K = c.K, pb.d = 1, pb.n = 1, pb.tile_m = c.M, pb.routing = RoutingMode::kTokenRounding;
  pb.rounding = c.rule;  // the bound depends on the rule
  EXPECT_LE(static_cast<std::int64_t>(P), pb.max_pairs());
}

// The buffer bound of each rule, and that it is reached: T = 10 tokens, E = 2, K = 1, M = 8; tokens 0-4 prefer
// expert 0 and 5-9 expert 1, so f = (5, 5). Nearest rounds both up to 8 (8 - 5 = 3 = M/2 - 1 < 5 - 0): 16 pairs,
// exactly T*K + E*(M/2 - 1). Up gives the same 16 (its bound, T*K + E*(M - 1) = 24, is capped at T*E = 20); down
// keeps nothing (bound T*K).
TEST(TokenRounding, PairBoundOfEachRuleHoldsAndNearestsIsReached) {
  const std::int64_t T = 10, E = 2, K = 1, M = 8;
  std::vector<double> z(T * E);
  for (std::int64_t t = 0; t < T; ++t) {
    z[t * E + 0] = t < 5 ? 1.0 + 0.01 * t : -1.0 - 0.01 * t;
    z[t * E + 1] = -z[t * E + 0];
  }
  MoEProblem pb;
  pb.T = T, pb.E = E, pb.K = K, pb.d = 1, pb.n = 1, pb.tile_m = M, pb.routing = RoutingMode::kTokenRounding;
  const std::pair<RoundingRule, std::int64_t> expected[] = {
      {RoundingRule::kNearest, 16}, {RoundingRule::kUp, 16}, {RoundingRule::kDown, 0}};
  for (const auto& [rule, pairs] : expected) {
    pb.rounding = rule;
    const auto tr = ref::token_rounding(ScoreVariant::kSoftmaxOverTopK, rule, M, z.data(), T, E, K);
    EXPECT_EQ(static_cast<std::int64_t>(tr.token.size()), pairs) << rounding_rule_name(rule);
    EXPECT_LE(static_cast<std::int64_t>(tr.token.size()), pb.max_pairs()) << rounding_rule_name(rule);
  }
  pb.rounding = RoundingRule::kNearest;
  EXPECT_EQ(pb.max_pairs(), T * K + E * (M / 2 - 1)) << "reached above";
  pb.rounding = RoundingRule::kUp;
  EXPECT_EQ(pb.max_pairs(), T * E) << "T*K + E*(M - 1) = 24, capped at T*E";
  pb.rounding = RoundingRule::kDown;
  EXPECT_EQ(pb.max_pairs(), T * K);
  // 7B (T, E, K) = (24576, 128, 8) at M = 128: nearest reserves E*63 pairs over T*K, up E*127.
  pb.T = 24576, pb.E = 128, pb.K = 8, pb.tile_m = 128;
  pb.rounding = RoundingRule::kNearest;
  EXPECT_EQ(pb.max_pairs(), 24576 * 8 + 128 * 63);
  pb.rounding = RoundingRule::kUp;
  EXPECT_EQ(pb.max_pairs(), 24576 * 8 + 128 * 127);
}

// NaN router logits (docs/ROUTING.md, "NaN"): a NaN logit makes its token's softmax row NaN (and, for the
// variants that take it or when the selection holds a NaN, TC scores NaN). Ranking them must stay a strict weak
// ordering (the old `a > b` on S' was not: NaN compared "equal" to everything) and follow the GPU keys: per expert,
// every chosen pair first, within each class NaN first, then larger S' first, ties to the lower token. The expected
// selection is computed from that rule here, for each rounding rule and score variant, in fp64 and fp32.
template <class R>
void check_nan_selection(RoundingRule rule, ScoreVariant variant) {
  const std::int64_t T = 64, E = 4, K = 2, M = 8;
  std::mt19937_64 rng(7);
  std::vector<R> z = normal<R>(rng, T * E, 1.0);
  const R nan = std::numeric_limits<R>::quiet_NaN();
  // One NaN logit that top-K ranks last (the token still chooses two finite experts): its p row is NaN.
  for (std::int64_t t : {3, 11, 12, 29, 40, 51}) z[t * E + (t % E)] = (t % 2) ? nan : -nan;
  // Whole rows NaN: top-K takes experts 0 and 1 (NaN ranks last, ties to the lower expert); every score NaN.
  for (std::int64_t t : {6, 33})
    for (std::int64_t e = 0; e < E; ++e) z[t * E + e] = nan;

  const ref::TokenRoundingResult<R> tr = ref::token_rounding(variant, rule, M, z.data(), T, E, K);
  const ref::TokenRoundingResult<R> again = ref::token_rounding(variant, rule, M, z.data(), T, E, K);
  EXPECT_EQ(tr.token, again.token) << "deterministic";
  EXPECT_EQ(tr.expert, again.expert) << "deterministic";

  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), T, E, K);
  const std::vector<R> tc = ref::topk_scores(variant, z.data(), topk.data(), T, E, K);
  const std::vector<R> p = ref::softmax_rows(z.data(), T, E);
  EXPECT_EQ(topk[6 * K + 0], 0);
  EXPECT_EQ(topk[6 * K + 1], 1);
  std::set<std::pair<std::int64_t, std::int64_t>> expected;
  std::int64_t nan_padded = 0, nan_chosen_kept = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    struct Cand {
      bool chosen, nan;
      R s;
      std::int64_t t;
    };
    std::vector<Cand> c;
    std::int64_t f = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      Cand x{false, false, p[t * E + e] - R(1), t};
      for (std::int64_t k = 0; k < K; ++k)
        if (topk[t * K + k] == e) x.chosen = true, x.s = tc[t * K + k], ++f;
      x.nan = std::isnan(x.s);
      c.push_back(x);
    }
    std::sort(c.begin(), c.end(), [](const Cand& a, const Cand& b) {
      if (a.chosen != b.chosen) return a.chosen;
      if (a.nan != b.nan) return a.nan;
      if (!a.nan && a.s != b.s) return a.s > b.s;
      return a.t < b.t;
    });
    const std::int64_t r = ref::rounded_expert_count(f, T, M, rule);
    for (std::int64_t i = 0; i < r; ++i) {
      expected.insert({c[i].t, e});
      if (c[i].nan) (c[i].chosen ? nan_chosen_kept : nan_padded) += 1;
    }
  }
  std::set<std::pair<std::int64_t, std::int64_t>> kept;
  for (std::size_t i = 0; i < tr.token.size(); ++i) kept.insert({tr.token[i], tr.expert[i]});
  EXPECT_EQ(kept.size(), tr.token.size()) << "no duplicated pair";
  EXPECT_TRUE(kept == expected) << rounding_rule_name(rule) << " " << score_variant_name(variant)
                                << ": the kept pairs differ from the GPU keys' order";
  if (rule == RoundingRule::kUp) { EXPECT_GT(nan_padded, 0) << "the case pads with NaN rows (they rank first)"; }
  EXPECT_GT(nan_chosen_kept, 0) << "the case keeps chosen NaN scores";
}

// The comparator itself, over chosen and padded candidates with NaN (either sign), -0, and the chosen TC score 0
// against the padded p = 1 (both S' = 0): a strict weak ordering, and the order of the GPU's keys
// (token_rounding_kernels.cu: chosen -> 0x80000000 | bits(TC score), else bits(p), larger first, ties to the lower
// token; a NaN score is the canonical 0x7fffffff there, whatever the NaN logit's sign). p - 1 is exact for the p below.
TEST(TokenRounding, RankOrderIsStrictWeakAndTheGpuKeysOrder) {
  struct Cand {
    bool chosen;
    float v;  // TC score (chosen) or p
    std::int64_t t;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<Cand> c;
  std::int64_t t = 0;
  for (float v : {0.0f, -0.0f, 0.25f, 0.5f, 1.0f, nan, -nan, 0.5f, nan}) {
    c.push_back({true, v, t++});
    c.push_back({false, v, t++});
  }
  for (std::size_t i = 0; i < c.size(); ++i) std::swap(c[i], c[(i * 7 + 3) % c.size()]);  // tokens out of order
  auto gpu_key = [](const Cand& x) {
    std::uint32_t bits = 0x7fffffffu;  // the GPU's NaN
    if (!std::isnan(x.v)) std::memcpy(&bits, &x.v, sizeof bits);
    if (x.v == 0.0f) bits = 0;  // a score of -0 does not occur on the GPU (p and TC scores are >= +0)
    return x.chosen ? 0x80000000u | bits : bits;
  };
  auto before = [](const Cand& a, const Cand& b) {
    return ref::token_rounding_ranks_before<double>(a.chosen, a.chosen ? a.v : double(a.v) - 1.0, a.t, b.chosen,
                                                   b.chosen ? b.v : double(b.v) - 1.0, b.t);
  };
  for (const Cand& a : c) {
    EXPECT_FALSE(before(a, a)) << "irreflexive";
    for (const Cand& b : c) {
      if (a.t == b.t) continue;
      EXPECT_NE(before(a, b), before(b, a)) << "distinct tokens are ordered: " << a.t << " " << b.t;
      const std::uint32_t ka = gpu_key(a), kb = gpu_key(b);
      EXPECT_EQ(before(a, b), ka > kb || (ka == kb && a.t < b.t)) << "the GPU keys' order: " << a.t << " " << b.t;
      for (const Cand& d : c)
        if (before(a, b) && before(b, d)) { EXPECT_TRUE(before(a, d)) << "transitive"; }
    }
  }
  // The cases the brief names: chosen NaN first of all, padded NaN above every padded p but below every chosen pair,
  // a chosen TC score of 0 before a padded p of 1 (S' 0 both).
  EXPECT_TRUE(ref::token_rounding_ranks_before<double>(true, nan, 9, true, 1.0, 0));
  EXPECT_TRUE(ref::token_rounding_ranks_before<double>(false, nan, 9, false, 0.0, 0));
  EXPECT_TRUE(ref::token_rounding_ranks_before<double>(true, 0.0, 9, false, nan, 0));
  EXPECT_TRUE(ref::token_rounding_ranks_before<double>(true, 0.0, 9, false, 0.0, 0));
}

TEST(TokenRounding, NaNLogitsRankAsTheGpuKeysDo) {
  for (RoundingRule rule : {RoundingRule::kUp, RoundingRule::kNearest, RoundingRule::kDown})
    for (ScoreVariant v :
         {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm}) {
      SCOPED_TRACE(std::string(rounding_rule_name(rule)) + " " + score_variant_name(v));
      check_nan_selection<double>(rule, v);
      check_nan_selection<float>(rule, v);
    }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, TokenRoundingInvariants,
    testing::Values(TrCase{RoundingRule::kNearest, ScoreVariant::kSoftmaxOverTopK, 256, 8, 2, 16},
                    TrCase{RoundingRule::kUp, ScoreVariant::kSoftmaxOverTopK, 256, 8, 2, 16},
                    TrCase{RoundingRule::kDown, ScoreVariant::kSoftmaxOverTopK, 256, 8, 2, 16},
                    TrCase{RoundingRule::kNearest, ScoreVariant::kTopKOfSoftmax, 200, 16, 4, 8},
                    TrCase{RoundingRule::kUp, ScoreVariant::kTopKOfSoftmaxRenorm, 200, 16, 4, 8},
                    TrCase{RoundingRule::kDown, ScoreVariant::kTopKOfSoftmax, 200, 16, 4, 8},
                    TrCase{RoundingRule::kUp, ScoreVariant::kSoftmaxOverTopK, 30, 4, 2, 16},     // up capped at T
                    TrCase{RoundingRule::kNearest, ScoreVariant::kSoftmaxOverTopK, 128, 4, 4, 32}));  // K = E

}  // namespace
}  // namespace machmoe::test
