#include "gpu/hopper/heuristics.hpp"

namespace machmoe::gpu::hopper {

TileChoice choose_tiles(const GemmShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  c.tile_n = (overrides.tile_n == 128 || shape.N % 256 != 0) ? 128 : 256;
  c.raster_m = overrides.raster_m > 0 ? overrides.raster_m : 1;
  return c;
}

}  // namespace machmoe::gpu::hopper
