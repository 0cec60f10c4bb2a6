// The routing metadata kernels (src/gpu/metadata_kernels.cu) launched directly: the chunk plan of the forward's
// chunks of tokens, built from the tile histograms inside launch_routing_metadata, against the plan
// launch_dx_chunk_plan builds by searching each expert's grouped rows (what the backward runs): the same plan
// buffer and pair rows, bitwise, and the metadata itself unchanged by building it. Top-K pairs (K per token) and
// caller pairs (0..K per token, some routed nowhere); chunk boundaries inside a histogram tile and on its edge, more
// chunks than tokens (empty chunks), one token, more experts than a block scans at once, and more than the one-kernel
// plan holds in shared memory (the plan's meaning checked). And the metadata itself against a plain CPU layout, for
// every width of the tile scan. Each test runs both place kernels (MetadataArgs::place forced: the one sorting blocks
// of 2048 pairs takes E <= 256, so above it both runs are the per-tile kernel's), and the layer's choice between them
// is checked on its own.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu/kernels.hpp"
#include "gpu_support.hpp"

namespace machmoe::test {
namespace {

using gpu::DxChunkPlan;
using gpu::kFusedPlanMaxExperts;
using gpu::kMetadataTile;
using gpu::MetadataArgs;
using gpu::metadata_built_plan;
using gpu::TopKTileHistograms;

struct MetadataCase {
  std::int64_t T, E, K, chunks;
  bool caller;  // variable pairs per token (pair_token), a tenth of them routed nowhere
  const char* name;
};

std::vector<unsigned char> bytes_of(const std::vector<std::int32_t>& v) {
  std::vector<unsigned char> b(v.size() * 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<std::int32_t> ints_of(const DeviceBuffer& d) {
  const std::vector<unsigned char> raw = d.download();
  std::vector<std::int32_t> v(raw.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), raw.data(), v.size() * 4);
  return v;
}

/// Pairs in pair order: top-K (K distinct experts per token) or caller (0..K distinct experts per token, ascending
/// tokens, every tenth expert replaced by -1 or E: routed nowhere).
void make_pairs(const MetadataCase& c, std::vector<std::int32_t>& expert, std::vector<std::int32_t>& token) {
  std::mt19937 rng(static_cast<std::uint32_t>(c.T * 131 + c.E * 7 + c.K));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(c.E));
  for (std::int64_t t = 0; t < c.T; ++t) {
    for (std::int64_t e = 0; e < c.E; ++e) ids[e] = static_cast<std::int32_t>(e);
    std::shuffle(ids.begin(), ids.end(), rng);
    const std::int64_t k = c.caller ? static_cast<std::int64_t>(rng() % (c.K + 1)) : c.K;
    for (std::int64_t j = 0; j < k; ++j) {
      std::int32_t e = ids[j];
      if (c.caller && rng() % 10 == 0) e = rng() % 2 ? -1 : static_cast<std::int32_t>(c.E);
      expert.push_back(e);
      token.push_back(static_cast<std::int32_t>(t));
    }
  }
}

/// The metadata buffers of one launch.
struct Metadata {
  DeviceBuffer hist, counts, offsets, tiles, scatter, inverse, gather, token_offsets, plan, pair_rows;
  Metadata(const MetadataCase& c, std::int64_t P)
      : hist(static_cast<std::size_t>(c.E * ((P + kMetadataTile - 1) / kMetadataTile)) * 4 + 4),
        counts(static_cast<std::size_t>(c.E) * 4),
        offsets(static_cast<std::size_t>(c.E + 1) * 4),
        tiles(static_cast<std::size_t>(c.E + 1) * 4),
        scatter(static_cast<std::size_t>(P) * 4 + 4),
        inverse(static_cast<std::size_t>(P) * 4 + 4),
        gather(static_cast<std::size_t>(P) * 4 + 4),
        token_offsets(static_cast<std::size_t>(c.T + 1) * 4),
        plan(static_cast<std::size_t>(c.chunks + 1 + c.chunks * (3 * c.E + 2)) * 4),
        pair_rows(static_cast<std::size_t>(P) * 4 + 4) {}
  MetadataArgs args(const MetadataCase& c, std::int64_t P, const DeviceBuffer& expert, const DeviceBuffer& token) {
    MetadataArgs a;
    a.T = c.T, a.E = c.E, a.P = P, a.K = c.K;
    a.pair_expert = static_cast<const std::int32_t*>(expert.get());
    a.pair_token = c.caller ? static_cast<const std::int32_t*>(token.get()) : nullptr;
    a.tile_hist = static_cast<std::int32_t*>(hist.get());
    a.expert_counts = static_cast<std::int32_t*>(counts.get());
    a.expert_offsets = static_cast<std::int32_t*>(offsets.get());
    a.expert_tiles = static_cast<std::int32_t*>(tiles.get());
    a.scatter = static_cast<std::int32_t*>(scatter.get());
    a.inverse = static_cast<std::int32_t*>(inverse.get());
    a.gather = static_cast<std::int32_t*>(gather.get());
    a.token_offsets = c.caller ? static_cast<std::int32_t*>(token_offsets.get()) : nullptr;
    return a;
  }
};

void expect_plan_places_every_pair(const MetadataCase& c, std::int64_t P, const std::vector<std::int32_t>& token,
                                   const Metadata& fused);

class GpuRoutingMetadata : public testing::TestWithParam<MetadataCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuRoutingMetadata, ChunkPlanFromHistogramsIsTheSearchedPlan) {
  const MetadataCase& c = GetParam();
  std::vector<std::int32_t> expert, token;
  make_pairs(c, expert, token);
  const std::int64_t P = static_cast<std::int64_t>(expert.size());
  ASSERT_GT(P, 0);
  const DeviceBuffer d_expert(bytes_of(expert)), d_token(bytes_of(token));
  const std::int64_t pairs_per_chunk = (P + c.chunks - 1) / c.chunks;
  progress("routing metadata " + std::string(c.name) + ": P " + std::to_string(P));

  // Searched: the metadata alone, then the backward's plan kernel over it.
  Metadata searched(c, P);
  MetadataArgs b = searched.args(c, P, d_expert, d_token);
  b.place = gpu::PlaceKernel::kByTile;  // the reference: the per-tile place kernel
  ASSERT_FALSE(metadata_built_plan(b));
  gpu::launch_routing_metadata(b, nullptr);
  gpu::launch_dx_chunk_plan(b.expert_offsets, b.gather, b.scatter, b.inverse, b.token_offsets, c.K, c.T, c.E, P,
                            c.chunks, pairs_per_chunk,
                            DxChunkPlan::in(static_cast<std::int32_t*>(searched.plan.get()), c.chunks, c.E),
                            static_cast<std::int32_t*>(searched.pair_rows.get()), !c.caller, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // Fused: the plan built with the metadata, by each place kernel (the sorted one takes E <= 256).
  for (const bool by_tile : {false, true}) {
    SCOPED_TRACE(by_tile ? "place kernel by tile" : "place kernel sorting blocks of tiles");
    Metadata fused(c, P);
    MetadataArgs a = fused.args(c, P, d_expert, d_token);
    a.chunks = c.chunks, a.pairs_per_chunk = pairs_per_chunk;
    a.plan = DxChunkPlan::in(static_cast<std::int32_t*>(fused.plan.get()), c.chunks, c.E);
    a.pair_rows = static_cast<std::int32_t*>(fused.pair_rows.get());
    a.place = by_tile ? gpu::PlaceKernel::kByTile : gpu::PlaceKernel::kSorted;
    ASSERT_EQ(gpu::place_kernel_sorts(a), !by_tile && c.E <= 256);
    ASSERT_TRUE(metadata_built_plan(a));
    gpu::launch_routing_metadata(a, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    EXPECT_EQ(ints_of(fused.counts), ints_of(searched.counts));
    EXPECT_EQ(ints_of(fused.offsets), ints_of(searched.offsets));
    EXPECT_EQ(ints_of(fused.tiles), ints_of(searched.tiles));
    EXPECT_EQ(ints_of(fused.scatter), ints_of(searched.scatter));
    EXPECT_EQ(ints_of(fused.inverse), ints_of(searched.inverse));
    EXPECT_EQ(ints_of(fused.gather), ints_of(searched.gather));
    if (c.caller) {
      EXPECT_EQ(ints_of(fused.token_offsets), ints_of(searched.token_offsets));
    }
    EXPECT_EQ(ints_of(fused.plan), ints_of(searched.plan)) << "bounds, offsets, tiles and shifts of every chunk";
    EXPECT_EQ(ints_of(fused.pair_rows), ints_of(searched.pair_rows));
    EXPECT_TRUE(fused.plan.canary_intact());
    EXPECT_TRUE(fused.pair_rows.canary_intact());

    expect_plan_places_every_pair(c, P, token, fused);
  }
}

// More experts than the one-kernel plan holds in shared memory (kFusedPlanMaxExperts): launch_dx_chunk_plan's plan
// kernel, fill and pair-rows kernel, checked for what the plan means.
TEST(GpuRoutingMetadataWide, ChunkPlanPastTheSharedMemoryExperts) {
  REQUIRE_GPU();
  const MetadataCase c{700, kFusedPlanMaxExperts + 904, 8, 3, true, "caller_past_shared_memory_experts"};
  std::vector<std::int32_t> expert, token;
  make_pairs(c, expert, token);
  const std::int64_t P = static_cast<std::int64_t>(expert.size());
  const DeviceBuffer d_expert(bytes_of(expert)), d_token(bytes_of(token));
  Metadata m(c, P);
  const MetadataArgs a = m.args(c, P, d_expert, d_token);
  gpu::launch_routing_metadata(a, nullptr);
  gpu::launch_dx_chunk_plan(a.expert_offsets, a.gather, a.scatter, a.inverse, a.token_offsets, c.K, c.T, c.E, P,
                            c.chunks, (P + c.chunks - 1) / c.chunks,
                            DxChunkPlan::in(static_cast<std::int32_t*>(m.plan.get()), c.chunks, c.E),
                            static_cast<std::int32_t*>(m.pair_rows.get()), false, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(m.plan.canary_intact());
  EXPECT_TRUE(m.pair_rows.canary_intact());
  expect_plan_places_every_pair(c, P, token, m);
}

void expect_plan_places_every_pair(const MetadataCase& c, std::int64_t P, const std::vector<std::int32_t>& token,
                                   const Metadata& fused) {
  // What the plan means: every routed pair's row lies inside its chunk's rows, each chunk's rows once.
  const std::vector<std::int32_t> plan = ints_of(fused.plan), rows = ints_of(fused.pair_rows);
  const std::vector<std::int32_t> inverse = ints_of(fused.inverse);
  const DxChunkPlan v = DxChunkPlan::in(const_cast<std::int32_t*>(plan.data()), c.chunks, c.E);
  std::vector<std::vector<int>> seen(static_cast<std::size_t>(c.chunks));
  for (std::int64_t ch = 0; ch < c.chunks; ++ch) seen[ch].assign(static_cast<std::size_t>(v.chunk_offsets(ch)[c.E]), 0);
  for (std::int64_t p = 0; p < P; ++p) {
    if (inverse[p] < 0) {
      EXPECT_EQ(rows[p], -1) << "pair " << p << " is routed nowhere";
      continue;
    }
    std::int64_t ch = 0;
    while (ch + 1 < c.chunks && v.bounds[ch + 1] <= token[p]) ++ch;
    ASSERT_GE(rows[p], 0);
    ASSERT_LT(rows[p], static_cast<std::int32_t>(seen[ch].size())) << "pair " << p << ", chunk " << ch;
    ++seen[ch][rows[p]];
  }
  for (std::int64_t ch = 0; ch < c.chunks; ++ch)
    for (int n : seen[ch]) ASSERT_EQ(n, 1) << "chunk " << ch;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuRoutingMetadata,
    testing::Values(MetadataCase{1000, 8, 2, 2, false, "topk_boundary_inside_a_tile"},
                    MetadataCase{1024, 64, 4, 4, false, "topk_boundaries_on_tile_edges"},
                    MetadataCase{40960 / 8, 128, 8, 2, false, "topk_small_row_shape"},
                    MetadataCase{3, 4, 1, 5, false, "topk_more_chunks_than_tokens"},
                    MetadataCase{1, 16, 16, 2, false, "topk_one_token_K_equals_E"},
                    MetadataCase{300, 600, 3, 3, false, "topk_more_experts_than_a_block"},
                    MetadataCase{500, 16, 4, 3, true, "caller_variable_pairs"},
                    MetadataCase{2000, 256, 8, 2, true, "caller_many_experts"},
                    MetadataCase{2600, 200, 8, 3, true, "caller_200_experts_three_chunks"}),
    [](const testing::TestParamInfo<MetadataCase>& i) { return std::string(i.param.name); });

// The metadata itself against a plain CPU layout (each expert's pairs in ascending pair order, experts in
// ascending order; GEMM tiles of kGemmTileM rows), for tile counts that take each width of the tile scan (up to
// 256, 512, 1024 and 2048 tiles a step, and more than one step of 2048), top-K and caller pairs: counts,
// offsets, tiles, scatter, gather and inverse, and a repeat that gives the same bytes (the scan's last-block
// counter left ready by the histograms' zero fill).
class GpuRoutingMetadataLayout : public testing::TestWithParam<MetadataCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

TEST_P(GpuRoutingMetadataLayout, MatchesAStableCpuLayout) {
  const MetadataCase& c = GetParam();
  std::vector<std::int32_t> expert, token;
  make_pairs(c, expert, token);
  const std::int64_t P = static_cast<std::int64_t>(expert.size());
  const std::int64_t n_tiles = (P + kMetadataTile - 1) / kMetadataTile;
  progress("routing metadata layout " + std::string(c.name) + ": P " + std::to_string(P) + ", " +
           std::to_string(n_tiles) + " tiles");
  const DeviceBuffer d_expert(bytes_of(expert)), d_token(bytes_of(token));

  // CPU: counts, offsets, tiles, and each routed pair's grouped row.
  const std::size_t E = static_cast<std::size_t>(c.E);
  std::vector<std::int32_t> counts(E, 0), offsets(E + 1, 0), tiles(E + 1, 0);
  for (std::int32_t e : expert)
    if (e >= 0 && e < c.E) ++counts[static_cast<std::size_t>(e)];
  for (std::size_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + counts[e];
    tiles[e + 1] = tiles[e] + (counts[e] + gpu::kGemmTileM - 1) / gpu::kGemmTileM;
  }
  const std::int32_t routed = offsets[E];
  std::vector<std::int32_t> inverse(static_cast<std::size_t>(P), -1), scatter(static_cast<std::size_t>(routed)),
      gather(static_cast<std::size_t>(routed));
  std::vector<std::int32_t> next(offsets.begin(), offsets.end() - 1);
  for (std::int64_t p = 0; p < P; ++p) {
    const std::int32_t e = expert[static_cast<std::size_t>(p)];
    if (e < 0 || e >= c.E) continue;
    const std::int32_t g = next[static_cast<std::size_t>(e)]++;
    inverse[static_cast<std::size_t>(p)] = g;
    scatter[static_cast<std::size_t>(g)] = static_cast<std::int32_t>(p);
    gather[static_cast<std::size_t>(g)] = token[static_cast<std::size_t>(p)];
  }

  for (const bool by_tile : {false, true}) {  // each place kernel (the sorted one takes E <= 256)
    SCOPED_TRACE(by_tile ? "place kernel by tile" : "place kernel sorting blocks of tiles");
    Metadata m(c, P);
    MetadataArgs a = m.args(c, P, d_expert, d_token);
    a.place = by_tile ? gpu::PlaceKernel::kByTile : gpu::PlaceKernel::kSorted;
    ASSERT_EQ(gpu::place_kernel_sorts(a), !by_tile && c.E <= 256);
    std::vector<std::int32_t> first[6];
    for (int run = 0; run < 2; ++run) {
      gpu::launch_routing_metadata(a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<std::int32_t> got[6] = {ints_of(m.counts),  ints_of(m.offsets), ints_of(m.tiles),
                                                ints_of(m.scatter), ints_of(m.gather),  ints_of(m.inverse)};
      if (run == 0) {
        EXPECT_EQ(got[0], counts);
        EXPECT_EQ(got[1], offsets);
        EXPECT_EQ(got[2], tiles);
        EXPECT_EQ(std::vector<std::int32_t>(got[3].begin(), got[3].begin() + routed), scatter);
        EXPECT_EQ(std::vector<std::int32_t>(got[4].begin(), got[4].begin() + routed), gather);
        EXPECT_EQ(std::vector<std::int32_t>(got[5].begin(), got[5].begin() + P), inverse);
        for (int i = 0; i < 6; ++i) first[i] = got[i];
      } else {
        for (int i = 0; i < 6; ++i) EXPECT_EQ(got[i], first[i]) << "a repeat changed output " << i;
      }
    }
    EXPECT_TRUE(m.scatter.canary_intact());
    EXPECT_TRUE(m.gather.canary_intact());
    EXPECT_TRUE(m.inverse.canary_intact());
  }
}

// The layer's choice (PlaceKernel::kAuto): the sorted kernel only where it was measured faster, E = 128 to 256 with
// at least 96 blocks of 2048 pairs; E = 64 at 48 blocks, which it lost, keeps the per-tile kernel.
TEST(GpuRoutingMetadata, PlaceKernelChoice) {
  ASSERT_EQ(std::getenv("MACHMOE_PLACE_BY_TILE"), nullptr) << "unset MACHMOE_PLACE_BY_TILE for this test";
  const auto sorts = [](std::int64_t E, std::int64_t P, gpu::PlaceKernel place = gpu::PlaceKernel::kAuto) {
    MetadataArgs a;
    a.E = E, a.P = P, a.place = place;
    return gpu::place_kernel_sorts(a);
  };
  EXPECT_TRUE(sorts(128, 40960 * 8));        // 1.4B (256,128,8): 160 blocks
  EXPECT_TRUE(sorts(128, 24576 * 8));        // 7B (256,128,8): 96 blocks
  EXPECT_TRUE(sorts(256, 32768 * 16));       // 30B (256,256,16): 256 blocks
  EXPECT_FALSE(sorts(128, 24576 * 8 - 1));   // fewer than 96 blocks' pairs
  EXPECT_FALSE(sorts(64, 24576 * 4));        // 7B (512,64,4): 48 blocks, measured slower
  EXPECT_FALSE(sorts(64, 32768 * 16));       // E = 64, unmeasured at any size
  EXPECT_FALSE(sorts(257, 32768 * 16));      // past one expert a thread
  EXPECT_FALSE(sorts(128, 40960 * 8, gpu::PlaceKernel::kByTile));
  EXPECT_TRUE(sorts(1, 1, gpu::PlaceKernel::kSorted));
  EXPECT_FALSE(sorts(257, 1, gpu::PlaceKernel::kSorted));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuRoutingMetadataLayout,
    testing::Values(MetadataCase{7, 8, 2, 1, false, "one_tile"},
                    MetadataCase{40000, 64, 4, 1, false, "scan_width_1024"},
                    MetadataCase{15000, 32, 8, 1, false, "scan_width_512"},
                    MetadataCase{60000, 128, 8, 1, false, "scan_width_2048"},
                    MetadataCase{70000, 128, 8, 1, false, "scan_two_steps_of_2048"},
                    MetadataCase{9000, 600, 6, 1, true, "caller_more_experts_than_a_block"},
                    MetadataCase{200000, 16, 6, 1, true, "caller_scan_two_steps"},
                    MetadataCase{5001, 256, 8, 1, true, "caller_256_experts_partial_last_block"},
                    MetadataCase{3000, 1, 1, 1, true, "caller_one_expert"},
                    MetadataCase{777, 100, 7, 1, true, "caller_100_experts"},
                    MetadataCase{1500, 255, 5, 1, false, "topk_255_experts"},
                    MetadataCase{257, 257, 2, 1, false, "topk_257_experts_by_tile_only"}),
    [](const testing::TestParamInfo<MetadataCase>& i) { return std::string(i.param.name); });

// The top-K kernel that also writes the metadata's tile histograms (launch_topk_scores with TopKTileHistograms) and
// the metadata built from them (histograms_written: no zero-fill, no histogram kernel), against the top-K kernel
// alone and launch_routing_metadata's own histograms: every output bitwise, with and without the forward's chunk
// plan; and the histograms as the top-K kernel left them against a count on the host. The histogram buffer starts as
// 0xFF bytes, so a count or the scan's counter left unwritten shows. K = 1, 2, 4, 8 (256, 128, 64 and 32 tokens a
// tile; blocks of 512, 256, 128 and 128 threads), token counts that leave the last
// block and the last tile partial, one token, 8 to 128 experts; and the shapes it declines (K = 3, E > 128, a score
// over all experts, fp16), where it must say so and write nothing.
TEST(GpuRoutingMetadataTopK, TopKKernelWritesTheTileHistograms) {
  REQUIRE_GPU();
  struct Shape {
    std::int64_t T, E, K;
    ScoreVariant sv;
    DType dt;
    bool fused;  // whether the kernel takes the histograms
  };
  const ScoreVariant over_k = ScoreVariant::kSoftmaxOverTopK;
  for (const Shape& sh : {Shape{1, 8, 1, over_k, DType::kBF16, true}, Shape{1, 8, 8, over_k, DType::kBF16, true},
                          Shape{300, 16, 1, over_k, DType::kBF16, true},
                          Shape{4097, 32, 2, ScoreVariant::kTopKOfSoftmaxRenorm, DType::kBF16, true},
                          Shape{777, 64, 4, over_k, DType::kBF16, true}, Shape{1000, 128, 8, over_k, DType::kBF16, true},
                          Shape{40960, 128, 8, over_k, DType::kBF16, true},
                          Shape{24576, 64, 4, over_k, DType::kBF16, true},
                          Shape{500, 128, 3, over_k, DType::kBF16, false}, Shape{500, 256, 8, over_k, DType::kBF16, false},
                          Shape{500, 128, 8, ScoreVariant::kTopKOfSoftmax, DType::kBF16, false},
                          Shape{500, 128, 8, over_k, DType::kFP16, false}}) {
    const std::int64_t T = sh.T, E = sh.E, K = sh.K, P = T * K;
    const std::int64_t n_tiles = (P + kMetadataTile - 1) / kMetadataTile;
    const std::string what = "T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K) + " " +
                             score_variant_name(sh.sv) + " " + dtype_name(sh.dt);
    std::mt19937 rng(static_cast<std::uint32_t>(T * 31 + E * 7 + K));
    std::normal_distribution<double> normal;
    std::vector<double> logits(static_cast<std::size_t>(T * E));
    for (double& v : logits) v = normal(rng);
    const DeviceBuffer d_logits(encode(logits, sh.dt));
    for (std::int64_t chunks : {std::int64_t{1}, std::int64_t{3}}) {
      const MetadataCase c{T, E, K, chunks, false, "topk"};
      std::vector<std::int32_t> outputs[2][10];
      for (int fused = 0; fused < 2; ++fused) {
        DeviceBuffer scores(static_cast<std::size_t>(P) * 4), experts(static_cast<std::size_t>(P) * 4);
        Metadata m(c, P);  // the histograms start as 0xFF bytes
        const TopKTileHistograms histograms{static_cast<std::int32_t*>(m.hist.get()), n_tiles};
        const bool written = gpu::launch_topk_scores(sh.dt, d_logits.get(), E, T, E, K, sh.sv,
                                                     static_cast<float*>(scores.get()),
                                                     static_cast<std::int32_t*>(experts.get()), nullptr,
                                                     fused ? histograms : TopKTileHistograms{});
        ASSERT_EQ(written, fused && sh.fused) << what;
        if (fused) {
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
          const std::vector<std::int32_t> hist = ints_of(m.hist);
          if (!sh.fused) {  // declined: nothing written into the histograms
            EXPECT_TRUE(std::all_of(hist.begin(), hist.end(), [](std::int32_t v) { return v == -1; })) << what;
          } else {  // the histograms themselves, against the selections counted on the host, and a zero counter
            const std::vector<std::int32_t> chosen = ints_of(experts);
            std::vector<std::int32_t> expect(static_cast<std::size_t>(E * n_tiles + 1), 0);
            for (std::int64_t q = 0; q < P; ++q) ++expect[static_cast<std::size_t>(chosen[q] * n_tiles + q / kMetadataTile)];
            EXPECT_EQ(std::vector<std::int32_t>(hist.begin(), hist.begin() + E * n_tiles + 1), expect) << what;
          }
        }
        MetadataArgs a = m.args(c, P, experts, experts);
        a.histograms_written = written;
        if (chunks > 1) {
          a.chunks = chunks, a.pairs_per_chunk = (P + chunks - 1) / chunks;
          a.plan = DxChunkPlan::in(static_cast<std::int32_t*>(m.plan.get()), chunks, E);
          a.pair_rows = static_cast<std::int32_t*>(m.pair_rows.get());
        }
        gpu::launch_routing_metadata(a, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
        const DeviceBuffer* bufs[10] = {&scores, &experts, &m.counts, &m.offsets, &m.tiles,
                                        &m.scatter, &m.inverse, &m.gather, &m.plan, &m.pair_rows};
        for (int i = 0; i < 10; ++i) outputs[fused][i] = ints_of(*bufs[i]);
        EXPECT_TRUE(m.hist.canary_intact()) << what;
      }
      const char* names[10] = {"scores", "experts", "counts", "offsets", "tiles",
                               "scatter", "inverse", "gather", "plan", "pair_rows"};
      for (int i = 0; i < 10; ++i)
        EXPECT_EQ(outputs[1][i], outputs[0][i]) << what << ", " << chunks << " chunks: " << names[i];
    }
  }
}

// A host function of the GPU runtime (kernels.hpp includes the CUDA runtime, so it cannot go into the CPU suite);
// labelled gpu with the rest of this binary, it fails without a GPU as every test here does.
TEST(GpuRoutingMetadataLimits, PlanLeftToTheSearchAboveTheSharedMemoryLimit) {
  REQUIRE_GPU();
  MetadataArgs a;
  a.chunks = 2, a.E = kFusedPlanMaxExperts;
  EXPECT_TRUE(metadata_built_plan(a));
  a.E = kFusedPlanMaxExperts + 1;
  EXPECT_FALSE(metadata_built_plan(a)) << "two E-int histograms no longer fit a block's shared memory";
  a.E = 8, a.chunks = 1;
  EXPECT_FALSE(metadata_built_plan(a)) << "one pass: no plan";
}

}  // namespace
}  // namespace machmoe::test
