// What the two mainloops (varlen-M, varlen-K) share: the shared-memory ring of kStages stages, each an A tile
// (kTileM x kTileK) and a B tile (kTileN x kTileK) with a "full" and an "empty" mbarrier, the consumers' WGMMA
// tiling, and the consumers' loop over a tile's k-blocks. The stages' layouts (K- or MN-major swizzle), the
// barriers' arrival counts, who fills the stages and how a drained stage is handed back are each mainloop's own.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

#include "gpu/hopper/async_primitives.cuh"
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

/// The consumers' loop over a tile's k-blocks: k-block kb sits at ring position iter + kb. For each, wait for its
/// stage to fill, issue its WGMMAs into `acc` (the first one zeroes it), and once the previous k-block's WGMMAs are
/// done hand that one's stage back by release(stage). `on_first_issue` runs (on every thread) once the first
/// k-block's WGMMAs are issued, `on_last_wait` once the last k-block's stage has arrived. Returns with every WGMMA
/// done and the last k-block's stage not yet handed back: its index, or -1 without k-blocks.
template <int kStages, class TiledMma, class FragmentA, class FragmentB, class Accumulator, class Release,
          class OnFirstIssue, class OnLastWait>
__device__ __forceinline__ int consume_k_blocks(TiledMma& mma, FragmentA& tCrA, FragmentB& tCrB, Accumulator& acc,
                                                std::uint64_t* full, std::uint32_t iter, int k_tiles, Release&& release,
                                                OnFirstIssue&& on_first_issue, OnLastWait&& on_last_wait) {
  using namespace cute;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  int previous_stage = -1;
  for (int kb = 0; kb < k_tiles; ++kb, ++iter) {
    const int stage = static_cast<int>(iter % kStages);
    mbar_wait(&full[stage], (iter / kStages) & 1u, WaitSite::kConsumerFull, iter);
    // No proxy fence for cp.async-written operands: the mbarrier completion orders the copies before the WGMMA reads
    // (as CUTLASS's SM90 cp.async + GMMA warp-specialised mainloops rely on).
    if (kb == k_tiles - 1) on_last_wait();
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      cute::gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if (kb == 0) on_first_issue();
    warpgroup_wait<1>();  // the previous k-block's WGMMAs are done: its stage can be refilled
    warpgroup_fence_operand(acc);
    if (previous_stage >= 0) release(previous_stage);
    previous_stage = stage;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  return previous_stage;
}

}  // namespace machmoe::gpu::hopper
