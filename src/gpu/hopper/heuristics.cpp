#include "gpu/hopper/heuristics.hpp"

namespace machmoe::gpu::hopper {

namespace {
/// The wide (256) tile's padded width is at most `percent` % of the square (128) one's: 100 is "pads no more
/// columns" (ceil(N / 128) even).
bool wide_tile_within(std::int64_t N, std::int64_t percent) {
  return tiles_of(N, 256) * 256 * 100 <= tiles_of(N, 128) * 128 * percent;
}

std::string extent_reason(const char* name, std::int64_t v) {
  if (v > 0 && v % kExtentGranule == 0) return "";
  return std::string(name) + " = " + std::to_string(v) + " is not a positive multiple of " +
         std::to_string(kExtentGranule) + " (16-byte rows)";
}
}  // namespace

std::string varlen_m_shape_unsupported_reason(std::int64_t N, std::int64_t K, bool glu_up) {
  std::string r = extent_reason("K", K);
  if (r.empty()) r = extent_reason("N", N);
  if (r.empty() && glu_up && (N / 2) % kExtentGranule != 0)
    r = "N = " + std::to_string(N) + " of a GLU up-projection: n = N / 2 is not a multiple of " +
        std::to_string(kExtentGranule) + " (16-byte rows of A)";
  return r;
}

std::string wgrad_shape_unsupported_reason(std::int64_t M, std::int64_t N) {
  std::string r = extent_reason("M", M);
  return r.empty() ? extent_reason("N", N) : r;
}

TileChoice choose_tiles(const GemmShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  const bool grouped = shape.family == KernelFamily::kDxExpanded ||
                       (shape.family == KernelFamily::kDownProjection && shape.K >= kDownRasterMinK);
  c.raster_m = overrides.raster_m > 0 ? overrides.raster_m : grouped ? kContiguousRasterM : 1;
  if (shape.family == KernelFamily::kDxExpanded)
    c.cluster_m = overrides.cluster_m == 1 || overrides.cluster_m == 2 ? overrides.cluster_m
                  : shape.K >= kDxClusterMinK                          ? 2
                                                                        : 1;
  // A forced tile is honoured for every N (edge tiles make any N run on either).
  if (overrides.tile_n == 128 || overrides.tile_n == 256) {
    c.tile_n = overrides.tile_n;
    return c;
  }
  // The dH kernel: the ping-pong tile (its long epilogue hidden behind the other warpgroup's mainloop) except where
  // the reduction d, the width n and the experts' rows are all large (heuristics.hpp, kDhWideMin*).
  if (shape.family == KernelFamily::kDhKernel) {
    c.tile_n = shape.K >= kDhWideMinK && shape.N >= kDhWideMinN && shape.N % 256 == 0 &&
                       shape.rows_per_expert >= kDhWideMinRowsPerExpert
                   ? 256
                   : 128;
    return c;
  }
  // The down-projection and dX~ where d is wide and the reduction short: the ping-pong tile (heuristics.hpp,
  // kContiguousPingPong*).
  const std::int64_t dx_max_k =
      shape.memory_gbps >= kDxPingPongFastMemoryGbps ? kDxPingPongMaxK : kDxPingPongSlowMemoryMaxK;
  const bool short_k = (shape.family == KernelFamily::kDownProjection && shape.K <= kDownPingPongMaxK) ||
                       (shape.family == KernelFamily::kDxExpanded && shape.K <= dx_max_k);
  if (short_k && shape.N >= kContiguousPingPongMinN) {
    c.tile_n = 128;
    return c;
  }
  // Otherwise the tile that pads the fewest columns, the wide one on a tie (every N that is a multiple of 256); the
  // up-projection takes the wide one while it pads at most kUpProjectionWidePercent % of the square one's width.
  const std::int64_t percent = shape.family == KernelFamily::kUpProjection ? kUpProjectionWidePercent : 100;
  c.tile_n = wide_tile_within(shape.N, percent) ? 256 : 128;
  return c;
}

namespace {
int wgrad_tile_n(const WgradShape& shape, const TileOverrides& overrides) {
  if (overrides.tile_n == 128 || overrides.tile_n == 256) return overrides.tile_n;
  if (!wide_tile_within(shape.N, kWgradWidePercent)) return 128;
  const std::int64_t wide_tiles = shape.E * tiles_of(shape.M, 128) * tiles_of(shape.N, 256);
  return wide_tiles >= shape.sm_count ? 256 : 128;
}
}  // namespace

TileChoice choose_wgrad_tiles(const WgradShape& shape, const TileOverrides& overrides) {
  TileChoice c;
  c.raster_m = 1;  // the varlen-K scheduler's order: m-tiles fastest inside an expert (in groups: wgrad_m_group)
  c.tile_n = wgrad_tile_n(shape, overrides);
  const bool short_segments = shape.rows_per_expert > 0 &&
                              shape.rows_per_expert <= (wgrad_stages(c.tile_n) + 1) * std::int64_t{64};
  c.wgrad_m_group = overrides.wgrad_m_group > 0 ? overrides.wgrad_m_group : short_segments ? kWgradMGroup : 1;
  return c;
}

}  // namespace machmoe::gpu::hopper
