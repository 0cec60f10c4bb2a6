// combine_rows / combine_rows_backward on the CPU (include/machmoe/combine.hpp): against a float64 oracle written
// pair by pair, the adjoint identities of a bilinear map, fp32 against fp64, edge cases, and the argument checks.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "combine_case.hpp"
#include "machmoe/combine.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

template <class R>
std::vector<R> cast(const std::vector<double>& v) {
  return std::vector<R>(v.begin(), v.end());
}

template <class R>
std::vector<double> widen(const std::vector<R>& v) {
  return std::vector<double>(v.begin(), v.end());
}

/// The library's results on host buffers of type R (fp32 or fp64).
template <class R>
struct HostRun {
  std::vector<R> out, grad_rows, grad_scores;
};

template <class R>
HostRun<R> run_host(const CombineCase& c, bool want_rows = true, bool want_scores = true, R rows_fill = R(0)) {
  const DType dt = sizeof(R) == 8 ? DType::kFP64 : DType::kFP32;
  std::vector<R> rows = cast<R>(c.rows), scores = cast<R>(c.scores), grad_out = cast<R>(c.grad_out);
  std::vector<std::int32_t> rp = c.row_of_pair, off = c.token_offsets;
  HostRun<R> h;
  h.out.assign(static_cast<std::size_t>(c.T * c.d), R(-7));
  h.grad_rows.assign(static_cast<std::size_t>(c.R * c.d), rows_fill);
  h.grad_scores.assign(static_cast<std::size_t>(c.P), R(-7));
  const TensorView v_rows = TensorView::contiguous(rows.data(), dt, {c.R, c.d});
  const TensorView v_scores = TensorView::contiguous(scores.data(), dt, {c.P});
  const TensorView v_rp = TensorView::contiguous(rp.data(), DType::kInt32, {c.P});
  const TensorView v_off = off.empty() ? TensorView() : TensorView::contiguous(off.data(), DType::kInt32, {c.T + 1});
  combine_rows(v_rows, v_scores, v_rp, v_off, c.top_k, TensorView::contiguous(h.out.data(), dt, {c.T, c.d}));
  combine_rows_backward(TensorView::contiguous(grad_out.data(), dt, {c.T, c.d}), v_rows, v_scores, v_rp, v_off,
                        c.top_k,
                        want_rows ? TensorView::contiguous(h.grad_rows.data(), dt, {c.R, c.d}) : TensorView(),
                        want_scores ? TensorView::contiguous(h.grad_scores.data(), dt, {c.P}) : TensorView());
  return h;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<CombineCaseOptions> cases() {
  std::vector<CombineCaseOptions> v;
  v.push_back({});                                                      // top-K, every pair sent
  v.push_back({1, 8, 1});                                               // T = 1, K = 1
  v.push_back({33, 24, 8, 6, 0, 0.3, 5, 2});                            // top-K with unsent pairs, spare rows
  v.push_back({40, 17, 0, 7, 9, 0.2, 3, 3});                            // variable pairs, padding, odd d
  v.push_back({12, 32, 0, 0, 4, 0.0, 0, 4});                            // no token has a pair
  v.push_back({6, 16, 70, 6, 0, 0.1, 0, 5});                            // 70 pairs per token (K = E-sized)
  return v;
}

TEST(Combine, Fp64MatchesOracle) {
  for (const CombineCaseOptions& o : cases()) {
    const CombineCase c = make_combine_case(o);
    const CombineOracle ref = combine_oracle(c);
    const HostRun<double> h = run_host<double>(c);
    EXPECT_LT(rel_error(h.out, ref.out), 1e-14) << "seed " << o.seed;
    EXPECT_LT(rel_error(h.grad_rows, ref.grad_rows), 1e-15) << "seed " << o.seed;
    EXPECT_LT(rel_error(h.grad_scores, ref.grad_scores), 1e-14) << "seed " << o.seed;
    for (std::int64_t p = 0; p < c.P; ++p)
      if (c.row_of_pair[p] < 0) {
        EXPECT_EQ(h.grad_scores[p], 0.0) << "unsent pair " << p << ", seed " << o.seed;
      }
  }
}

TEST(Combine, AdjointIdentities) {
  // out is linear in rows and in scores: <grad_out, out> = <grad_rows, rows> = <scores, grad_scores>.
  for (const CombineCaseOptions& o : cases()) {
    const CombineCase c = make_combine_case(o);
    const HostRun<double> h = run_host<double>(c);
    const double a = dot(c.grad_out, h.out), b = dot(h.grad_rows, c.rows), s = dot(c.scores, h.grad_scores);
    const double scale = std::max(1.0, std::abs(a));
    EXPECT_NEAR(a, b, 1e-12 * scale) << "seed " << o.seed;
    EXPECT_NEAR(a, s, 1e-12 * scale) << "seed " << o.seed;
  }
}

TEST(Combine, Fp32AgreesWithFp64) {
  for (const CombineCaseOptions& o : cases()) {
    const CombineCase c = make_combine_case(o);
    const HostRun<double> r = run_host<double>(c);
    const HostRun<float> f = run_host<float>(c);
    EXPECT_LT(rel_error(widen(f.out), r.out), 1e-6) << "seed " << o.seed;
    EXPECT_LT(rel_error(widen(f.grad_rows), r.grad_rows), 1e-6) << "seed " << o.seed;
    EXPECT_LT(rel_error(widen(f.grad_scores), r.grad_scores), 1e-6) << "seed " << o.seed;
  }
}

TEST(Combine, RowsNoPairReadsAreLeftAlone) {
  const CombineCase c = make_combine_case({20, 8, 3, 6, 0, 0.4, 6, 9});
  const HostRun<double> h = run_host<double>(c, true, true, 5.0);
  std::vector<bool> read(static_cast<std::size_t>(c.R), false);
  for (std::int32_t r : c.row_of_pair)
    if (r >= 0) read[r] = true;
  std::int64_t untouched = 0;
  for (std::int64_t r = 0; r < c.R; ++r)
    if (!read[r]) {
      ++untouched;
      for (std::int64_t k = 0; k < c.d; ++k) ASSERT_EQ(h.grad_rows[r * c.d + k], 5.0) << "row " << r;
    }
  EXPECT_GE(untouched, 6);
}

TEST(Combine, PaddingPairsGetZeroScoreGradients) {
  const CombineCase c = make_combine_case({10, 8, 0, 3, 7, 0.0, 0, 11});
  const HostRun<double> h = run_host<double>(c);
  for (std::int64_t p = c.token_offsets.back(); p < c.P; ++p) EXPECT_EQ(h.grad_scores[p], 0.0) << "pair " << p;
}

TEST(Combine, EitherGradientAlone) {
  const CombineCase c = make_combine_case({9, 16, 3, 6, 0, 0.2, 1, 12});
  const HostRun<double> both = run_host<double>(c);
  const HostRun<double> rows_only = run_host<double>(c, true, false);
  const HostRun<double> scores_only = run_host<double>(c, false, true);
  EXPECT_EQ(rows_only.grad_rows, both.grad_rows);
  EXPECT_EQ(scores_only.grad_scores, both.grad_scores);
}

TEST(Combine, WithoutScoresIsThePlainSum) {
  CombineCase c = make_combine_case({15, 12, 0, 5, 3, 0.2, 2, 15});
  std::vector<double> out_none(static_cast<std::size_t>(c.T * c.d));
  std::vector<double> rows = c.rows;
  std::vector<std::int32_t> rp = c.row_of_pair, off = c.token_offsets;
  combine_rows(TensorView::contiguous(rows.data(), DType::kFP64, {c.R, c.d}), TensorView(),
               TensorView::contiguous(rp.data(), DType::kInt32, {c.P}),
               TensorView::contiguous(off.data(), DType::kInt32, {c.T + 1}), 0,
               TensorView::contiguous(out_none.data(), DType::kFP64, {c.T, c.d}));
  std::fill(c.scores.begin(), c.scores.end(), 1.0);
  EXPECT_LT(rel_error(out_none, combine_oracle(c).out), 1e-15);
  expect_error([&] {
    combine_rows_backward(TensorView::contiguous(c.grad_out.data(), DType::kFP64, {c.T, c.d}),
                          TensorView::contiguous(rows.data(), DType::kFP64, {c.R, c.d}), TensorView(),
                          TensorView::contiguous(rp.data(), DType::kInt32, {c.P}),
                          TensorView::contiguous(off.data(), DType::kInt32, {c.T + 1}), 0, TensorView(), TensorView());
  }, {"combine_rows_backward", "scores"});
}

TEST(Combine, PaddingPairsAreNotChecked) {
  // Pairs after the last token's end are ignored: their rows may hold anything.
  CombineCase c = make_combine_case({10, 8, 0, 3, 4, 0.0, 0, 16});
  const HostRun<double> want = run_host<double>(c);
  c.row_of_pair[c.P - 1] = 1 << 30;
  c.row_of_pair[c.P - 2] = c.row_of_pair[0];
  const HostRun<double> got = run_host<double>(c);
  EXPECT_EQ(got.out, want.out);
  EXPECT_EQ(got.grad_rows, want.grad_rows);
  EXPECT_EQ(got.grad_scores, want.grad_scores);
}

TEST(Combine, RejectsAHugeTopK) {
  std::vector<double> rows(12), out(16);
  std::vector<std::int32_t> rp;
  expect_error([&] {
    combine_rows(TensorView::contiguous(rows.data(), DType::kFP64, {3, 4}), TensorView(),
                 TensorView::contiguous(rp.data(), DType::kInt32, {0}), TensorView(), std::int64_t{1} << 62,
                 TensorView::contiguous(out.data(), DType::kFP64, {4, 4}));
  }, {"top_k", "K in [1, 2^31 - 1]"});
}

TEST(Combine, ZeroTokens) {
  CombineCase c = make_combine_case({0, 8, 2, 6, 0, 0.0, 3, 13});
  const HostRun<double> h = run_host<double>(c);
  EXPECT_TRUE(h.out.empty());
  EXPECT_TRUE(h.grad_scores.empty());
}

TEST(Combine, ViewsWithoutElementsTakeAnyStrides) {
  // What autograd hands over for no rows: (0, d) with strides (0, 0) and a null pointer. Such views address
  // nothing, so the contiguity rule does not apply to them (docs/VALIDATION.md).
  const TensorView none = TensorView::strided(nullptr, DType::kFP64, {0, 4}, {0, 0});
  // An expert-parallel rank that received no rows: every pair reads no row, and out is zero.
  std::vector<std::int32_t> rp = {-1, -1};
  std::vector<double> out(8, 5.0);
  combine_rows(none, TensorView(), TensorView::contiguous(rp.data(), DType::kInt32, {2}), TensorView(), 1,
               TensorView::contiguous(out.data(), DType::kFP64, {2, 4}));
  EXPECT_EQ(out, std::vector<double>(8, 0.0));
  // No tokens: grad_out (0, d) with strides (0, 0), and grad_rows of rows no pair reads left as they are.
  std::vector<double> rows(4, 1.0), grad_rows(4, -3.0);
  const TensorView v_rows = TensorView::contiguous(rows.data(), DType::kFP64, {1, 4});
  combine_rows_backward(none, v_rows, TensorView::contiguous(nullptr, DType::kFP64, {0}),
                        TensorView::contiguous(nullptr, DType::kInt32, {0}), TensorView(), 1,
                        TensorView::contiguous(grad_rows.data(), DType::kFP64, {1, 4}), TensorView());
  EXPECT_EQ(grad_rows, std::vector<double>(4, -3.0));
  // No tokens and no rows: out, rows and grad_rows all (0, d) with strides (0, 0).
  combine_rows(none, TensorView(), TensorView::contiguous(nullptr, DType::kInt32, {0}), TensorView(), 1, none);
  combine_rows_backward(none, none, TensorView::contiguous(nullptr, DType::kFP64, {0}),
                        TensorView::contiguous(nullptr, DType::kInt32, {0}), TensorView(), 1, none, TensorView());
  // A view with elements must still be contiguous.
  expect_error([&] { combine_rows(TensorView::strided(rows.data(), DType::kFP64, {1, 4}, {4, 0}), TensorView(),
                                  TensorView::contiguous(rp.data(), DType::kInt32, {2}), TensorView(), 1,
                                  TensorView::contiguous(out.data(), DType::kFP64, {2, 4})); },
               {"combine_rows", "'rows", "got"});
}

TEST(Combine, RejectsBadArguments) {
  const CombineCase c = make_combine_case({4, 8, 2, 6, 0, 0.0, 1, 14});
  std::vector<double> rows = c.rows, scores = c.scores, out(c.T * c.d), g = c.grad_out, grows(c.R * c.d);
  std::vector<float> rows32(rows.begin(), rows.end());
  std::vector<std::int32_t> rp = c.row_of_pair;
  std::vector<std::int64_t> rp64(rp.begin(), rp.end());
  const TensorView v_rows = TensorView::contiguous(rows.data(), DType::kFP64, {c.R, c.d});
  const TensorView v_scores = TensorView::contiguous(scores.data(), DType::kFP64, {c.P});
  const TensorView v_rp = TensorView::contiguous(rp.data(), DType::kInt32, {c.P});
  const TensorView v_out = TensorView::contiguous(out.data(), DType::kFP64, {c.T, c.d});
  const TensorView v_g = TensorView::contiguous(g.data(), DType::kFP64, {c.T, c.d});
  const TensorView v_grows = TensorView::contiguous(grows.data(), DType::kFP64, {c.R, c.d});
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, {}, 3, v_out); },
               {"combine_rows", "row_of_pair", "T * top_k = 4 * 3", "8 pairs"});
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, {}, 0, v_out); }, {"top_k", "K in [1, 2^31 - 1]", "got 0"});
  expect_error([&] { combine_rows(TensorView::contiguous(rows32.data(), DType::kFP32, {c.R, c.d}), v_scores, v_rp,
                                  {}, 2, v_out); },
               {"scores", "dtype fp32", "fp64"});
  expect_error([&] { combine_rows(v_rows, v_scores, TensorView::contiguous(rp64.data(), DType::kInt64, {c.P}), {},
                                  2, v_out); },
               {"row_of_pair", "dtype int32", "int64"});
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, {}, 2, v_out, reinterpret_cast<void*>(1)); },
               {"stream", "nullptr for cpu tensors"});
  expect_error([&] { combine_rows(TensorView::strided(rows.data(), DType::kFP64, {c.R / 2, c.d}, {2 * c.d, 1}),
                                  v_scores, v_rp, {}, 2, v_out); },
               {"rows", "a contiguous tensor"});
  std::vector<std::int32_t> bad = rp;
  bad[3] = static_cast<std::int32_t>(c.R);
  expect_error([&] { combine_rows(v_rows, v_scores, TensorView::contiguous(bad.data(), DType::kInt32, {c.P}), {}, 2,
                                  v_out); },
               {"row_of_pair[3]", "a row in [0, 9) or -1", std::to_string(c.R).c_str()});
  bad = rp;
  bad[5] = bad[1];
  const TensorView v_dup = TensorView::contiguous(bad.data(), DType::kInt32, {c.P});
  combine_rows(v_rows, v_scores, v_dup, {}, 2, v_out);  // reading a row twice is a valid forward
  expect_error([&] { combine_rows_backward(v_g, v_rows, v_scores, v_dup, {}, 2, v_grows, {}); },
               {"combine_rows_backward", "row_of_pair[5]", "a row no other pair reads", "also read by pair 1"});
  std::vector<std::int32_t> off = {0, 2, 1, 6, 8};
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, TensorView::contiguous(off.data(), DType::kInt32, {5}), 0,
                                  v_out); },
               {"token_offsets[2]", "an offset in [token_offsets[1] = 2, P = 8]", "1"});
  off = {0, 2, 4, 6, 8};
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, TensorView::contiguous(off.data(), DType::kInt32, {5}), 2,
                                  v_out); },
               {"top_k", "0 with token_offsets"});
  expect_error([&] { combine_rows(v_rows, v_scores, v_rp, TensorView::contiguous(off.data(), DType::kInt32, {4}), 0,
                                  v_out); },
               {"token_offsets", "shape (5,)", "(4,)"});
  expect_error([&] { combine_rows_backward(v_g, v_rows, v_scores, v_rp, {}, 2,
                                           TensorView::contiguous(grows.data(), DType::kFP64, {c.R - 1, c.d}), {}); },
               {"grad_rows", "(8, 8)"});
}

}  // namespace
}  // namespace machmoe::test
