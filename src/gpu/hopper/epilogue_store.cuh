// The store epilogue: y = acc (+ b2) -> Y (bf16), run by the consumer warpgroup that computed the tile. The
// down-projection's epilogue (docs/SPEC.md §2.4).
#pragma once

#include "gpu/hopper/epilogue_staging.cuh"

namespace machmoe::gpu::hopper {

template <class Tile>
struct EpilogueStore {
  using Params = EpilogueStoreParams;
  using Staging = EpilogueStaging<Tile>;
  using Storage = typename Staging::Storage;

  /// Calls f(EpilogueVariant<...>{}) with the variant `p` needs.
  template <class F>
  __device__ __forceinline__ static void with_variant(const Params& p, F&& f) {
    if (p.bias.ptr != nullptr)
      f(EpilogueVariant<false, true>{});
    else
      f(EpilogueVariant<false, false>{});
  }

  /// row_base: the warpgroup's first row in the tile (cooperative: 0 or 64).
  template <class Variant, class Accumulator>
  __device__ __forceinline__ static void apply(const Params& p, Storage& st, Accumulator& acc, const TileCoord& c,
                                               int row_base, int wg_thread, int barrier_id) {
    const int quad = (wg_thread % 32) % 4;
    if constexpr (Variant::kBias) Staging::template add_bias<false>(p.bias, 0, p.N, acc, c, quad);
    const std::int64_t col0 = static_cast<std::int64_t>(c.n_tile) * Tile::kTileN;
    CUTE_UNROLL
    for (int m = 0; m < Staging::kRowAtoms; ++m) {
      const int rows = min(Staging::kRows, c.rows - row_base - m * Staging::kRows);
      if (rows <= 0) break;  // uniform across the warpgroup
      const std::int64_t g0 = c.row0 + row_base + m * Staging::kRows;
      if (p.out.ptr != nullptr) Staging::template store_tile<false>(st, p.out, acc, m, rows, g0, col0, wg_thread, barrier_id);
    }
  }
};

}  // namespace machmoe::gpu::hopper
