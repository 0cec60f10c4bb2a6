#include "gpu/hopper/heuristics.hpp"

namespace machmoe::gpu::hopper {

TileChoice choose_tiles(const GemmShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  c.tile_n = (overrides.tile_n == 128 || shape.N % 256 != 0) ? 128 : 256;
  c.raster_m = overrides.raster_m > 0 ? overrides.raster_m : 1;
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
