// What every Hopper epilogue shares: the per-warpgroup swizzled staging buffer through which a tile leaves (TMA
// store of whole 64-row blocks, predicated 16-byte stores for the block cut by the end of an expert's segment, so
// a tile never writes rows of the next expert), the bias add on the accumulator, and the pass that stores the fp32
// tile itself as bf16 (Y, or H interleaved).
//
// The passes here are the warpgroup's (a named barrier before each 64-row TMA store and before the buffer's reuse);
// only the dH epilogue stages warp by warp, with its own 16-row boxes. The same warp-private staging here measured
// +2.3 % and +5.8 % ncu cycles in the down-projection (1.4B and 7B (256,128,8)) and within +-0.5 % in the
// up-projection, where the dH kernel gained 0.8-2.5 % (H200, sessions 92 and 93): these passes have too little math
// for a barrier's wait to cost more than four warps' stores and waits.
//
// WGMMA accumulator fragment (per 64-row atom): value (v0, v1, v2) of a thread holds row 8 v1 + lane / 4 (+16 per
// warp) and column 8 v2 + 2 (lane % 4) + v0. A gate/up pair is (v0 = 0, 1) of one v2 in the interleaved layout and
// (v2, v2 + kTileN / 16) in the concatenated layout (whose tile holds kTileN / 2 gate rows then the matching up
// rows), so a GLU never needs another thread's values.
//
// Edge tiles (N not a multiple of kTileN): the accumulator's columns at or past N are padding (zeros of B, see the
// mainloop). They are never written: a staged pass that starts at or past the output's valid columns is skipped
// whole, the TMA store clips at the tensor map's extent (the valid columns), and the predicated 16-byte stores skip
// chunks past it (valid columns are a multiple of 8: a chunk is wholly valid or wholly padding). The bias is read
// only for valid columns. Whole tiles meet no per-element test: only the per-pass and per-chunk comparisons, which
// always pass for them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

#include <cuda_bf16.h>

#include "gpu/hopper/async_primitives.cuh"
#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"
#include "gpu/hopper/tile_scheduler.cuh"

namespace machmoe::gpu::hopper {

/// A compile-time epilogue variant, chosen once per kernel outside the persistent loop (every variant inlined):
/// kConcat, the tile holds the concatenated layout's gate columns then up columns; kBias, add the bias.
template <bool kConcat_, bool kBias_>
struct EpilogueVariant {
  static constexpr bool kConcat = kConcat_;
  static constexpr bool kBias = kBias_;
};

template <class Tile>
struct EpilogueStaging {
  static constexpr int kTileN = Tile::kTileN;
  static constexpr int kRows = 64;  // one WGMMA atom of rows
  // Row atoms of one warpgroup: ping-pong, the whole 128-row tile; cooperative, its own 64-row half.
  static constexpr int kRowAtoms = TileTraits<Tile>::kCooperative ? 1 : Tile::kTileM / kRows;
  // The staging buffer holds 64 rows x kStageCols columns (Tile::kEpilogueStageCols: 128, or 64 for the dH kernel's
  // wide tile) as 64 x 64 blocks in TMA's 128-byte-swizzled layout: a
  // whole 64-row block leaves by TMA store (asynchronous: the warpgroup goes on to its next mainloop while the
  // copy engine drains it); a block cut by the end of the expert's segment leaves by predicated 16-byte stores.
  // The outputs of one tile take turns in it; the fp32 values stay in registers in between.
  static constexpr int kStageCols = Tile::kEpilogueStageCols;
  static_assert(kStageCols == 64 || kStageCols == 128, "one or two 64-column swizzle blocks");
  static constexpr int kBlockElems = kRows * 64;

  struct Storage {  // per consumer warpgroup; 1024-byte aligned (swizzle atoms)
    alignas(1024) __nv_bfloat16 staged[kRows * kStageCols];
  };

  /// Element index of (row, column) in the swizzled staging buffer (16-byte chunk index XOR row % 8).
  __device__ __forceinline__ static int staged_index(int r, int col) {
    return (col >> 6) * kBlockElems + tma_swizzle128_bf16_offset(r, col & 63);
  }

  /// Waits until the buffer is free: the previous TMA store has read it, and every thread is done with it.
  __device__ __forceinline__ static void acquire(int wg_thread, int barrier_id) {
    if (wg_thread == 0) bulk_wait_group_read0();
    named_barrier_sync(barrier_id, 128);
  }

  /// Sends `cols` staged columns of `rows` rows to (row g0, column c0) of `out`: TMA when the block is whole,
  /// predicated 16-byte stores otherwise. Columns at or past out.cols (an edge tile's padding) are not written: the
  /// TMA store clips at the map's extent (64-column blocks wholly past it are not issued), the predicated stores
  /// skip those chunks.
  __device__ __forceinline__ static void release(const Storage& st, const EpilogueOutput& out, int cols, int rows,
                                                 std::int64_t g0, std::int64_t c0, int wg_thread, int barrier_id) {
    fence_proxy_async_shared();  // the fragments written with st.shared, made visible to the copy engine
    named_barrier_sync(barrier_id, 128);
    if (rows == kRows) {
      if (wg_thread == 0) {
        for (int b = 0; b < cols / 64; ++b)
          if (c0 + 64 * b < out.cols)
            tma_store_2d(&out.tma, st.staged + b * kBlockElems, static_cast<int>(c0) + 64 * b, static_cast<int>(g0));
        bulk_commit_group();
      }
      return;
    }
    const int chunks_per_row = cols / 8;
    const int total = kRows * chunks_per_row;
    // Valid columns of this pass (cols for a whole tile): the per-chunk test below always passes there.
    const std::int64_t valid = out.cols - c0;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(out.ptr) + g0 * out.ld + c0;
    for (int i = wg_thread; i < total; i += 128) {
      const int r = i / chunks_per_row, ch = i - r * chunks_per_row;
      if (r < rows && ch * 8 < valid) {
        const uint4 v = *reinterpret_cast<const uint4*>(st.staged + staged_index(r, ch * 8));
        *reinterpret_cast<uint4*>(dst + static_cast<std::int64_t>(r) * out.ld + ch * 8) = v;
      }
    }
  }

  __device__ __forceinline__ static void put2(Storage& st, int r, int col, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(&st.staged[staged_index(r, col)]) = __floats2bfloat162_rn(a, b);
  }

  /// The bias, added once in place (a column's bias serves both rows of a fragment pair; the next tile's first
  /// WGMMA overwrites the accumulator). Tile column -> the weights' own row order (concatenated: gate j or up j).
  /// N: the accumulator's valid columns (2n or n); an edge tile reads no bias past them (its padded columns get 0).
  template <bool kConcat, class Accumulator>
  __device__ __forceinline__ static void add_bias(const EpilogueBias& bias, int glu_n, int N, Accumulator& acc,
                                                  const TileCoord& c, int quad) {
    using namespace cute;
    constexpr int kHalfBlocks = kTileN / 16;  // concatenated: the up of v2 is v2 + kHalfBlocks
    const std::int64_t col0 = static_cast<std::int64_t>(c.n_tile) * kTileN;
    const std::int64_t act_col0 = static_cast<std::int64_t>(c.n_tile) * (kTileN / 2);
    const bool edge = col0 + kTileN > N;  // uniform: whole tiles skip the per-column test
    const __nv_bfloat16* b_row = static_cast<const __nv_bfloat16*>(bias.ptr);
    CUTE_UNROLL
    for (int v2 = 0; v2 < kTileN / 8; ++v2) {
      CUTE_UNROLL
      for (int v0 = 0; v0 < 2; ++v0) {
        const int tile_col = v2 * 8 + quad * 2 + v0;
        std::int64_t bcol = col0 + tile_col;
        // Concatenated: the column's A index j (gate or up of the same j) must be below n; else below N.
        bool ok = !edge || bcol < N;
        if constexpr (kConcat) {
          const std::int64_t j = act_col0 + (v2 < kHalfBlocks ? tile_col : tile_col - kTileN / 2);
          bcol = v2 < kHalfBlocks ? j : glu_n + j;
          ok = !edge || j < glu_n;
        }
        const float b = ok ? __bfloat162float(b_row[static_cast<std::int64_t>(c.expert) * bias.ld + bcol]) : 0.0f;
        CUTE_UNROLL
        for (int m = 0; m < kRowAtoms; ++m) {
          acc(make_coord(make_coord(v0, 0, v2), m, 0)) += b;
          acc(make_coord(make_coord(v0, 1, v2), m, 0)) += b;
        }
      }
    }
  }

  /// Stores row atom m of the fp32 tile as bf16 columns [col0, col0 + kTileN) of `out`, in passes of kStageCols
  /// columns. kConcat: the tile's gate/up halves are re-interleaved (H is always stored interleaved).
  template <bool kConcat, class Accumulator>
  __device__ __forceinline__ static void store_tile(Storage& st, const EpilogueOutput& out, Accumulator& acc, int m,
                                                    int rows, std::int64_t g0, std::int64_t col0, int wg_thread,
                                                    int barrier_id) {
    using namespace cute;
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    const int quad = lane % 4, row_in_warp = lane / 4;
    constexpr int kHalfBlocks = kTileN / 16;
    auto value = [&](int v0, int v1, int v2) __attribute__((always_inline)) -> float {
      return acc(make_coord(make_coord(v0, v1, v2), m, 0));
    };
    CUTE_UNROLL
    for (int pass = 0; pass < kTileN / kStageCols; ++pass) {
      if (col0 + pass * kStageCols >= out.cols) break;  // an edge tile's all-padding pass (uniform)
      acquire(wg_thread, barrier_id);
      CUTE_UNROLL
      for (int v2 = 0; v2 < kTileN / 8; ++v2) {
        CUTE_UNROLL
        for (int v1 = 0; v1 < 2; ++v1) {
          const int r = warp * 16 + v1 * 8 + row_in_warp, col = v2 * 8 + quad * 2;
          if constexpr (kConcat) {
            // gate j, j+1 with up j, j+1 -> H columns 2j .. 2j+3 (2j in [16 v2, 16 v2 + 16))
            if (v2 < kHalfBlocks && (16 * v2) / kStageCols == pass) {
              const int hc = 2 * col - pass * kStageCols;
              put2(st, r, hc, value(0, v1, v2), value(0, v1, v2 + kHalfBlocks));
              put2(st, r, hc + 2, value(1, v1, v2), value(1, v1, v2 + kHalfBlocks));
            }
          } else {
            if ((8 * v2) / kStageCols == pass) put2(st, r, col - pass * kStageCols, value(0, v1, v2), value(1, v1, v2));
          }
        }
      }
      release(st, out, kStageCols, rows, g0, col0 + pass * kStageCols, wg_thread, barrier_id);
    }
  }
};

}  // namespace machmoe::gpu::hopper
