// Persistent tile scheduler over K-grouped work (varlen-K: the weight gradients).
//
// Every expert owns the same grid of m_tiles x n_tiles output tiles, whatever its number of rows: the work is that
// grid for expert 0, then expert 1, ... (E m_tiles n_tiles tiles, a count the host knows without reading the routing),
// and inside an expert the m-tiles run fastest (the m-tiles of one n-tile run side by side on neighbouring CTAs and
// share that n-tile's operand rows in L2; dW1's gathered X slice is read from HBM once for all of them). The work is
// cut into units of m_group consecutive m-tiles of one (expert, n-tile); CTA b takes units b, b + grid, b + 2 grid,
// ..., each unit's tiles back to back: a static persistent schedule, deterministic, no atomics. With m_group = 1 that
// is tiles b, b + grid, ...; with more, a CTA's consecutive tiles share their B operand (the n-tile's rows), which the
// mainloop then need not load again where an expert's segment is short (mainloop_varlen_k.cuh). A tile's reduction
// length, its expert's segment f_e = off[e+1] - off[e], is read on the device when the tile is decoded (no host
// synchronisation); it is ceil(f_e / 64) k-blocks of the ring and may be zero: the tile still belongs to its CTA,
// which writes zeros (or, accumulating, leaves the output as it is).
//
// The ring position of a tile's first k-block is the number of k-blocks of the tiles before it in this CTA's
// sequence. Every user of the scheduler (the producer, each consumer warpgroup) walks the sequence in increasing
// order and sums them; a ping-pong consumer that takes every other tile still walks the ones in between.
#pragma once

#include <cstdint>

#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"

namespace machmoe::gpu::hopper {

struct VarlenKTileCoord {
  int expert = -1;  // -1: past the last tile
  int m_tile = 0, n_tile = 0;
  std::int64_t k_begin = 0;  // first grouped row of the expert's segment
  int k_rows = 0;            // rows of the segment (0: an expert without rows)
  int k_tiles = 0;           // ceil(k_rows / kTileK): k-blocks on the ring
  std::uint32_t ring = 0;    // ring position of the first k-block
  __device__ bool valid() const { return expert >= 0; }
};

template <class Tile>
class VarlenKTiles {
 public:
  using Params = VarlenKSchedulerParams;
  static constexpr int kClusterM = Tile::kClusterM;
  static_assert(Tile::kClusterM == 1, "varlen-K: no clusters yet");

  __device__ explicit VarlenKTiles(const Params& p)
      : p_(p),
        m_units_(p.m_tiles / p.m_group),
        units_per_expert_(m_units_ * p.n_tiles),
        total_units_(static_cast<std::int64_t>(p.E) * m_units_ * p.n_tiles),
        first_(static_cast<int>(blockIdx.x)),
        stride_(static_cast<int>(gridDim.x)) {}

  __device__ std::uint32_t rank() const { return 0; }

  /// Tile i of this CTA's sequence; i must not decrease between calls (the walk only goes forward).
  __device__ VarlenKTileCoord get(int i) {
    while (walked_ < i) {  // the k-blocks of the tiles before i: the caller's previous tile (decoded last time)
      int k_tiles;         // and those it skips (the other consumer's, in ping-pong)
      if (walked_ == last_) {
        k_tiles = last_k_tiles_;
      } else {
        const VarlenKTileCoord skipped = decode(walked_);
        if (!skipped.valid()) break;
        k_tiles = skipped.k_tiles;
      }
      ring_ += static_cast<std::uint32_t>(k_tiles);
      ++walked_;
    }
    VarlenKTileCoord c = decode(i);
    c.ring = ring_;
    last_ = i, last_k_tiles_ = c.k_tiles;
    return c;
  }

 private:
  __device__ VarlenKTileCoord decode(int i) const {
    VarlenKTileCoord c;
    const int group = i / p_.m_group, in_group = i - group * p_.m_group;
    const std::int64_t u64 = static_cast<std::int64_t>(first_) + static_cast<std::int64_t>(group) * stride_;
    if (u64 >= total_units_) return c;
    // The work is below 2^31 tiles (the dispatcher's limit): 32-bit divisions from here.
    const int u = static_cast<int>(u64);
    const int e = u / units_per_expert_;
    const int local = u - e * units_per_expert_;
    c.expert = e;
    c.m_tile = (local % m_units_) * p_.m_group + in_group;
    c.n_tile = local / m_units_;
    const std::int32_t begin = __ldg(p_.expert_offsets + e), end = __ldg(p_.expert_offsets + e + 1);
    c.k_begin = begin;
    c.k_rows = end > begin ? end - begin : 0;
    c.k_tiles = (c.k_rows + Tile::kTileK - 1) / Tile::kTileK;
    return c;
  }

  Params p_;
  int m_units_;           // units of m_group m-tiles per n-tile
  int units_per_expert_;  // m_units_ x n_tiles
  std::int64_t total_units_;
  int first_, stride_;
  int walked_ = 0;           // sequence tiles [0, walked_) are summed into ring_
  int last_ = -1;            // the tile the last call decoded, and its k-blocks
  int last_k_tiles_ = 0;
  std::uint32_t ring_ = 0;
};

}  // namespace machmoe::gpu::hopper
