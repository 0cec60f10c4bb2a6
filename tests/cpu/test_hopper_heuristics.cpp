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

TEST(HopperHeuristics, DhKernelPingPongForSmallD) {
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 256, 1536), {}).tile_n, 128);   // 7B (256,128,8): K = d
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 512, 768), {}).tile_n, 128);    // 1.4B
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 1024, 4096), {}).tile_n, 256);  // 30B / 120B
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 384, 4096), {}).tile_n, 128);   // N not a multiple of 256
  TileOverrides o;
  o.tile_n = 256;  // forced: the wide tile where N allows it, whatever d is
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDhKernel, 256, 1536), o).tile_n, 256);
}

TEST(HopperHeuristics, OverridesAreHonouredWhereTheShapeAllows) {
  TileOverrides o;
  o.tile_n = 128;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, 1536), o).tile_n, 128);
  o.tile_n = 256;  // not possible for N = 384: the heuristic's tile stays
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 384, 1536), o).tile_n, 128);
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kUpProjection, 512, 1536), o).tile_n, 256);
}

TEST(HopperHeuristics, RasterisationAlongNUnlessForced) {
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, 256), {}).raster_m, 1);
  TileOverrides o;
  o.raster_m = 4;
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, 256), o).raster_m, 4);
  o.raster_m = -3;  // not a group size: the heuristic's
  EXPECT_EQ(choose_tiles(shape(KernelFamily::kDownProjection, 1536, 256), o).raster_m, 1);
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
}

TEST(HopperHeuristics, WeightGradOverridesAreHonouredWhereTheShapeAllows) {
  using gpu::hopper::choose_wgrad_tiles;
  TileOverrides o;
  o.tile_n = 128;
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 1536, 256), o).tile_n, 128);
  o.tile_n = 256;
  EXPECT_EQ(choose_wgrad_tiles(wgrad(8, 128, 256), o).tile_n, 256);    // forced past the grid rule
  EXPECT_EQ(choose_wgrad_tiles(wgrad(128, 512, 384), o).tile_n, 128);  // not possible for N = 384
}

}  // namespace
}  // namespace machmoe::test
