// The activation epilogue of the up-projection (docs/SPEC.md §2.3), run by the consumer warpgroup that computed
// the tile: h = acc + b1 -> H (bf16, always gate/up-interleaved; skipped in inference) and A = act(h) (bf16),
// both from the same fp32 values. The activation is compiled in: a run-time switch per accumulator value made the
// unrolled epilogue large enough to thrash the instruction cache (measured: 4x slower up-projection).
#pragma once

#include "gpu/hopper/epilogue_staging.cuh"
#include "gpu/hopper/fast_math.cuh"

namespace machmoe::gpu::hopper {

template <class Tile, Activation kAct>
struct EpilogueActivation {
  using Params = EpilogueActivationParams;
  using Staging = EpilogueStaging<Tile>;
  using Storage = typename Staging::Storage;
  static constexpr int kTileN = Tile::kTileN;
  static constexpr bool kGlu = math::is_glu_activation(kAct);
  static constexpr int kActCols = kGlu ? kTileN / 2 : kTileN;  // A columns of a tile

  /// Calls f(EpilogueVariant<...>{}) with the variant `p` needs (only GLU tiles can be concatenated).
  template <class F>
  __device__ __forceinline__ static void with_variant(const Params& p, F&& f) {
    const bool concat = kGlu && p.concatenated;
    if (concat && p.bias.ptr != nullptr)
      f(EpilogueVariant<kGlu, true>{});
    else if (concat)
      f(EpilogueVariant<kGlu, false>{});
    else if (p.bias.ptr != nullptr)
      f(EpilogueVariant<false, true>{});
    else
      f(EpilogueVariant<false, false>{});
  }

  /// row_base: the warpgroup's first row in the tile (cooperative: 0 or 64).
  template <class Variant, class Accumulator>
  __device__ __forceinline__ static void apply(const Params& p, Storage& st, Accumulator& acc, const TileCoord& c,
                                               int row_base, int wg_thread, int barrier_id) {
    using namespace cute;
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    const int quad = lane % 4, row_in_warp = lane / 4;
    constexpr bool concat = kGlu && Variant::kConcat;
    constexpr int kHalfBlocks = kTileN / 16;  // concatenated: the up of v2 is v2 + kHalfBlocks
    // The tile's first output column: H column n_tile * kTileN; A column n_tile * kActCols.
    const std::int64_t col0 = static_cast<std::int64_t>(c.n_tile) * kTileN;
    const std::int64_t act_col0 = static_cast<std::int64_t>(c.n_tile) * kActCols;
    if constexpr (Variant::kBias) Staging::template add_bias<concat>(p.bias, p.glu_n, p.N, acc, c, quad);
    const math::ActParams<float> ap{p.act_alpha, p.act_limit};  // read only by gptoss_swiglu

    CUTE_UNROLL
    for (int m = 0; m < Staging::kRowAtoms; ++m) {
      const int rows = min(Staging::kRows, c.rows - row_base - m * Staging::kRows);
      if (rows <= 0) break;  // uniform across the warpgroup
      const std::int64_t g0 = c.row0 + row_base + m * Staging::kRows;
      if (p.h.ptr != nullptr) Staging::template store_tile<concat>(st, p.h, acc, m, rows, g0, col0, wg_thread, barrier_id);
      if (p.a.ptr != nullptr) {  // A from the same fp32 values
        auto value = [&](int v0, int v1, int v2) __attribute__((always_inline)) -> float {
          return acc(make_coord(make_coord(v0, v1, v2), m, 0));
        };
        constexpr int kPassCols = kActCols < Staging::kStageCols ? kActCols : Staging::kStageCols;
        CUTE_UNROLL
        for (int pass = 0; pass < kActCols / kPassCols; ++pass) {
          if (act_col0 + pass * kPassCols >= p.a.cols) break;  // an edge tile's all-padding pass (uniform)
          Staging::acquire(wg_thread, barrier_id);
          CUTE_UNROLL
          for (int v2 = 0; v2 < kTileN / 8; ++v2) {
            CUTE_UNROLL
            for (int v1 = 0; v1 < 2; ++v1) {
              const int r = warp * 16 + v1 * 8 + row_in_warp, col = v2 * 8 + quad * 2;
              if constexpr (concat) {  // A columns j, j+1 = col, col + 1
                if (v2 < kHalfBlocks && (8 * v2) / kPassCols == pass)
                  Staging::put2(st, r, col - pass * kPassCols,
                                fast_glu<kAct>(value(0, v1, v2), value(0, v1, v2 + kHalfBlocks), ap),
                                fast_glu<kAct>(value(1, v1, v2), value(1, v1, v2 + kHalfBlocks), ap));
              } else if constexpr (kGlu) {  // A column col / 2 = 4 v2 + quad
                if ((4 * v2) / kPassCols == pass)
                  st.staged[Staging::staged_index(r, col / 2 - pass * kPassCols)] =
                      __float2bfloat16_rn(fast_glu<kAct>(value(0, v1, v2), value(1, v1, v2), ap));
              } else {
                if ((8 * v2) / kPassCols == pass)
                  Staging::put2(st, r, col - pass * kPassCols, fast_activation<kAct>(value(0, v1, v2)),
                                fast_activation<kAct>(value(1, v1, v2)));
              }
            }
          }
          Staging::release(st, p.a, kPassCols, rows, g0, act_col0 + pass * kPassCols, wg_thread, barrier_id);
        }
      }
    }
  }
};

}  // namespace machmoe::gpu::hopper
