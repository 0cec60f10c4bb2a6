// What the two mainloops (varlen-M, varlen-K) share: the shared-memory ring of kStages stages, each an A tile
// (kTileM x kTileK) and a B tile (kTileN x kTileK) with a "full" and an "empty" mbarrier, and the consumers' WGMMA
// tiling. The stages' layouts (K- or MN-major swizzle), the barriers' arrival counts and who fills the stages are
// each mainloop's own.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

#include "gpu/hopper/tile_config.hpp"

namespace machmoe::gpu::hopper {

template <class Tile, class Element>
struct StageRing {
  static constexpr int kStages = Tile::kStages;

  struct Tiles {  // 1024-byte aligned (128-byte swizzle atoms); sizes are multiples of 1024
    alignas(1024) Element a[kStages][Tile::kTileM * Tile::kTileK];
    alignas(1024) Element b[kStages][Tile::kTileN * Tile::kTileK];
  };
  struct Barriers {
    std::uint64_t full[kStages];
    std::uint64_t empty[kStages];
  };
  /// The ring as the producer and the consumers see it.
  struct Storage {
    Tiles& t;
    Barriers& bar;
  };
};

/// The consumers' WGMMA tiling of a 64-row atom: ping-pong, one warpgroup covers the 128-row tile with two atoms;
/// cooperative, two warpgroups side by side along M, 64 rows each.
template <class Tile, class MmaAtom>
using ConsumerTiledMma = decltype(cute::make_tiled_mma(
    MmaAtom{}, cute::Layout<cute::Shape<cute::Int<TileTraits<Tile>::kCooperative ? 2 : 1>, cute::_1, cute::_1>>{}));

}  // namespace machmoe::gpu::hopper
