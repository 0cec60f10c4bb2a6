// Persistent tile scheduler over K-grouped work (varlen-K: the weight gradients).
//
// Every expert owns the same grid of m_tiles x n_tiles output tiles, whatever its number of rows: the work is that
// grid for expert 0, then expert 1, ... (E m_tiles n_tiles tiles, a count the host knows without reading the routing),
// and inside an expert the m-tiles run fastest (the m-tiles of one n-tile run side by side on neighbouring CTAs and
// share that n-tile's operand rows in L2; dW1's gathered X slice is read from HBM once for all of them). CTA b takes
// tiles b, b + grid, b + 2 grid, ...: a static persistent schedule, deterministic, no atomics. A tile's reduction
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
        tiles_per_expert_(p.m_tiles * p.n_tiles),
        total_(static_cast<std::int64_t>(p.E) * p.m_tiles * p.n_tiles),
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
    const std::int64_t t64 = static_cast<std::int64_t>(first_) + static_cast<std::int64_t>(i) * stride_;
    if (t64 >= total_) return c;
    // The work is below 2^31 tiles (the dispatcher's limit): 32-bit divisions from here.
    const int t = static_cast<int>(t64);
    const int e = t / tiles_per_expert_;
    const int local = t - e * tiles_per_expert_;
    c.expert = e;
    c.m_tile = local % p_.m_tiles;
    c.n_tile = local / p_.m_tiles;
    const std::int32_t begin = __ldg(p_.expert_offsets + e), end = __ldg(p_.expert_offsets + e + 1);
    c.k_begin = begin;
    c.k_rows = end > begin ? end - begin : 0;
    c.k_tiles = (c.k_rows + Tile::kTileK - 1) / Tile::kTileK;
    return c;
  }

  Params p_;
  int tiles_per_expert_;
  std::int64_t total_;
  int first_, stride_;
  int walked_ = 0;           // sequence tiles [0, walked_) are summed into ring_
  int last_ = -1;            // the tile the last call decoded, and its k-blocks
  int last_k_tiles_ = 0;
  std::uint32_t ring_ = 0;
};

}  // namespace machmoe::gpu::hopper
