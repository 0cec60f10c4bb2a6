#include "gpu/hopper/heuristics.hpp"

namespace machmoe::gpu::hopper {

TileChoice choose_tiles(const GemmShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  c.raster_m = overrides.raster_m > 0 ? overrides.raster_m : 1;
  c.tile_n = 128;
  if (shape.N % 256 != 0 || overrides.tile_n == 128) return c;
  if (overrides.tile_n == 256) {
    c.tile_n = 256;
    return c;
  }
  // The dH kernel's epilogue (H read, activation gradient, A' and dS) is long next to a short mainloop: with K = d
  // up to 2048 the ping-pong tile hides one warpgroup's epilogue behind the other's mainloop and measured 4-7 %
  // faster; at d = 4096 the mainloop dominates and the wide tile's halved operand traffic wins by 15-25 %.
  if (shape.family == KernelFamily::kDhKernel && shape.K <= kDhPingPongMaxK) return c;
  c.tile_n = 256;
  return c;
}

TileChoice choose_wgrad_tiles(const WgradShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  c.raster_m = 1;  // the varlen-K scheduler has one order (m-tiles fastest inside an expert)
  c.tile_n = 128;
  if (shape.N % 256 != 0 || overrides.tile_n == 128) return c;
  if (overrides.tile_n == 256) {
    c.tile_n = 256;
    return c;
  }
  const std::int64_t wide_tiles = shape.E * (shape.M / 128) * (shape.N / 256);
  c.tile_n = wide_tiles >= shape.sm_count ? 256 : 128;
  return c;
}

}  // namespace machmoe::gpu::hopper
