// Token rounding's kernels (src/gpu/token_rounding_kernels.cu) against the CPU reference (src/reference/
// token_rounding.cpp, routing_metadata.cpp), launched directly: every rounding rule and score variant, E in
// {1, 8, 128, 200, 300, 512, 600 (rows read from memory)} (128, 200 and 300: the bounded select's three CTA sizes on
// a 132-SM GPU), K = 1 and K = E, K = 100 of 512 (lanes choosing again), T = 1, experts without tokens, long columns
// (the blocks' bounds read from memory instead of shared memory), ties selected over the whole column, skewed routing,
// padded logit rows (bf16 rows in and out of whole 16-byte groups: both keys kernels), bitwise repeats; and the plan
// of the forward's chunks of tokens the kernels build after the emit, against the plan launch_dx_chunk_plan searches
// for over their metadata.
//
// What must be exact: the per-expert counts (they depend on the top-K selection alone, which compares logits
// exactly), and every metadata array, which must be what ref::build_routing_metadata builds from the kernel's own
// pairs. The selection itself ranks fp32 keys computed on the device; the reference ranks the same quantities in
// float64. They agree except where two candidates' keys are closer than fp32 rounding at an expert's boundary, so
// a differing pair is accepted only when its float64 key is within 1e-5 (relative) of that expert's boundary key,
// and the number of such pairs is bounded and printed; any other difference fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <map>
#include <set>

#include "gpu/kernels.hpp"
#include "gpu_support.hpp"
#include "machmoe/memory.hpp"
#include "reference/routing_metadata.hpp"
#include "reference/token_rounding.hpp"

namespace machmoe::test {
namespace {

struct TrKernelCase {
  std::int64_t T, E, K, M;
  RoundingRule rule;
  ScoreVariant score;
  DType dt;
  double skew = 0.0;        // added to the logits of experts 0..2: most tokens choose them
  std::int64_t row_pad = 0;  // logits row stride E + row_pad
  std::int64_t repeat = 0;   // > 0: token t's logits are token (t % repeat)'s, so keys tie exactly across tokens
  const char* name = "";
  bool bf16_values = false;  // the logits rounded to bf16 first (then stored in dt: the same values in another dtype)
};

template <class T>
std::vector<T> download(const DeviceBuffer& b, std::size_t n) {
  std::vector<T> v(n);
  if (n) cudaMemcpy(v.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

/// Everything the forward kernels write, from one launch.
struct TrOutputs {
  std::vector<std::int32_t> counts, offsets, tiles, scatter, inverse, gather, token_offsets;
  std::vector<float> scores;
  std::vector<gpu::TokenSelectionStats> selection;  // per token, as saved for the backward
  bool logits_copy_exact = false;                   // the keys kernel's copy of the logits is them, bit for bit
  bool canaries = true;
  std::int64_t full_select_experts = 0;  // experts the bounded select flagged for the select over the whole column
  // With chunks of tokens: the plan token rounding built and each routed pair's row in its chunk, and the same from
  // launch_dx_chunk_plan's search over the kernels' own metadata (what the backward runs).
  std::vector<std::int32_t> plan, pair_rows, searched_plan, searched_pair_rows;
};

struct TrRun {
  TrOutputs out;
  std::vector<double> logits;  // as the kernels saw them (rounded to dt), (T, E) contiguous
};

/// chunks > 1: the forward's chunk plan too (TokenRoundingArgs::chunks), for `chunks` chunks of the pairs.
TrRun run_kernels(const TrKernelCase& c, std::uint64_t seed, std::int64_t chunks = 0) {
  MoEProblem p;
  p.T = c.T, p.E = c.E, p.K = c.K, p.d = 1, p.n = 1, p.routing = RoutingMode::kTokenRounding;
  p.rounding = c.rule, p.tile_m = c.M, p.score = c.score;
  const std::int64_t P = p.max_pairs(), ld = c.E + c.row_pad;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> z(static_cast<std::size_t>(c.T * ld), 0.0);
  for (std::int64_t t = 0; t < c.T; ++t)
    for (std::int64_t e = 0; e < c.E; ++e)
      z[t * ld + e] = c.repeat > 0 && t >= c.repeat ? z[(t % c.repeat) * ld + e] : nd(rng) + (e < 3 ? c.skew : 0.0);
  if (c.bf16_values) z = quantize(z, DType::kBF16);
  TrRun run;
  const std::vector<double> zq = quantize(z, c.dt);
  run.logits.resize(static_cast<std::size_t>(c.T * c.E));
  for (std::int64_t t = 0; t < c.T; ++t)
    for (std::int64_t e = 0; e < c.E; ++e) run.logits[t * c.E + e] = zq[t * ld + e];

  const ForwardWorkspaceLayout wl = forward_workspace_layout(p, c.dt);
  const std::vector<unsigned char> z_bytes = encode(z, c.dt);
  const std::size_t eb = dtype_size(c.dt);
  DeviceBuffer logits(z_bytes), ws(wl.total_bytes), logits_copy(static_cast<std::size_t>(c.T * c.E) * eb);
  DeviceBuffer counts(c.E * 4), offsets((c.E + 1) * 4), tiles((c.E + 1) * 4), scatter(P * 4), inverse(P * 4),
      gather(P * 4), token_offsets((c.T + 1) * 4), scores(P * 4),
      selection(c.T * static_cast<std::int64_t>(sizeof(gpu::TokenSelectionStats)));
  auto at = [&](const BufferRegion& r) { return static_cast<char*>(ws.get()) + r.offset; };
  gpu::TokenRoundingArgs a;
  a.dt = c.dt;
  a.T = c.T, a.E = c.E, a.K = c.K, a.tile_m = c.M, a.P_max = P;
  a.variant = c.score, a.rule = c.rule;
  a.logits = logits.get(), a.ld_logits = ld;
  if (wl.tr_keys.present()) a.keys = reinterpret_cast<std::uint32_t*>(at(wl.tr_keys));
  a.row_scores = reinterpret_cast<float*>(at(wl.tr_row_scores));
  a.keys_by_expert = reinterpret_cast<std::uint32_t*>(at(wl.tr_keys_by_expert));
  a.thresholds = reinterpret_cast<std::uint32_t*>(at(wl.tr_thresholds));
  a.bounds = reinterpret_cast<std::uint32_t*>(at(wl.tr_bounds));
  a.counters = at(wl.tr_counters), a.counters_bytes = wl.tr_counters.bytes;
  a.expert_counts = static_cast<std::int32_t*>(counts.get());
  a.expert_offsets = static_cast<std::int32_t*>(offsets.get());
  a.expert_tiles = static_cast<std::int32_t*>(tiles.get());
  a.scatter = static_cast<std::int32_t*>(scatter.get());
  a.inverse = static_cast<std::int32_t*>(inverse.get());
  a.gather = static_cast<std::int32_t*>(gather.get());
  a.token_offsets = static_cast<std::int32_t*>(token_offsets.get());
  a.scores = static_cast<float*>(scores.get());
  a.selection = static_cast<gpu::TokenSelectionStats*>(selection.get());
  a.logits_copy = logits_copy.get();
  const std::size_t plan_bytes = chunks > 1 ? static_cast<std::size_t>(chunks + 1 + chunks * (3 * c.E + 2)) * 4 : 4;
  DeviceBuffer plan(plan_bytes), pair_rows(P * 4), searched_plan(plan_bytes), searched_pair_rows(P * 4);
  if (chunks > 1) {
    a.chunks = chunks, a.pairs_per_chunk = (P + chunks - 1) / chunks;
    a.plan = gpu::DxChunkPlan::in(static_cast<std::int32_t*>(plan.get()), chunks, c.E);
    a.pair_rows = static_cast<std::int32_t*>(pair_rows.get());
    EXPECT_TRUE(gpu::token_rounding_built_plan(a));
  }
  gpu::launch_token_rounding(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  TrOutputs& o = run.out;
  if (chunks > 1) {
    gpu::launch_dx_chunk_plan(a.expert_offsets, a.gather, a.scatter, a.inverse, a.token_offsets, c.K, c.T, c.E, P,
                              chunks, a.pairs_per_chunk,
                              gpu::DxChunkPlan::in(static_cast<std::int32_t*>(searched_plan.get()), chunks, c.E),
                              static_cast<std::int32_t*>(searched_pair_rows.get()), false, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::size_t routed = static_cast<std::size_t>(download<std::int32_t>(offsets, c.E + 1).back());
    o.plan = download<std::int32_t>(plan, plan_bytes / 4);
    o.pair_rows = download<std::int32_t>(pair_rows, routed);  // the slots past the routed pairs are not written
    o.searched_plan = download<std::int32_t>(searched_plan, plan_bytes / 4);
    o.searched_pair_rows = download<std::int32_t>(searched_pair_rows, routed);
  }
  o.counts = download<std::int32_t>(counts, c.E);
  o.offsets = download<std::int32_t>(offsets, c.E + 1);
  o.tiles = download<std::int32_t>(tiles, c.E + 1);
  o.scatter = download<std::int32_t>(scatter, P);
  o.inverse = download<std::int32_t>(inverse, P);
  o.gather = download<std::int32_t>(gather, P);
  o.token_offsets = download<std::int32_t>(token_offsets, c.T + 1);
  o.scores = download<float>(scores, P);
  o.selection = download<gpu::TokenSelectionStats>(selection, c.T);
  {  // the copy is (T, E) contiguous; the logits have rows of ld elements
    const std::vector<unsigned char> copy = logits_copy.download();
    o.logits_copy_exact = true;
    for (std::int64_t t = 0; t < c.T; ++t)
      o.logits_copy_exact = o.logits_copy_exact &&
                            std::memcmp(copy.data() + t * c.E * eb, z_bytes.data() + t * ld * eb, c.E * eb) == 0;
  }
  {  // the whole-column select's flags in the counters region
    const auto words = TokenRoundingCounters::of(c.T, c.E);
    std::vector<std::int32_t> flags(static_cast<std::size_t>(c.E));
    cudaMemcpy(flags.data(), at(wl.tr_counters) + words.full_select * 4, flags.size() * 4, cudaMemcpyDeviceToHost);
    for (std::int32_t x : flags) o.full_select_experts += x != 0;
  }
  for (const DeviceBuffer* b : {&logits, &ws, &counts, &offsets, &tiles, &scatter, &inverse, &gather, &token_offsets,
                                &scores, &selection, &logits_copy, &plan, &pair_rows})
    o.canaries = o.canaries && b->canary_intact();
  return run;
}

bool same_outputs(const TrOutputs& a, const TrOutputs& b) {
  const std::size_t P = static_cast<std::size_t>(a.offsets.back());
  auto head = [P](const std::vector<std::int32_t>& v) { return std::vector<std::int32_t>(v.begin(), v.begin() + P); };
  return a.counts == b.counts && a.offsets == b.offsets && a.tiles == b.tiles && head(a.scatter) == head(b.scatter) &&
         a.inverse == b.inverse && head(a.gather) == head(b.gather) && a.token_offsets == b.token_offsets &&
         std::memcmp(a.scores.data(), b.scores.data(), 4 * a.scores.size()) == 0 && a.plan == b.plan &&
         a.pair_rows == b.pair_rows;
}

void check_against_reference(const TrKernelCase& c, const TrRun& run) {
  const TrOutputs& o = run.out;
  const std::int64_t T = c.T, E = c.E, K = c.K;
  MoEProblem p;
  p.T = T, p.E = E, p.K = K, p.routing = RoutingMode::kTokenRounding, p.rounding = c.rule, p.tile_m = c.M;
  const std::int64_t P_max = p.max_pairs();
  EXPECT_TRUE(o.canaries) << "a kernel wrote past a buffer";
  EXPECT_TRUE(o.logits_copy_exact) << c.name << ": the keys kernel's copy of the logits";

  // The reference on the kernels' logits.
  const ref::TokenRoundingResult<double> tr =
      ref::token_rounding(c.score, c.rule, c.M, run.logits.data(), T, E, K);
  const std::vector<std::int64_t> topk = ref::topk_experts(run.logits.data(), T, E, K);
  const std::vector<double> tc = ref::topk_scores(c.score, run.logits.data(), topk.data(), T, E, K);
  const std::vector<double> prob = ref::softmax_rows(run.logits.data(), T, E);
  std::vector<double> s_pref(static_cast<std::size_t>(T * E));
  for (std::int64_t i = 0; i < T * E; ++i) s_pref[i] = prob[i] - 1.0;
  for (std::int64_t i = 0; i < T * K; ++i) s_pref[(i / K) * E + topk[i]] = tc[i];

  // Counts: exact.
  std::vector<std::int64_t> f(E, 0);
  for (std::int64_t i = 0; i < T * K; ++i) ++f[topk[i]];
  ASSERT_EQ(o.offsets[0], 0);
  std::int64_t tiles = 0;
  ASSERT_EQ(o.tiles[0], 0);
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t r = ref::rounded_expert_count(f[e], T, c.M, c.rule);
    ASSERT_EQ(o.counts[e], r) << "expert " << e << " (f = " << f[e] << ")";
    ASSERT_EQ(o.offsets[e + 1] - o.offsets[e], r) << "expert " << e;
    tiles += (r + gpu::kGemmTileM - 1) / gpu::kGemmTileM;
    ASSERT_EQ(o.tiles[e + 1], tiles) << "expert " << e;
  }
  const std::int64_t P = o.offsets[E];
  ASSERT_EQ(P, static_cast<std::int64_t>(tr.token.size()));
  ASSERT_LE(P, P_max);

  // The kernels' pairs, in pair order, from token offsets + inverse + expert offsets.
  ASSERT_EQ(o.token_offsets[0], 0);
  ASSERT_EQ(o.token_offsets[T], P);
  std::vector<std::int64_t> tok, exp;
  for (std::int64_t t = 0; t < T; ++t) {
    ASSERT_LE(o.token_offsets[t], o.token_offsets[t + 1]) << "token " << t;
    for (std::int64_t q = o.token_offsets[t]; q < o.token_offsets[t + 1]; ++q) {
      const std::int64_t g = o.inverse[q];
      ASSERT_GE(g, 0) << "pair " << q;
      ASSERT_LT(g, P) << "pair " << q;
      tok.push_back(t);
      exp.push_back(std::upper_bound(o.offsets.begin(), o.offsets.end(), static_cast<std::int32_t>(g)) -
                    o.offsets.begin() - 1);
    }
  }
  for (std::int64_t q = P; q < P_max; ++q) {
    ASSERT_EQ(o.inverse[q], -1) << "sentinel slot " << q;
    ASSERT_EQ(o.scores[q], 0.0f) << "sentinel slot " << q;
  }
  // Metadata: bitwise what the reference builds from these pairs (pair order (token, expert), stable by expert).
  const ref::RoutingMetadata m = ref::build_routing_metadata(T, E, tok, exp);
  for (std::int64_t i = 1; i < P; ++i)
    ASSERT_TRUE(tok[i - 1] < tok[i] || (tok[i - 1] == tok[i] && exp[i - 1] < exp[i])) << "pair order at " << i;
  for (std::int64_t i = 0; i < P; ++i) {
    ASSERT_EQ(o.scatter[i], m.scatter[i]) << "scatter[" << i << "]";
    ASSERT_EQ(o.inverse[i], m.inverse[i]) << "inverse[" << i << "]";
    ASSERT_EQ(o.gather[i], m.gather[i]) << "gather[" << i << "]";
  }
  for (std::int64_t t = 0; t <= T; ++t) ASSERT_EQ(o.token_offsets[t], m.token_offsets[t]) << "token_offsets[" << t << "]";

  // The selection: the reference's pairs, except near-ties at an expert's boundary.
  std::set<std::pair<std::int64_t, std::int64_t>> gpu_pairs, ref_pairs;
  for (std::int64_t i = 0; i < P; ++i) gpu_pairs.insert({tok[i], exp[i]});
  for (std::int64_t i = 0; i < P; ++i) ref_pairs.insert({tr.token[i], tr.expert[i]});
  std::int64_t near_ties = 0;
  if (gpu_pairs != ref_pairs) {
    // Per expert: the reference's boundary key (its r-th best S'); every differing pair must sit at it.
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r = o.counts[e];
      if (r == 0 || r == T) continue;
      std::vector<double> col(static_cast<std::size_t>(T));
      for (std::int64_t t = 0; t < T; ++t) col[t] = s_pref[t * E + e];
      std::nth_element(col.begin(), col.begin() + (r - 1), col.end(), std::greater<double>());
      const double boundary = col[r - 1];
      for (std::int64_t t = 0; t < T; ++t) {
        if (gpu_pairs.count({t, e}) == ref_pairs.count({t, e})) continue;
        const double key = s_pref[t * E + e];
        // A chosen key is a score in [0, 1]; the others p - 1: compare p itself, where fp32's error is relative.
        const double a = key >= 0 ? key : key + 1.0, b = boundary >= 0 ? boundary : boundary + 1.0;
        EXPECT_TRUE((key >= 0) == (boundary >= 0) && std::abs(a - b) <= 1e-5 * std::max(std::abs(b), 1e-30))
            << c.name << ": expert " << e << " token " << t << (gpu_pairs.count({t, e}) ? " kept" : " dropped")
            << " by the GPU, reference key " << key << " vs boundary " << boundary;
        ++near_ties;
      }
    }
  }
  if (near_ties) std::printf("%s: %lld pairs differ from the float64 reference at near-tied boundaries\n", c.name,
                             static_cast<long long>(near_ties));
  EXPECT_LE(near_ties, std::max<std::int64_t>(4, E / 16)) << "more near-ties than fp32 rounding explains";

  // Scores: the TC score of a chosen pair, the softmax probability of a padded one (fp32 against float64). A pair's
  // score depends on its token's logits only, not on which pairs the rounding kept, so every pair both selections
  // hold is compared, near-ties elsewhere or not.
  {
    std::map<std::pair<std::int64_t, std::int64_t>, double> ref_score;
    for (std::int64_t i = 0; i < P; ++i) ref_score[{tr.token[i], tr.expert[i]}] = tr.score[i];
    double worst = 0;
    std::int64_t compared = 0;
    for (std::int64_t i = 0; i < P; ++i) {
      const auto it = ref_score.find({tok[i], exp[i]});
      if (it == ref_score.end()) continue;
      worst = std::max(worst, std::abs(o.scores[i] - it->second));
      ++compared;
    }
    EXPECT_GE(compared, P - 2 * near_ties) << c.name << ": every pair outside the near-ties is compared";
    EXPECT_LT(worst, 2e-6) << c.name << ": fp32 scores against the float64 scores of the same logits";
  }

  // Each token's saved selection (what the backward uses instead of selecting again): the K-th choice's rank key
  // names the reference's K-th expert (32-bit keys, the index complemented in the low 16 bits, for bf16 rows held in
  // registers; else 64-bit keys, the index complemented in the low 32 bits), the top choice is the row's maximum,
  // and the two sums of exponentials are the reference's to fp32 accuracy.
  ASSERT_EQ(o.selection.size(), static_cast<std::size_t>(T));
  const bool short_keys = c.dt == DType::kBF16 && E <= kTokenRoundingRegisterExperts;
  double worst_sum = 0, worst_sum_k = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const gpu::TokenSelectionStats& st = o.selection[static_cast<std::size_t>(t)];
    const double* z = run.logits.data() + t * E;
    const std::int64_t kth_index = short_keys ? 0xffff - static_cast<std::int64_t>(st.kth & 0xffffu)
                                              : 0xffffffffll - static_cast<std::int64_t>(st.kth & 0xffffffffu);
    ASSERT_EQ(kth_index, topk[t * K + K - 1]) << c.name << ": token " << t << "'s K-th choice";
    const double mx = *std::max_element(z, z + E);
    ASSERT_EQ(st.max, static_cast<float>(mx)) << c.name << ": token " << t;
    ASSERT_EQ(st.first, st.max) << c.name << ": token " << t;
    double sum = 0, sum_k = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - mx);
    for (std::int64_t k = 0; k < K; ++k) sum_k += std::exp(z[topk[t * K + k]] - mx);
    worst_sum = std::max(worst_sum, std::abs(st.sum - sum) / sum);
    worst_sum_k = std::max(worst_sum_k, std::abs(st.sum_k - sum_k) / sum_k);
  }
  EXPECT_LT(worst_sum, 1e-5) << c.name << ": the rows' sums of exp";
  EXPECT_LT(worst_sum_k, 1e-5) << c.name << ": the selections' sums of exp";
}

class GpuTokenRoundingKernels : public testing::TestWithParam<TrKernelCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuTokenRoundingKernels, MatchTheReferenceAndRepeatBitwise) {
  const TrKernelCase& c = GetParam();
  // Three chunks of tokens for the forward's chunk plan: boundaries inside 32-token blocks, and empty chunks where
  // T < 3.
  constexpr std::int64_t kChunks = 3;
  const TrRun a = run_kernels(c, 1234 + static_cast<std::uint64_t>(c.T * 7 + c.E), kChunks);
  check_against_reference(c, a);
  EXPECT_EQ(a.out.plan, a.out.searched_plan) << c.name << ": the chunk plan (bounds, offsets, tiles, shifts)";
  EXPECT_EQ(a.out.pair_rows, a.out.searched_pair_rows) << c.name << ": the routed pairs' rows in their chunks";
  // The bounded select takes every expert of random logits; repeated tokens (thousands of equal keys at a threshold)
  // send some to the full select, and both must give the reference's routing.
  if (c.repeat == 0) {
    EXPECT_EQ(a.out.full_select_experts, 0) << c.name;
  }
  if (c.repeat > 0 && c.T >= 30000) {
    EXPECT_GT(a.out.full_select_experts, 0) << c.name;
  }
  const TrRun b = run_kernels(c, 1234 + static_cast<std::uint64_t>(c.T * 7 + c.E), kChunks);
  EXPECT_TRUE(same_outputs(a.out, b.out)) << c.name << ": a second launch on the same logits differs";
  EXPECT_EQ(std::memcmp(a.out.selection.data(), b.out.selection.data(),
                        sizeof(a.out.selection[0]) * a.out.selection.size()),
            0)
      << c.name << ": a second launch saves another selection";
}

std::vector<TrKernelCase> kernel_cases() {
  std::vector<TrKernelCase> v;
  const RoundingRule rules[] = {RoundingRule::kNearest, RoundingRule::kUp, RoundingRule::kDown};
  const char* rn[] = {"nearest", "up", "down"};
  for (int ri = 0; ri < 3; ++ri) {
    const RoundingRule r = rules[ri];
    auto add = [&](TrKernelCase c, const char* what) {
      c.rule = r;
      static std::deque<std::string> names;  // the names outlive the cases (a deque never moves its elements)
      names.push_back(std::string(rn[ri]) + "_" + what);
      c.name = names.back().c_str();
      v.push_back(c);
    };
    add({1, 1, 1, 8, r, ScoreVariant::kSoftmaxOverTopK, DType::kFP32}, "T1_E1");
    add({1, 8, 8, 8, r, ScoreVariant::kTopKOfSoftmax, DType::kBF16}, "T1_E8_KE");
    add({300, 1, 1, 16, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "E1");
    add({777, 8, 1, 16, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "E8_K1");
    add({500, 8, 8, 16, r, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kFP32}, "E8_KE");
    add({4096, 128, 8, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "E128_K8");
    add({3000, 128, 128, 64, r, ScoreVariant::kTopKOfSoftmax, DType::kFP32}, "E128_KE");
    add({2000, 512, 1, 8, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "E512_K1_empty_experts");
    add({1500, 512, 16, 32, r, ScoreVariant::kTopKOfSoftmax, DType::kBF16}, "E512_K16");
    // Rows of 512 keep each lane's best two keys below the last choice; a lane that wins a third time looks over its
    // 16 keys again. K = 100 (about three choices a lane) takes that path in most rounds, for 32- and 64-bit keys.
    add({600, 512, 100, 32, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "E512_K100_lanes_choose_again");
    add({400, 512, 100, 16, r, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kFP32}, "E512_K100_fp32");
    add({700, 600, 6, 16, r, ScoreVariant::kSoftmaxOverTopK, DType::kFP32}, "E600_rows_from_memory");
    // Long columns: the bounded select stages the blocks' bounds it selects from in shared memory up to 4096 blocks of
    // 32 tokens on 1024 threads a CTA (E <= SMs), 2048 on 512 (E <= 2 SMs) and 1024 on 256; T = 200000 (6250 blocks,
    // 1024 threads), T = 70000 with E = 160 (2188 blocks, 512 threads on a 132-SM GPU) and T = 40000 with E = 300
    // (1250 blocks, 256 threads) read them from memory in every radix pass.
    add({8192, 64, 4, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T8192_E64");
    add({12289, 16, 2, 128, r, ScoreVariant::kTopKOfSoftmax, DType::kFP32}, "T12289_E16");
    add({65536, 8, 2, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T65536_E8");
    add({65536, 128, 4, 128, r, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kBF16}, "T65536_E128");
    add({200000, 8, 2, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T200000_E8_bounds_from_memory");
    add({70000, 160, 4, 128, r, ScoreVariant::kTopKOfSoftmax, DType::kBF16}, "T70000_E160_bounds_from_memory");
    add({40000, 300, 8, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T40000_E300_bounds_from_memory");
    TrKernelCase skew{5000, 64, 2, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16};
    skew.skew = 3.0;  // experts 0..2 take most tokens; many others few or none
    add(skew, "skewed");
    TrKernelCase padded{1000, 40, 3, 16, r, ScoreVariant::kTopKOfSoftmax, DType::kFP32};
    padded.row_pad = 24;
    add(padded, "padded_rows");
    // bf16 rows of at most 128 experts take the keys kernel with four lanes a token where the rows are whole 16-byte
    // groups (a stride of 48 elements), the warp kernel where they are not (a stride of 43).
    TrKernelCase padded_bf16{1000, 40, 3, 16, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16};
    padded_bf16.row_pad = 8;
    add(padded_bf16, "padded_rows_bf16_four_lanes");
    padded_bf16.row_pad = 3;
    add(padded_bf16, "padded_rows_bf16_one_warp");
    add({100, 8, 2, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T_below_tile");
    // The bounded select's blocks of 32 tokens: a last block of one token, and warps past it with empty chunks, on
    // 1024 threads a CTA (E = 128 <= SMs), on 512 (E = 200) and on 256 (E = 300, past two CTAs an SM of 132 SMs).
    add({4097, 128, 8, 64, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T4097_E128_last_block_one_token");
    add({4129, 200, 4, 32, r, ScoreVariant::kTopKOfSoftmax, DType::kFP32}, "T4129_E200_last_block_one_token");
    add({4129, 300, 8, 64, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}, "T4129_E300_last_block_one_token");
    // Exact ties across tokens (every token repeats one of 3 logit rows): the threshold's digit holds about T / 3 keys
    // of a column. Past the bounded select's staging (64 candidates a warp, 128 in a CTA of 256 threads; asserted for
    // T >= 30000 above) its CTA selects the expert over the whole column: T = 30000 with E = 16 (1024 threads a CTA)
    // and E = 300 (256 threads), and T = 200000 with E = 8.
    TrKernelCase tied{3000, 16, 2, 128, r, ScoreVariant::kSoftmaxOverTopK, DType::kBF16};
    tied.repeat = 3;
    add(tied, "exact_ties_T3000");
    tied.T = 30000;
    add(tied, "exact_ties_whole_column");
    tied.E = 300, tied.K = 8;
    add(tied, "exact_ties_whole_column_E300");
    tied.K = 2;
    tied.T = 200000, tied.E = 8;
    add(tied, "exact_ties_whole_column_T200000");
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuTokenRoundingKernels, testing::ValuesIn(kernel_cases()),
                         [](const testing::TestParamInfo<TrKernelCase>& i) { return std::string(i.param.name); });

// Rows in registers rank bf16 logits by 32-bit keys and fp32 logits by 64-bit ones (device_math.cuh, RankKey): on
// the same values (bf16 logits, and those values stored as fp32) the kernels give bitwise the same routing and
// scores, E = 8 to 512, with exact ties across tokens. The bf16 rows of at most 128 experts in whole 16-byte groups
// with K <= 8 take the keys kernel with four lanes a token (its own sum order made the warp kernel's), the fp32 rows
// the warp-per-token one: so this also holds the two kernels to each other's outputs and saved selections bit for bit
// (K = 1 to 8, rows of 8 to 128 experts, every score variant, T not a multiple of a block's 32 tokens).
TEST(GpuTokenRoundingKernels, Bf16KeysRouteAsTheFp32KeysDo) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t T, E, K;
    ScoreVariant sv;
  };
  for (const Shape& sh :
       {Shape{3000, 8, 2, ScoreVariant::kSoftmaxOverTopK}, Shape{4096, 128, 8, ScoreVariant::kTopKOfSoftmax},
        Shape{2500, 200, 7, ScoreVariant::kTopKOfSoftmaxRenorm}, Shape{1500, 512, 16, ScoreVariant::kTopKOfSoftmax},
        Shape{2000, 32, 1, ScoreVariant::kTopKOfSoftmaxRenorm}, Shape{1000, 40, 3, ScoreVariant::kSoftmaxOverTopK},
        Shape{3001, 64, 4, ScoreVariant::kTopKOfSoftmax}, Shape{2000, 96, 8, ScoreVariant::kTopKOfSoftmaxRenorm},
        Shape{4095, 128, 2, ScoreVariant::kSoftmaxOverTopK}, Shape{1500, 120, 5, ScoreVariant::kTopKOfSoftmax},
        Shape{999, 128, 8, ScoreVariant::kSoftmaxOverTopK}}) {
    TrKernelCase c{sh.T, sh.E, sh.K, 64, RoundingRule::kNearest, sh.sv, DType::kBF16};
    c.bf16_values = true;
    c.repeat = sh.T / 3;  // exact ties across tokens too
    const std::string what = "E=" + std::to_string(sh.E) + " K=" + std::to_string(sh.K);
    const TrRun b = run_kernels(c, 99);
    c.dt = DType::kFP32;
    const TrRun f = run_kernels(c, 99);
    ASSERT_EQ(b.logits, f.logits) << what;
    EXPECT_TRUE(same_outputs(b.out, f.out)) << what << ": bf16 and fp32 logits of the same values route differently";
    // The saved selections: the same sums and maxima bit for bit (the K-th key's width differs: 32 and 64 bits).
    for (std::int64_t t = 0; t < sh.T; ++t) {
      const gpu::TokenSelectionStats &x = b.out.selection[t], &y = f.out.selection[t];
      ASSERT_TRUE(x.first == y.first && x.sum_k == y.sum_k && x.max == y.max && x.sum == y.sum)
          << what << ": token " << t << "'s saved selection";
    }
  }
}

// A kept pair that its token chose carries the TC score bit for bit as top-K routing computes it
// (launch_topk_scores) from the same logits: both keys kernels, every score variant, rows of 20 to 600 experts (in
// registers at 1, 2, 4, 8 and 16 keys a lane, and from memory), K = E, K past 32 (where the warp kernel writes the
// chosen keys slot by slot instead of a lane a selection), bf16, fp16 and fp32 logits, rows past the last lane's
// slot (E not a multiple of 32).
TEST(GpuTokenRoundingKernels, ChosenPairsCarryTopKsScoresBitwise) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t T, E, K;
    ScoreVariant sv;
    DType dt;
  };
  // T K / E, an expert's token choices, at 100 or more, so that rounding to tiles of 16 keeps most of them.
  for (const Shape& sh : {Shape{8192, 512, 8, ScoreVariant::kSoftmaxOverTopK, DType::kBF16},
                          Shape{2000, 512, 40, ScoreVariant::kTopKOfSoftmax, DType::kBF16},
                          Shape{2000, 256, 16, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kBF16},
                          Shape{4000, 300, 8, ScoreVariant::kTopKOfSoftmax, DType::kFP32},
                          Shape{2000, 128, 8, ScoreVariant::kTopKOfSoftmax, DType::kBF16},
                          Shape{4000, 100, 3, ScoreVariant::kSoftmaxOverTopK, DType::kFP16},
                          Shape{999, 40, 33, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kFP32},
                          Shape{700, 20, 20, ScoreVariant::kTopKOfSoftmax, DType::kBF16},
                          Shape{8000, 600, 8, ScoreVariant::kSoftmaxOverTopK, DType::kBF16}}) {
    const std::int64_t T = sh.T, E = sh.E, K = sh.K;
    const TrKernelCase c{T, E, K, 16, RoundingRule::kNearest, sh.sv, sh.dt};
    const std::string what =
        "E=" + std::to_string(E) + " K=" + std::to_string(K) + " " + score_variant_name(sh.sv) + " " +
        dtype_name(sh.dt);
    const TrRun run = run_kernels(c, 17);
    DeviceBuffer logits(encode(run.logits, sh.dt)), sc(T * K * 4), ex(T * K * 4);
    gpu::launch_topk_scores(sh.dt, logits.get(), E, T, E, K, sh.sv, static_cast<float*>(sc.get()),
                            static_cast<std::int32_t*>(ex.get()), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const std::vector<std::int32_t> experts = download<std::int32_t>(ex, T * K);
    const std::vector<float> scores = download<float>(sc, T * K);
    const TrOutputs& o = run.out;
    std::int64_t compared = 0;
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t q = o.token_offsets[t]; q < o.token_offsets[t + 1]; ++q) {
        const std::int32_t g = o.inverse[q];
        const std::int32_t e = static_cast<std::int32_t>(
            std::upper_bound(o.offsets.begin(), o.offsets.end(), g) - o.offsets.begin() - 1);
        const auto* choice = std::find(experts.data() + t * K, experts.data() + (t + 1) * K, e);
        if (choice == experts.data() + (t + 1) * K) continue;  // a pair the rounding added: its probability
        const float topk_score = scores[choice - experts.data()];
        ASSERT_EQ(std::memcmp(&o.scores[q], &topk_score, 4), 0)
            << what << ": token " << t << " expert " << e << ": " << o.scores[q] << " against top-K's " << topk_score;
        ++compared;
      }
    EXPECT_GT(compared, T * K / 2) << what << ": most token choices are kept";
  }
}

// The top-K kernel likewise: bf16 logits (32-bit keys) and the same values as fp32 (64-bit keys) select the same
// experts in the same order with bitwise the same scores, for every score variant, rows of 20 to 512 experts, K up
// to E, and values that stress the key: exact ties, +0 and -0, +inf and -inf, and NaN (ranked last). The bf16 rows
// of at most 128 experts in whole 16-byte groups with K <= 8 and a score over the selection take the lane-per-token
// kernel (keys from the raw bits, a merge network), the fp32 rows the warp-per-token one: so this also holds the two
// kernels to each other's outputs bit for bit (K = 1, 2, 3, 4, 8 and rows of 8 to 128 experts among them).
TEST(GpuRouterKernels, Bf16KeysSelectAsTheFp32KeysDo) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t E, K;
  };
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const Shape& sh : {Shape{20, 5}, Shape{64, 64}, Shape{128, 8}, Shape{200, 7}, Shape{512, 40}, Shape{8, 8},
                          Shape{32, 2}, Shape{40, 3}, Shape{64, 4}, Shape{96, 8}, Shape{128, 1}})
    for (ScoreVariant sv :
         {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm}) {
      const std::int64_t T = 300, E = sh.E, K = sh.K;
      std::vector<double> z(static_cast<std::size_t>(T * E));
      for (double& v : z) v = std::round(nd(rng) * 4.0) / 4.0;  // few distinct values: many exact ties
      for (std::int64_t t = 0; t < T; t += 7) {                  // special values in some rows
        z[t * E + (t / 7) % E] = -0.0;
        z[t * E + (t / 7 + 1) % E] = 0.0;
        if (t % 21 == 0) z[t * E + (t / 7 + 2) % E] = INFINITY;
        if (t % 35 == 0) z[t * E + (t / 7 + 3) % E] = -INFINITY;
        if (t % 49 == 0) z[t * E + (t / 7 + 4) % E] = NAN;
      }
      const std::string what = "E=" + std::to_string(E) + " K=" + std::to_string(K) + " " + score_variant_name(sv);
      std::vector<std::int32_t> experts[2];
      std::vector<float> scores[2];
      const DType dts[2] = {DType::kBF16, DType::kFP32};
      for (int v = 0; v < 2; ++v) {
        DeviceBuffer logits(encode(z, dts[v])), sc(T * K * 4), ex(T * K * 4);
        gpu::launch_topk_scores(dts[v], logits.get(), E, T, E, K, sv, static_cast<float*>(sc.get()),
                                static_cast<std::int32_t*>(ex.get()), nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        experts[v] = download<std::int32_t>(ex, T * K);
        scores[v] = download<float>(sc, T * K);
      }
      EXPECT_EQ(experts[0], experts[1]) << what;
      EXPECT_EQ(std::memcmp(scores[0].data(), scores[1].data(), scores[0].size() * 4), 0) << what;
    }
}

// The backward kernel against ref::token_rounding_backward on the forward's own pairs, every score variant, every
// row width the kernel instantiates (1, 2 and 4 keys a lane with the pair gradients in registers, 8 and 16 keys a
// lane, and rows from memory: E = 600, two windows of pair gradients), without and with an upstream gradient of the
// logits (which adds to the result; its rows padded past E), and a bitwise repeat.
TEST(GpuTokenRoundingKernels, BackwardMatchesTheReference) {
  REQUIRE_GPU();
  for (ScoreVariant sv : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax,
                          ScoreVariant::kTopKOfSoftmaxRenorm})
    for (std::int64_t E : {20, 50, 128, 200, 300, 600}) {
      TrKernelCase c{900, E, 4, 16, RoundingRule::kUp, sv, DType::kFP32};
      c.name = "backward";
      const TrRun run = run_kernels(c, 99 + static_cast<std::uint64_t>(E));
      const TrOutputs& o = run.out;
      const std::int64_t T = c.T, K = c.K, P = o.offsets[E];
      std::vector<std::int64_t> tok, exp;
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t q = o.token_offsets[t]; q < o.token_offsets[t + 1]; ++q) {
          tok.push_back(t);
          exp.push_back(std::upper_bound(o.offsets.begin(), o.offsets.end(), o.inverse[q]) - o.offsets.begin() - 1);
        }
      std::mt19937_64 rng(5);
      std::normal_distribution<double> nd(0.0, 1.0);
      std::vector<float> ds(static_cast<std::size_t>(P));
      for (float& x : ds) x = static_cast<float>(nd(rng));
      const std::vector<double> dsd(ds.begin(), ds.end());
      const std::vector<double> want =
          ref::token_rounding_backward(sv, run.logits.data(), T, E, K, tok.data(), exp.data(), P, dsd.data());
      std::vector<unsigned char> zb = encode(run.logits, DType::kFP32);
      DeviceBuffer z(zb), dsb(P * 4), inv(o.inverse.size() * 4), off((E + 1) * 4), toff((T + 1) * 4),
          sel(T * static_cast<std::int64_t>(sizeof(gpu::TokenSelectionStats)));
      cudaMemcpy(sel.get(), o.selection.data(), T * sizeof(gpu::TokenSelectionStats), cudaMemcpyHostToDevice);
      cudaMemcpy(dsb.get(), ds.data(), P * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(inv.get(), o.inverse.data(), o.inverse.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(off.get(), o.offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(toff.get(), o.token_offsets.data(), (T + 1) * 4, cudaMemcpyHostToDevice);
      const std::int64_t ld_up = E + 3;
      std::vector<double> up(static_cast<std::size_t>(T * ld_up));
      for (double& x : up) x = static_cast<float>(nd(rng));  // values fp32 holds exactly
      DeviceBuffer upb(encode(up, DType::kFP32));
      for (bool with_up : {false, true}) {
        std::vector<double> expect = want;
        if (with_up)
          for (std::int64_t t = 0; t < T; ++t)
            for (std::int64_t e = 0; e < E; ++e) expect[t * E + e] += up[t * ld_up + e];
        std::vector<float> got[2];
        for (int rep = 0; rep < 2; ++rep) {
          DeviceBuffer dz(T * E * 4);
          gpu::launch_token_rounding_backward(DType::kFP32, sv, z.get(), T, E,
                                              static_cast<const gpu::TokenSelectionStats*>(sel.get()),
                                              static_cast<const float*>(dsb.get()),
                                              static_cast<const std::int32_t*>(inv.get()),
                                              static_cast<const std::int32_t*>(off.get()),
                                              static_cast<const std::int32_t*>(toff.get()),
                                              with_up ? upb.get() : nullptr, with_up ? ld_up : 0, dz.get(), nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          got[rep] = download<float>(dz, T * E);
          EXPECT_TRUE(dz.canary_intact());
        }
        const std::string what = std::string(score_variant_name(sv)) + " E=" + std::to_string(E) + (with_up ? " upstream" : "");
        EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), 4 * got[0].size()), 0) << "repeat differs: " << what;
        const std::vector<double> g(got[0].begin(), got[0].end());
        EXPECT_LT(rel_error(g, expect), 1e-5) << what;
      }
    }
}

}  // namespace
}  // namespace machmoe::test
