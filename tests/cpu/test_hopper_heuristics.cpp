// The Hopper tile heuristics are pure functions of the shape and the overrides (src/gpu/hopper/heuristics.hpp), so
// they are tested here, on the CPU, without a device.
#include <gtest/gtest.h>

#include "gpu/hopper/heuristics.hpp"

namespace machmoe::test {
namespace {

using gpu::hopper::choose_tiles;
using gpu::hopper::GemmShape;
using gpu::hopper::KernelFamily;
using gpu::hopper::TileOverrides;

GemmShape shape(KernelFamily f, std::int64_t N, std::int64_t K) {
  GemmShape s;
  s.family = f, s.N = N, s.K = K;
  return s;
}

TEST(HopperHeuristics, WideTileWhereNAllowsIt) {
  for (KernelFamily f : {KernelFamily::kUpProjection, KernelFamily::kDownProjection}) {
    EXPECT_EQ(choose_tiles(shape(f, 512, 1536), {}).tile_n, 256);   // 7B (256,128,8) up: N = 2n = 512
    EXPECT_EQ(choose_tiles(shape(f, 4096, 2048), {}).tile_n, 256);  // 120B down: N = d
    EXPECT_EQ(choose_tiles(shape(f, 384, 768), {}).tile_n, 128);    // a multiple of 128, not of 256
    EXPECT_EQ(choose_tiles(shape(f, 128, 64), {}).tile_n, 128);
  }
}

TEST(HopperHeuristics, DhKernelTakesThePingPongTileUnlessDNAndTheExpertsAreLarge) {
  auto dh = [](std::int64_t n, std::int64_t d, std::int64_t rows, const TileOverrides& o = {}) {
    GemmShape s = shape(KernelFamily::kDhKernel, n, d);
    s.rows_per_expert = rows;
    return choose_tiles(s, o).tile_n;
  };
  for (std::int64_t d : {768, 1536, 2048, 2880, 4096, 8192})
    for (std::int64_t n : {8, 200, 256, 384, 512, 1024, 1280, 2048, 2880, 4096})
      for (std::int64_t rows : {0, 1, 256, 1023, 1024, 2048, 100000}) {
        // The wide tile only from d = 4096 and 1024 rows per expert on, and for n a multiple of 256.
        const int expected = d >= 4096 && n % 256 == 0 && rows >= 1024 ? 256 : 128;
        EXPECT_EQ(dh(n, d, rows), expected) << n << " " << d << " " << rows;
      }
  EXPECT_EQ(dh(2048, 4096, 32768 * 4 / 64), 256);    // 120B (2048,64,4)
  EXPECT_EQ(dh(1024, 4096, 32768 * 8 / 128), 256);   // 120B (1024,128,8)
  EXPECT_EQ(dh(1024, 4096, 32768 * 4 / 64), 256);    // 30B (1024,64,4)
  EXPECT_EQ(dh(512, 4096, 32768 * 16 / 256), 256);   // 120B (512,256,16)
  EXPECT_EQ(dh(512, 4096, 32768 * 8 / 128), 256);    // 30B (512,128,8)
  EXPECT_EQ(dh(256, 4096, 32768 * 16 / 256), 256);   // 30B (256,256,16)
  EXPECT_EQ(dh(256, 1536, 24576 * 8 / 128), 128);    // 7B (256,128,8)
  EXPECT_EQ(dh(256, 768, 40960 * 8 / 128), 128);     // 1.4B (256,128,8)
  EXPECT_EQ(dh(1024, 4096, 16384 * 4 / 256), 128);   // (16384,4096,1024,256,4): two M-tiles per expert
  EXPECT_EQ(dh(1024, 4096, 16384 * 4 / 64), 256);    // (16384,4096,1024,64,4)
  EXPECT_EQ(dh(2880, 2880, 16384 * 4 / 32), 128);    // gpt-oss
  EXPECT_EQ(dh(2048, 4096, 0), 128);                 // rows unknown: the square tile
  TileOverrides o;
  o.tile_n = 256;  // forced: the wide tile, whatever d and the rows are
  EXPECT_EQ(dh(256, 1536, 2048, o), 256);
  EXPECT_EQ(dh(1024, 4096, 256, o), 256);
  o.tile_n = 128;  // and the square one where the heuristic takes the wide one
  EXPECT_EQ(dh(2048, 4096, 2048, o), 128);
}

// The down-projection and dX~ (A contiguous by TMA) take the ping-pong tile where d is wide and the reduction short
// (heuristics.hpp, kContiguousPingPong*); elsewhere, and for the other families, the tile the padding rule gives.
TEST(HopperHeuristics, ContiguousFamiliesTakeThePingPongTileWhereDIsWideAndKShort) {
  using gpu::hopper::kContiguousPingPongMinN;
  using gpu::hopper::kDownPingPongMaxK;
  using gpu::hopper::kDxPingPongMaxK;
  const auto down = [](std::int64_t N, std::int64_t K, const TileOverrides& o = {}) {
    return choose_tiles(shape(KernelFamily::kDownProjection, N, K), o).tile_n;
  };
  // dX~ on an H200-class device (its K = 1024 rule depends on the memory bandwidth; the next test).
  const auto dx = [](std::int64_t N, std::int64_t K, const TileOverrides& o = {}) {
    GemmShape s = shape(KernelFamily::kDxExpanded, N, K);
    s.memory_gbps = 4800;
    return choose_tiles(s, o).tile_n;
  };
  for (std::int64_t n : {256, 512}) {  // 30B (256,256,16), 30B (512,128,8), 120B (512,256,16): d = 4096
    EXPECT_EQ(down(4096, n), 128) << n;
    EXPECT_EQ(dx(4096, 2 * n), 128) << n;
  }
  for (std::int64_t n : {1024, 2048}) {  // 30B (1024,64,4), 120B (1024,128,8), 120B (2048,64,4)
    EXPECT_EQ(down(4096, n), 256) << n;
    EXPECT_EQ(dx(4096, 2 * n), 256) << n;
  }
  for (std::int64_t d : {768, 1536}) {  // the 1.4B and 7B rows
    EXPECT_EQ(down(d, 256), 256) << d;
    EXPECT_EQ(dx(d, 512), 256) << d;
  }
  // The bounds.
  EXPECT_EQ(down(kContiguousPingPongMinN, kDownPingPongMaxK), 128);
  EXPECT_EQ(down(kContiguousPingPongMinN, kDownPingPongMaxK + 8), 256);
  EXPECT_EQ(dx(kContiguousPingPongMinN, kDxPingPongMaxK), 128);
  EXPECT_EQ(dx(kContiguousPingPongMinN, kDxPingPongMaxK + 8), 256);
  EXPECT_EQ(down(kContiguousPingPongMinN - 256, 256), 256);
  EXPECT_EQ(down(8192, 256), 128);
  EXPECT_EQ(down(4096 + 200, 8), 128);  // an edge N past the bound
  // The gathered families keep theirs.
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 4096, 256), {}).tile_n, 256);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 4096, 256), {}).tile_n, 128);
  // A forced tile wins; the rasterisation and dX~'s clusters are the same whatever the tile.
  TileOverrides o;
  o.tile_n = 256;
  EXPECT_EQ(down(4096, 256, o), 256);
  EXPECT_EQ(dx(4096, 512, o), 256);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 512), {}).raster_m, gpu::hopper::kContiguousRasterM);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 4096, 512), {}).raster_m,
            gpu::hopper::kContiguousRasterM);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 4096, 256), {}).raster_m, 1);
  TileOverrides pairs;
  pairs.cluster_m = 2;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 512), pairs).cluster_m, 2);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 512), pairs).tile_n, 128);
}

TEST(HopperHeuristics, OverridesAreHonouredForEveryN) {
  TileOverrides o;
  o.tile_n = 128;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, 1536), o).tile_n, 128);
  o.tile_n = 256;  // every N takes either tile now (edge tiles): N = 384 runs as two wide tiles, the second half empty
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 384, 1536), o).tile_n, 256);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, 1536), o).tile_n, 256);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 2880, 2880), o).tile_n, 256);
  o.tile_n = 64;  // not a tile: the heuristic's
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 2880, 2880), o).tile_n, 128);
}

// dX~ at K = 2n = 1024 with d = 4096 (n = 512): the ping-pong tile on an H200 (4.8 TB/s), the wide one on an H100
// (3.35 TB/s) and where the bandwidth is unknown; at K = 512 the ping-pong tile on both.
TEST(HopperHeuristics, DxAtK1024TakesThePingPongTileOnlyWithFastMemory) {
  using gpu::hopper::kDxPingPongFastMemoryGbps;
  const auto dx = [](std::int64_t K, std::int64_t gbps) {
    GemmShape s = shape(KernelFamily::kDxExpanded, 4096, K);
    s.memory_gbps = gbps;
    return choose_tiles(s, {}).tile_n;
  };
  EXPECT_EQ(dx(1024, 4800), 128);  // H200
  EXPECT_EQ(dx(1024, 3352), 256);  // H100 SXM
  EXPECT_EQ(dx(1024, 0), 256);     // unknown
  EXPECT_EQ(dx(1024, kDxPingPongFastMemoryGbps), 128);
  EXPECT_EQ(dx(1024, kDxPingPongFastMemoryGbps - 1), 256);
  for (std::int64_t gbps : {0, 3352, 4800}) {
    EXPECT_EQ(dx(512, gbps), 128) << gbps;   // 30B (256,256,16): the ping-pong tile everywhere
    EXPECT_EQ(dx(2048, gbps), 256) << gbps;  // n = 1024: the wide tile everywhere
  }
  // The down-projection does not depend on it.
  GemmShape down = shape(KernelFamily::kDownProjection, 4096, 512);
  EXPECT_EQ(choose_tiles(down, {}).tile_n, 128);
  down.memory_gbps = 4800;
  EXPECT_EQ(choose_tiles(down, {}).tile_n, 128);
}

// N that is not a multiple of 128 (edge tiles): the tile that pads the fewest columns, the wide one on a tie; the
// up-projection takes the wide one up to kUpProjectionWidePercent % of the square one's padded width.
TEST(HopperHeuristics, OddNTakesTheTileWithTheLeastPadding) {
  using gpu::hopper::padded_columns;
  using gpu::hopper::tiles_of;
  EXPECT_EQ(tiles_of(2880, 128), 23);
  EXPECT_EQ(tiles_of(2880, 256), 12);
  EXPECT_EQ(padded_columns(2880, 128), 64);   // 2944 - 2880
  EXPECT_EQ(padded_columns(2880, 256), 192);  // 3072 - 2880
  for (KernelFamily f : {KernelFamily::kUpProjection, KernelFamily::kDownProjection, KernelFamily::kDxExpanded,
                         KernelFamily::kDhKernel}) {
    const bool up = f == KernelFamily::kUpProjection;
    // gpt-oss d = n = 2880 (down, dX~, dH: N = 2880): 3072 columns against 2944 (104 %).
    EXPECT_EQ(choose_tiles(shape(f, 2880, 2880), {}).tile_n, up ? 256 : 128);
    // gpt-oss's up-projection, N = 2n = 5760 = 22 x 256 + 128: 5888 columns against 5760 (102 %).
    EXPECT_EQ(choose_tiles(shape(f, 5760, 2880), {}).tile_n, up ? 256 : 128);
    EXPECT_EQ(choose_tiles(shape(f, 72, 200), {}).tile_n, 128);     // 256 columns against 128 (200 %)
    EXPECT_EQ(choose_tiles(shape(f, 8, 8), {}).tile_n, 128);
    EXPECT_EQ(choose_tiles(shape(f, 264, 136), {}).tile_n, 128);    // 512 against 384 (133 %)
    EXPECT_EQ(choose_tiles(shape(f, 1152, 2880), {}).tile_n, 128);  // 1280 against 1152: 111 %, past 110
    EXPECT_EQ(choose_tiles(shape(f, 1400, 2880), {}).tile_n, up ? 256 : 128);  // 1536 against 1408: 109 %
    // Ties take the wide tile, except in the dH kernel, which takes the ping-pong tile unless d >= 4096 and the
    // experts average 1024 rows or more (none given here).
    const int tie = f == KernelFamily::kDhKernel ? 128 : 256;
    EXPECT_EQ(choose_tiles(shape(f, 200, 72), {}).tile_n, tie);     // both pad 56
    EXPECT_EQ(choose_tiles(shape(f, 400, 136), {}).tile_n, tie);    // both pad 112
    EXPECT_EQ(choose_tiles(shape(f, 400, 4096), {}).tile_n, tie);   // both pad 112, whatever d
  }
  // Whatever the tile, the tiles cover N with less than one tile of padding; the down-projection's pads the fewest
  // columns, the up-projection's at most 10 % more than the square tile's.
  for (std::int64_t N = 8; N <= 8192; N += 8) {
    for (KernelFamily f : {KernelFamily::kUpProjection, KernelFamily::kDownProjection}) {
      const int t = choose_tiles(shape(f, N, 64), {}).tile_n;
      EXPECT_GE(tiles_of(N, t) * t, N) << N;
      EXPECT_LT(tiles_of(N, t) * t - N, t) << N;
      if (f == KernelFamily::kDownProjection) {
        EXPECT_LE(padded_columns(N, t), padded_columns(N, 128)) << N;
        EXPECT_LE(padded_columns(N, t), padded_columns(N, 256)) << N;
      } else {
        EXPECT_LE(tiles_of(N, t) * t * 100, tiles_of(N, 128) * 128 * gpu::hopper::kUpProjectionWidePercent) << N;
        if (N % 256 == 0) {
          EXPECT_EQ(t, 256) << N;
        }
      }
    }
  }
}

TEST(HopperHeuristics, ShapeReasonsNameTheExtentThatBreaks16ByteRows) {
  using gpu::hopper::varlen_m_shape_unsupported_reason;
  using gpu::hopper::wgrad_shape_unsupported_reason;
  for (std::int64_t v : {8, 72, 136, 200, 264, 2880, 4096}) {
    EXPECT_EQ(varlen_m_shape_unsupported_reason(v, 2880, false), "") << v;
    EXPECT_EQ(varlen_m_shape_unsupported_reason(2880, v, false), "") << v;
    EXPECT_EQ(varlen_m_shape_unsupported_reason(2 * v, v, true), "") << v;  // GLU up: N = 2n
    EXPECT_EQ(wgrad_shape_unsupported_reason(v, 2880), "") << v;
    EXPECT_EQ(wgrad_shape_unsupported_reason(2880, v), "") << v;
  }
  EXPECT_EQ(varlen_m_shape_unsupported_reason(2880, 2884, false),
            "K = 2884 is not a positive multiple of 8 (16-byte rows)");
  EXPECT_EQ(varlen_m_shape_unsupported_reason(100, 64, false),
            "N = 100 is not a positive multiple of 8 (16-byte rows)");
  EXPECT_EQ(varlen_m_shape_unsupported_reason(0, 64, false), "N = 0 is not a positive multiple of 8 (16-byte rows)");
  EXPECT_EQ(varlen_m_shape_unsupported_reason(128, 0, false), "K = 0 is not a positive multiple of 8 (16-byte rows)");
  // A GLU up-projection with n = 12: N = 24 is a multiple of 8, A's rows (12 wide) are not 16-byte multiples.
  EXPECT_NE(varlen_m_shape_unsupported_reason(24, 64, true).find("n = N / 2 is not a multiple of 8"),
            std::string::npos);
  EXPECT_EQ(varlen_m_shape_unsupported_reason(24, 64, false), "");
  EXPECT_EQ(wgrad_shape_unsupported_reason(12, 64), "M = 12 is not a positive multiple of 8 (16-byte rows)");
  EXPECT_EQ(wgrad_shape_unsupported_reason(64, 4), "N = 4 is not a positive multiple of 8 (16-byte rows)");
}

TEST(HopperHeuristics, ContiguousFamiliesRunInGroupsOfMTilesGatheredOnesAlongN) {
  using gpu::hopper::kContiguousRasterM;
  using gpu::hopper::kDownRasterMinK;
  for (std::int64_t K : {256, 512, 1024, 4096}) {
    EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, K), {}).raster_m,
              K >= kDownRasterMinK ? kContiguousRasterM : 1)
        << K;
    EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, K), {}).raster_m, kContiguousRasterM) << K;
    EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, K), {}).raster_m, 1) << K;
    EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 1024, K), {}).raster_m, 1) << K;
  }
  TileOverrides o;
  o.raster_m = 8;  // forced, for every family and K
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, 256), o).raster_m, 8);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, 1536), o).raster_m, 8);
  o.raster_m = -3;  // not a group size: the heuristic's
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, 1024), o).raster_m, kContiguousRasterM);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 1024, 4096), o).raster_m, 1);
}

TEST(HopperHeuristics, DxRunsInClustersWhereItsReductionIsLong) {
  using gpu::hopper::kDxClusterMinK;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 2880, 5760), {}).cluster_m, 2);  // gpt-oss: K = 2n
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 2944, 5888), {}).cluster_m, 2);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 4096), {}).cluster_m, 1);  // 120B (2048,64,4)
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 512), {}).cluster_m, 1);   // 30B (256,256,16)
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, kDxClusterMinK), {}).cluster_m, 2);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, kDxClusterMinK - 8), {}).cluster_m, 1);
  TileOverrides o;
  o.tile_n = 256;  // a forced tile keeps the cluster choice
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 2880, 5760), o).cluster_m, 2);
  o = {};
  o.cluster_m = 1;  // forced, either way
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 2880, 5760), o).cluster_m, 1);
  o.cluster_m = 2;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 4096, 512), o).cluster_m, 2);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 2880, 2880), o).cluster_m, 1);  // dX~ only
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 256, 768), o).cluster_m, 1);
  o.cluster_m = 3;  // not a cluster size: the heuristic's
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDxExpanded, 2880, 5760), o).cluster_m, 2);
}

// ---- weight gradients (varlen-K) ----------------------------------------------------------------------------------

gpu::hopper::WgradShape wgrad(std::int64_t E, std::int64_t M, std::int64_t N, int sms = 132) {
  gpu::hopper::WgradShape s;
  s.E = E, s.M = M, s.N = N, s.sm_count = sms;
  return s;
}

TEST(HopperHeuristics, WeightGradWideTileWhereNAndTheGridAllowIt) {
  using gpu::hopper::choose_wgrad_tiles;
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 1536, 256), {}).tile_n, 256);  // 7B dW2: M = d, N = n
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 1536), {}).tile_n, 256);  // 7B dW1: M = 2n, N = d
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 384), {}).tile_n, 128);   // N a multiple of 128, not of 256
  // 8 experts x 1 x 1 wide tiles cannot fill 132 SMs: the square tile gives twice as many.
  EXPECT_EQ(choose_wgrad_tiles(wgrad(8, 128, 256), {}).tile_n, 128);
  EXPECT_EQ(choose_wgrad_tiles(wgrad(132, 128, 256), {}).tile_n, 256);
  EXPECT_EQ(choose_wgrad_tiles(wgrad(132, 128, 256, 133), {}).tile_n, 128);
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 1536, 256), {}).raster_m, 1);
  // Odd extents (edge tiles): the wide tile up to kWgradWidePercent % of the square one's padded width, and the
  // grid rule counts ceil-divided tiles.
  EXPECT_EQ(choose_wgrad_tiles(wgrad(32, 2880, 2880), {}).tile_n, 256);  // gpt-oss dW2 (M = d, N = n): 104 %
  EXPECT_EQ(choose_wgrad_tiles(wgrad(32, 5760, 2880), {}).tile_n, 256);  // gpt-oss dW1 (M = 2n, N = d)
  EXPECT_EQ(choose_wgrad_tiles(wgrad(32, 2944, 2944), {}).tile_n, 256);  // 3072 against 2944
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 640), {}).tile_n, 256);   // 768 against 640: 120 %
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 136), {}).tile_n, 256);   // 256 against 256: a tie
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 264), {}).tile_n, 128);   // 512 against 384: 133 %
  EXPECT_EQ(choose_wgrad_tiles(wgrad(132, 200, 200), {}).tile_n, 256);   // 132 x ceil(200/128) x 1 wide tiles
  EXPECT_EQ(choose_wgrad_tiles(wgrad(66, 136, 200), {}).tile_n, 256);    // 66 x 2 x 1 = 132
  EXPECT_EQ(choose_wgrad_tiles(wgrad(65, 136, 200), {}).tile_n, 128);    // 130 < 132
}

TEST(HopperHeuristics, WeightGradOverridesAreHonouredForEveryN) {
  using gpu::hopper::choose_wgrad_tiles;
  TileOverrides o;
  o.tile_n = 128;
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 1536, 256), o).tile_n, 128);
  o.tile_n = 256;
  EXPECT_EQ(choose_wgrad_tiles(wgrad(8, 128, 256), o).tile_n, 256);    // forced past the grid rule
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 384), o).tile_n, 256);  // every N takes it now (an edge tile)
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 200, 72), o).tile_n, 256);
}

TEST(HopperHeuristics, WeightGradGroupsOfMTilesWhereTheSegmentsAreShort) {
  using gpu::hopper::choose_wgrad_tiles;
  using gpu::hopper::kWgradMGroup;
  auto group = [](std::int64_t E, std::int64_t M, std::int64_t N, std::int64_t rows, const TileOverrides& o = {}) {
    gpu::hopper::WgradShape s = wgrad(E, M, N);
    s.rows_per_expert = rows;
    return choose_wgrad_tiles(s, o).wgrad_m_group;
  };
  // The wide tile's ring holds 4 k-blocks: groups up to 320 rows per expert on average (one k-block more).
  EXPECT_EQ(group(256, 4096, 1024, 256), kWgradMGroup);  // (16384,4096,1024,256,4) dW2, top-K
  EXPECT_EQ(group(256, 2048, 4096, 320), kWgradMGroup);  // its dW1, token rounding's reservation (TK + E 64)
  EXPECT_EQ(group(256, 2048, 4096, 321), 1);
  EXPECT_EQ(group(128, 2048, 4096, 512), 1);    // (16384,4096,1024,128,4)
  EXPECT_EQ(group(128, 1536, 256, 1536), 1);    // 7B (256,128,8)
  EXPECT_EQ(group(128, 1536, 256, 0), 1);       // rows unknown
  // The square tile's ring holds 5: up to 384 rows.
  EXPECT_EQ(group(512, 512, 384, 384), kWgradMGroup);
  EXPECT_EQ(group(512, 512, 384, 385), 1);
  TileOverrides o;
  o.wgrad_m_group = 1;
  EXPECT_EQ(group(256, 4096, 1024, 256, o), 1);
  o.wgrad_m_group = 8;
  EXPECT_EQ(group(128, 1536, 256, 1536, o), 8);
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 1536, 256), o).tile_n, 256);  // the group leaves the tile alone
}

}  // namespace
}  // namespace machmoe::test
