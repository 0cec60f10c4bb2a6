// Persistent tile scheduler over variable-length expert segments (varlen-M).
//
// The work is the list of output tiles of every expert in expert order; expert e contributes
// ceil(f_e / kTileM) x n_tiles tiles, f_e = off[e+1] - off[e] (empty experts contribute none, segments are not
// padded). CTA b takes tiles b, b + grid, b + 2 grid, ... (a static persistent schedule: deterministic, no atomics).
// Rasterisation inside an expert: groups of raster_m M-tiles; inside a group the tiles run along M (raster_m tiles
// sharing one weight tile) and then along N. raster_m = 1 is along N (every N-tile of one M-tile, sharing its
// gathered A rows, then the next M-tile). Either way the CTAs working at one time hold one or two experts' weights
// and a band of A rows in L2; the dispatcher picks raster_m (dispatch.cpp).
//
// Each warp decodes its tile index on its own: the lanes load 32 experts' offsets at once, scan their tile counts
// with shuffles, and the warp keeps the window's position, so that a CTA walks the expert list once over its life.
//
// The gathered families read a token's row once per routed pair, mostly from HBM: its K experts run far apart in
// this order. Ordering their tiles in groups of experts, M-tile index first inside a group (an expert's m-th M-tile
// covers about the same tokens as every other's), to serve a row to its other experts from L2, read more from HBM
// instead (the group's weights lost from L2) and was no faster (H200, docs/BENCHMARKS.md, session 61).
#pragma once

#include <cstdint>

#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"

namespace machmoe::gpu::hopper {

struct TileCoord {
  int expert = -1;        // -1: past the last tile
  std::int64_t row0 = 0;  // first grouped row of the tile
  int rows = 0;           // rows of the tile inside the expert's segment (<= kTileM)
  int n_tile = 0;
  __device__ bool valid() const { return expert >= 0; }
};

template <int kTileM>
class VarlenTileScheduler {
 public:
  __device__ VarlenTileScheduler(const std::int32_t* offsets, int E, int n_tiles, int raster_m)
      : offsets_(offsets), E_(E), n_tiles_(n_tiles), raster_m_(raster_m) {}

  /// The coordinates of work tile `tile`; tiles must be asked for in increasing order. Warp-collective.
  __device__ TileCoord get(int tile) {
    const int lane = threadIdx.x & 31;
    while (window_ < E_) {
      if (!loaded_) {  // this lane's expert of the window, its tile count and the window's inclusive scan
        const int e = window_ + lane;
        count_ = 0, start_ = 0, end_ = 0;
        if (e < E_) {
          start_ = offsets_[e];
          end_ = offsets_[e + 1];
          count_ = ((end_ - start_ + kTileM - 1) / kTileM) * n_tiles_;
        }
        inclusive_ = count_;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, inclusive_, o);
          if (lane >= o) inclusive_ += v;
        }
        loaded_ = true;
      }
      const int window_tiles = __shfl_sync(0xffffffffu, inclusive_, 31);
      if (tile < window_base_ + window_tiles) {
        const unsigned hit = __ballot_sync(0xffffffffu, tile < window_base_ + inclusive_);
        const int l = __ffs(hit) - 1;
        const int before = __shfl_sync(0xffffffffu, inclusive_ - count_, l);
        const std::int32_t seg_start = __shfl_sync(0xffffffffu, start_, l);
        const std::int32_t seg_end = __shfl_sync(0xffffffffu, end_, l);
        const int local = tile - window_base_ - before;
        TileCoord c;
        c.expert = window_ + l;
        // Group g holds M-tiles [g raster_m, g raster_m + gm) (gm < raster_m for the expert's last group).
        const int m_tiles = (seg_end - seg_start + kTileM - 1) / kTileM;
        const int g = local / (raster_m_ * n_tiles_);
        const int in_group = local - g * raster_m_ * n_tiles_;
        const int gm = min(raster_m_, m_tiles - g * raster_m_);
        const int n_tile = in_group / gm;
        const int m_tile = g * raster_m_ + (in_group - n_tile * gm);
        c.n_tile = n_tile;
        c.row0 = static_cast<std::int64_t>(seg_start) + static_cast<std::int64_t>(m_tile) * kTileM;
        c.rows = static_cast<int>(min(static_cast<std::int64_t>(kTileM), seg_end - c.row0));
        return c;
      }
      window_base_ += window_tiles;
      window_ += 32;
      loaded_ = false;
    }
    return TileCoord{};
  }

 private:
  const std::int32_t* offsets_;
  int E_, n_tiles_, raster_m_;
  int window_ = 0;       // first expert of the current window of 32
  int window_base_ = 0;  // tiles of the experts before the window
  bool loaded_ = false;
  int count_ = 0, inclusive_ = 0;  // this lane's expert: tiles, and tiles up to and including it in the window
  std::int32_t start_ = 0, end_ = 0;
};

/// The tile sequence of this CTA. Without clusters, tiles blockIdx.x, + gridDim.x, ... With a cluster of 2 along M,
/// the unit is a pair of M-adjacent tiles (same expert and N tile, so the weight tile is shared): cluster c takes
/// units c, c + clusters, ... and CTA rank r its tile r of each pair. The second tile of a pair can be empty
/// (rows <= 0): that CTA still runs the mainloop (its multicast half is needed) and writes nothing.
template <class Tile>
class ClusterTiles {
 public:
  using Params = VarlenMSchedulerParams;
  static constexpr int kClusterM = Tile::kClusterM;

  __device__ explicit ClusterTiles(const Params& p)
      : sched_(p.expert_offsets, p.E, p.n_tiles, p.raster_m),
        unit_(static_cast<int>(blockIdx.x) / Tile::kClusterM),
        units_(static_cast<int>(gridDim.x) / Tile::kClusterM) {
    if constexpr (Tile::kClusterM > 1) {
      std::uint32_t r;
      asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
      rank_ = r;
    }
  }
  __device__ std::uint32_t rank() const { return rank_; }
  /// Tile i of this CTA's sequence (warp-collective, i increasing).
  __device__ TileCoord get(int i) {
    TileCoord c = sched_.get(unit_ + i * units_);
    if (Tile::kClusterM > 1 && c.valid()) {
      const int skip = static_cast<int>(rank_) * Tile::kTileM;
      c.row0 += skip;
      c.rows = min(c.rows - skip, Tile::kTileM);
    }
    return c;
  }

 private:
  VarlenTileScheduler<Tile::kTileM * Tile::kClusterM> sched_;
  int unit_, units_;
  std::uint32_t rank_ = 0;
};

}  // namespace machmoe::gpu::hopper
