// Router reference: top-K ties, the score variants, their backward (finite differences and the renormalised
// variant's identity), and the router losses.
#include <gtest/gtest.h>

#include "reference/losses.hpp"
#include "reference/router.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

TEST(TopK, TiesGoToTheLowerExpertIndexAndOrderIsDescending) {
  const std::vector<double> z = {1.0, 3.0, 3.0, 2.0, 3.0,   // token 0: three-way tie at 3
                                 0.5, 0.5, 0.5, 0.5, 0.5};  // token 1: all equal
  const std::vector<std::int64_t> idx = ref::topk_experts(z.data(), 2, 5, 3);
  EXPECT_EQ(idx, (std::vector<std::int64_t>{1, 2, 4, 0, 1, 2}));
  const std::vector<std::int64_t> idx2 = ref::topk_experts(z.data(), 2, 5, 4);
  EXPECT_EQ(idx2, (std::vector<std::int64_t>{1, 2, 4, 3, 0, 1, 2, 3}));
}

TEST(TopK, NaNRanksLastInsteadOfBreakingTheOrder) {
  const std::vector<double> z = {std::nan(""), 1.0, 2.0};
  EXPECT_EQ(ref::topk_experts(z.data(), 1, 3, 2), (std::vector<std::int64_t>{2, 1}));
}

class ScoreVariants : public testing::TestWithParam<ScoreVariant> {};

TEST_P(ScoreVariants, BackwardMatchesFiniteDifferences) {
  const ScoreVariant v = GetParam();
  const std::int64_t T = 5, E = 6, K = 3;
  std::mt19937_64 rng(7);
  std::vector<double> z = normal<double>(rng, T * E, 1.0);
  const std::vector<double> g = normal<double>(rng, T * K, 1.0);
  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), T, E, K);
  auto loss = [&](const std::vector<double>& zz) {
    const std::vector<double> s = ref::topk_scores(v, zz.data(), topk.data(), T, E, K);
    double l = 0;
    for (std::size_t i = 0; i < s.size(); ++i) l += s[i] * g[i];
    return l;
  };
  const std::vector<double> s = ref::topk_scores(v, z.data(), topk.data(), T, E, K);
  const std::vector<double> dz = ref::topk_scores_backward(v, z.data(), topk.data(), s.data(), g.data(), T, E, K);
  std::vector<double> fd(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    const double keep = z[i];
    z[i] = keep + 1e-6;
    const double up = loss(z);
    z[i] = keep - 1e-6;
    const double down = loss(z);
    z[i] = keep;
    fd[i] = (up - down) / 2e-6;
  }
  EXPECT_LT(rel_error(dz, fd), 1e-8);
}

INSTANTIATE_TEST_SUITE_P(All, ScoreVariants,
                         testing::Values(ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax,
                                         ScoreVariant::kTopKOfSoftmaxRenorm),
                         [](const testing::TestParamInfo<ScoreVariant>& i) { return score_variant_name(i.param); });

TEST(ScoreVariants, RenormalisedTopKOfSoftmaxEqualsSoftmaxOverTopKAndItsDenseGradientVanishes) {
  const std::int64_t T = 4, E = 8, K = 3;
  std::mt19937_64 rng(11);
  const std::vector<double> z = normal<double>(rng, T * E, 2.0);
  const std::vector<double> g = normal<double>(rng, T * K, 1.0);
  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), T, E, K);
  const std::vector<double> sa = ref::topk_scores(ScoreVariant::kSoftmaxOverTopK, z.data(), topk.data(), T, E, K);
  const std::vector<double> sb = ref::topk_scores(ScoreVariant::kTopKOfSoftmaxRenorm, z.data(), topk.data(), T, E, K);
  EXPECT_LT(rel_error(sb, sa), 1e-14);
  // The dense formula of docs/SPEC.md §2.1 (b): dz_i = p_i (dp_i - dot) over all E experts.
  const std::vector<double> p = ref::softmax_rows(z.data(), T, E);
  std::vector<double> dense(T * E, 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    double S = 0, gs = 0;
    for (std::int64_t k = 0; k < K; ++k) S += p[t * E + topk[t * K + k]];
    for (std::int64_t k = 0; k < K; ++k) gs += g[t * K + k] * p[t * E + topk[t * K + k]] / S;
    std::vector<double> dp(E, 0.0);
    for (std::int64_t k = 0; k < K; ++k) dp[topk[t * K + k]] = (g[t * K + k] - gs) / S;
    double dot = 0;
    for (std::int64_t k = 0; k < K; ++k) dot += dp[topk[t * K + k]] * p[t * E + topk[t * K + k]];
    EXPECT_NEAR(dot, 0.0, 1e-14);
    for (std::int64_t i = 0; i < E; ++i) dense[t * E + i] = p[t * E + i] * (dp[i] - dot);
  }
  const std::vector<double> dz = ref::topk_scores_backward<double>(ScoreVariant::kTopKOfSoftmaxRenorm, nullptr, topk.data(),
                                                           sb.data(), g.data(), T, E, K);
  EXPECT_LT(rel_error(dz, dense), 1e-13);
}

TEST(ScoreVariants, NormalisationProperties) {
  const std::int64_t T = 3, E = 7, K = 2;
  std::mt19937_64 rng(3);
  const std::vector<double> z = normal<double>(rng, T * E, 1.0);
  const std::vector<std::int64_t> topk = ref::topk_experts(z.data(), T, E, K);
  for (ScoreVariant v : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm}) {
    const std::vector<double> s = ref::topk_scores(v, z.data(), topk.data(), T, E, K);
    for (std::int64_t t = 0; t < T; ++t) {
      const double sum = s[t * K] + s[t * K + 1];
      if (v == ScoreVariant::kTopKOfSoftmax) {
        EXPECT_LT(sum, 1.0);
        EXPECT_GE(s[t * K], s[t * K + 1]);
      } else {
        EXPECT_NEAR(sum, 1.0, 1e-15);
      }
    }
  }
}

TEST(RouterLosses, KnownValues) {
  const std::int64_t T = 4, E = 4;
  const std::vector<double> zeros(T * E, 0.0);
  const std::vector<std::int64_t> counts = {3, 1, 0, 4};
  // Uniform router probabilities: aux = E * sum_e (1/E) (f_e / sum f) = 1 whatever the counts.
  EXPECT_NEAR(ref::load_balancing_loss(zeros.data(), counts.data(), T, E).loss, 1.0, 1e-15);
  EXPECT_NEAR(ref::router_z_loss(zeros.data(), T, E).loss, std::log(4.0) * std::log(4.0), 1e-14);
  const std::vector<std::int64_t> none = {0, 0, 0, 0};
  EXPECT_EQ(ref::load_balancing_loss(zeros.data(), none.data(), T, E).loss, 0.0);
}

TEST(RouterLosses, GradientsMatchFiniteDifferences) {
  const std::int64_t T = 5, E = 6;
  std::mt19937_64 rng(5);
  std::vector<double> z = normal<double>(rng, T * E, 1.5);
  const std::vector<std::int64_t> counts = {4, 0, 2, 1, 2, 1};
  for (int which = 0; which < 2; ++which) {
    auto eval = [&](const std::vector<double>& zz) {
      return which == 0 ? ref::load_balancing_loss(zz.data(), counts.data(), T, E)
                        : ref::router_z_loss(zz.data(), T, E);
    };
    const std::vector<double> g = eval(z).grad_logits;
    std::vector<double> fd(z.size());
    for (std::size_t i = 0; i < z.size(); ++i) {
      const double keep = z[i];
      z[i] = keep + 1e-6;
      const double up = eval(z).loss;
      z[i] = keep - 1e-6;
      const double down = eval(z).loss;
      z[i] = keep;
      fd[i] = (up - down) / 2e-6;
    }
    EXPECT_LT(rel_error(g, fd), 1e-7) << (which == 0 ? "load balancing" : "z-loss");
  }
}

}  // namespace
}  // namespace machmoe::test
