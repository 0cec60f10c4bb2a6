// The weight-gradient epilogue (dW1, dW2), run by the consumer warpgroup(s) that computed the tile: the fp32 tile
// leaves as bf16 or fp32, overwriting the gradient or added into it (out = out + C, read-modify-write; each output
// element belongs to exactly one tile and one thread, so the result is deterministic), with the concatenated GLU
// row map for dW1 (glu_concat_n > 0: tile row m is row m / 2 of the gradient's half m % 2, glu_half_stride apart).
//
// Path: the accumulator fragments go to a per-warpgroup staging buffer of 16 KiB (16-byte chunks XOR-swizzled by
// row so that both the fragment writes and the row reads are free of bank conflicts), then every thread moves whole
// 16-byte chunks of rows to global memory. A bf16 overwrite stages bf16, 64 rows x 128 columns per pass (a warp
// writes 2 rows x 128 columns, whole 256-byte runs); an fp32 output or an accumulation stages fp32, 64 x 64 per pass
// (bf16 accumulation must round C + old once, not C first). Accumulating, the destination chunks are loaded before
// the fragments are staged, so their latency hides behind the staging and the barrier. A row map or an edge
// predicate is a per-row / per-chunk condition of that pass, no more: edge tiles (M or N not a tile multiple, both
// multiples of 8) store only rows below M (tested before the row map, which would otherwise send a padded row onto
// a valid one) and chunks below N, and skip a pass wholly past N; whole tiles pass every test.
//
// The bf16 overwrite (the common case) leaves by TMA store instead: the same 16 KiB per warpgroup as two 64 x 64
// blocks in TMA's 128-byte-swizzled layout, used in turn (the fragments of one block are staged while the copy
// engine reads the other), one store per block into a 3D map (columns, rows of one expert, expert) that clips rows
// past M and columns past N, so edge tiles need no test. With the concatenated row map a block's 32 even (gate)
// rows are staged above its 32 odd (up) rows and leave as two 32-row boxes of a 4D map (columns, row of the half,
// half, expert) that clips at n. The consumers do not wait for the stores: they go on to their next tile's
// mainloop, which on short segments (a few k-blocks per tile) is where the register-to-global path above left the
// tensor cores idle. The accumulate mode (it reads the destination) and fp32 output keep the path above.
//
// The cooperative tile borrows 16 KiB per warpgroup of the tile's last ring stage (EpilogueWgradParams::borrow_stage,
// kernel.cuh's BorrowsStage): the mainloop does not release that stage, the warpgroup stages its whole 64 x 256
// share at once (two blocks in its own buffer, two in the stage: the A tile for the first warpgroup, half the B tile
// for the second, written once both warpgroups' WGMMAs are done with it) and sends it after one fence and one
// barrier, where its own 16 KiB alone take four rounds of fence, wait and barrier; the stage goes back to the
// producer once the stores have read it, after the next tile's first WGMMAs are issued. The ring keeps its four
// stages. (A 3-stage ring with 32 KiB buffers did the same in one round and lost the stage: slower where segments are
// short; docs/BENCHMARKS.md, session 74.) Not with groups of m-tiles, whose tiles keep B on the ring.
//
// WGMMA accumulator fragment (per 64-row atom): value (v0, v1, v2) of a thread holds row 8 v1 + lane / 4 (+16 per
// warp) and column 8 v2 + 2 (lane % 4) + v0 (epilogue_staging.cuh).
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include "gpu/hopper/async_primitives.cuh"
#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"
#include "gpu/hopper/tile_scheduler_varlen_k.cuh"

namespace machmoe::gpu::hopper {

/// Compile-time variant of the weight-gradient epilogue, chosen once per kernel outside the persistent loop.
template <bool kFp32_, bool kAccumulate_, bool kTma_ = false, bool kConcat_ = false, bool kBorrowStage_ = false>
struct EpilogueWgradVariant {
  static constexpr bool kFp32 = kFp32_;          // fp32 output (else bf16)
  static constexpr bool kAccumulate = kAccumulate_;  // out += C
  static constexpr bool kTma = kTma_;            // bf16 overwrite by TMA store
  static constexpr bool kConcat = kConcat_;      // (TMA path) the concatenated GLU row map
  static constexpr bool kBorrowStage = kBorrowStage_;  // (TMA path) also staged into the tile's last ring stage
  static_assert(!kTma || (!kFp32 && !kAccumulate), "the TMA store path is the bf16 overwrite");
  static_assert(!kBorrowStage || kTma, "the borrowed stage holds TMA blocks");
  static_assert(kTma || !kConcat, "the register path reads the row map at run time");
};

template <class Tile>
struct EpilogueWgrad {
  using Params = EpilogueWgradParams;
  static constexpr int kTileM = Tile::kTileM, kTileN = Tile::kTileN;
  static constexpr int kRows = 64;  // one WGMMA atom of rows
  // Row atoms of one warpgroup: ping-pong, the whole 128-row tile; cooperative, its own 64-row half.
  static constexpr int kRowAtoms = TileTraits<Tile>::kCooperative ? 1 : kTileM / kRows;
  static constexpr int kStagedBytes = 16 * 1024;                  // per consumer warpgroup
  static constexpr int kChunksPerRow = 16;                         // 16-byte chunks of a staged row
  static constexpr int kChunksPerThread = kRows * kChunksPerRow / 128;  // 8

  /// The staging of a variant: the fp32 tile (64 x 64 per pass) where the output is fp32 or is added to (the sum is
  /// rounded once, as fp32 C + old), else bf16 (64 x 128 per pass: the bf16 overwrite rounds C once either way, and
  /// half the passes halve the epilogue's shared-memory reads, global stores and barriers).
  template <class Variant>
  struct Staged {
    static constexpr bool kBf16 = !Variant::kFp32 && !Variant::kAccumulate;
    using Element = std::conditional_t<kBf16, __nv_bfloat16, float>;
    static constexpr int kChunkValues = 16 / static_cast<int>(sizeof(Element));  // 4 fp32 or 8 bf16
    static constexpr int kPassCols = kChunksPerRow * kChunkValues;                // 64 or 128
    static_assert(kTileN % kPassCols == 0, "whole passes");
    static_assert(kRows * kPassCols * static_cast<int>(sizeof(Element)) == kStagedBytes, "one pass fills the buffer");
    /// Element index of (row, column): 16-byte chunk (column / kChunkValues) XOR row % 8 (the fragment writes and the
    /// row reads are free of bank conflicts).
    __device__ __forceinline__ static int index(int r, int col) {
      return r * kPassCols + (((col / kChunkValues) ^ (r & 7)) * kChunkValues) + col % kChunkValues;
    }
  };

  struct Storage {  // per consumer warpgroup: one pass of the tile (16 KiB), fp32 or bf16 by variant
    alignas(1024) unsigned char staged[kStagedBytes];  // 1024: the TMA path's swizzle atoms
  };

  template <class F>
  __device__ __forceinline__ static void with_variant(const Params& p, F&& f) {
    if constexpr (TileTraits<Tile>::kCooperative) {
      if (p.tma_store && p.borrow_stage) {  // the host sets borrow_stage for the cooperative tile only
        if (p.glu_concat_n > 0)
          f(EpilogueWgradVariant<false, false, true, true, true>{});
        else
          f(EpilogueWgradVariant<false, false, true, false, true>{});
        return;
      }
    }
    if (p.tma_store) {  // the host sets it only for a bf16 overwrite
      if (p.glu_concat_n > 0)
        f(EpilogueWgradVariant<false, false, true, true>{});
      else
        f(EpilogueWgradVariant<false, false, true, false>{});
    } else if (p.out_fp32) {
      if (p.accumulate)
        f(EpilogueWgradVariant<true, true>{});
      else
        f(EpilogueWgradVariant<true, false>{});
    } else {
      if (p.accumulate)
        f(EpilogueWgradVariant<false, true>{});
      else
        f(EpilogueWgradVariant<false, false>{});
    }
  }

  /// Four consecutive output values at `dst` (16-byte aligned for fp32, 8-byte for bf16).
  template <bool kFp32>
  __device__ __forceinline__ static float4 load4(const void* dst) {
    if constexpr (kFp32) {
      return *static_cast<const float4*>(dst);
    } else {
      const uint2 raw = *static_cast<const uint2*>(dst);
      const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
      const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
      const float2 l = __bfloat1622float2(lo), h = __bfloat1622float2(hi);
      return make_float4(l.x, l.y, h.x, h.y);
    }
  }
  template <bool kFp32>
  __device__ __forceinline__ static void store4(void* dst, float4 v) {
    if constexpr (kFp32) {
      *static_cast<float4*>(dst) = v;
    } else {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      uint2 raw;
      raw.x = *reinterpret_cast<const std::uint32_t*>(&lo);
      raw.y = *reinterpret_cast<const std::uint32_t*>(&hi);
      *static_cast<uint2*>(dst) = raw;
    }
  }

  /// Stages 64-column block b of row atom m of the accumulator as bf16 in TMA's 128-byte-swizzled 64 x 64 layout:
  /// write(element offset in the block, value pair) for each of the thread's pairs. kConcat: tile row 2 i (gate i)
  /// goes to staged row i, 2 i + 1 (up i) to 32 + i (a 32-row box starts 4 KiB in: the same swizzle pattern).
  /// empty: the tile had no k-block, so zeros (see apply).
  template <bool kConcat, class Accumulator, class Write>
  __device__ __forceinline__ static void stage_block(Accumulator& acc, int m, int b, bool empty, int wg_thread,
                                                     Write&& write) {
    using namespace cute;
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    const int quad = lane % 4, row_in_warp = lane / 4;
    CUTE_UNROLL
    for (int v2 = b * 8; v2 < b * 8 + 8; ++v2) {
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int tile_r = warp * 16 + v1 * 8 + row_in_warp, col = (v2 - b * 8) * 8 + quad * 2;
        const int r = kConcat ? (tile_r & 1) * 32 + (tile_r >> 1) : tile_r;
        const float x0 = empty ? 0.0f : acc(make_coord(make_coord(0, v1, v2), m, 0));
        const float x1 = empty ? 0.0f : acc(make_coord(make_coord(1, v1, v2), m, 0));
        write(tma_swizzle128_bf16_offset(r, col), __floats2bfloat162_rn(x0, x1));
      }
    }
  }

  /// The TMA store path with 16 KiB of the tile's last ring stage borrowed (cooperative tile, a tile with k-blocks:
  /// apply): the warpgroup's four 64 x 64 blocks staged at once, blocks 0 and 1 in its own buffer, 2 and 3 in the
  /// borrowed memory once both warpgroups' WGMMAs are done reading that stage, then one fence, one barrier and four
  /// stores.
  template <bool kConcat, class Accumulator>
  __device__ __forceinline__ static void store_tma_borrowed(const Params& p, Storage& st, Accumulator& acc,
                                                            const VarlenKTileCoord& c, int row_base, int wg_thread,
                                                            int barrier_id, std::uint32_t borrowed) {
    static_assert(kRowAtoms == 1 && kTileN == 256, "the cooperative 128 x 256 tile: four 64 x 64 blocks a warpgroup");
    constexpr int kBlockElems = kRows * 64;
    const int n_valid = p.N - c.n_tile * kTileN;
    auto* own = reinterpret_cast<__nv_bfloat16*>(st.staged);
    if (wg_thread == 0) bulk_wait_group_read0();  // the own buffer: the previous tile's stores have read it
    named_barrier_sync(barrier_id, 128);
    const int row = c.m_tile * kTileM + row_base;
    CUTE_UNROLL
    for (int b = 0; b < 4; ++b) {
      if (b * 64 >= n_valid) break;  // uniform across both warpgroups (same tile)
      // Both warpgroups' WGMMAs have read the stage before either writes into it.
      if (b == 2) named_barrier_sync(static_cast<int>(NamedBarrier::kConsumersDone), 256);
      stage_block<kConcat>(acc, 0, b, /*empty=*/false, wg_thread, [&](int offset, __nv_bfloat162 pair) {
        offset += (b % 2) * kBlockElems;
        if (b < 2)
          *reinterpret_cast<__nv_bfloat162*>(&own[offset]) = pair;
        else
          st_shared_u32(borrowed + 2 * offset, *reinterpret_cast<const std::uint32_t*>(&pair));
      });
    }
    fence_proxy_async_shared();  // the st.shared writes, visible to the copy engine
    named_barrier_sync(barrier_id, 128);
    if (wg_thread == 0) {
      CUTE_UNROLL
      for (int b = 0; b < 4; ++b) {
        if (b * 64 >= n_valid) break;
        const std::uint32_t buf = (b < 2 ? smem_u32(own) : borrowed) + (b % 2) * kBlockElems * 2;
        const int col0 = c.n_tile * kTileN + b * 64;
        if constexpr (kConcat) {
          tma_store_4d(&p.tma_out, buf, col0, row / 2, 0, c.expert);
          tma_store_4d(&p.tma_out, buf + 32 * 64 * 2, col0, row / 2, 1, c.expert);
        } else {
          tma_store_3d(&p.tma_out, buf, col0, row, c.expert);
        }
      }
      bulk_commit_group();
    }
  }

  /// The TMA store path (bf16 overwrite): blocks of 64 rows x 64 columns, staged alternately into the two halves of
  /// the warpgroup's buffer, each sent by TMA stores of warpgroup thread 0 (kConcat: gate rows and up rows apart).
  template <bool kConcat, class Accumulator>
  __device__ __forceinline__ static void store_tma(const Params& p, Storage& st, Accumulator& acc,
                                                   const VarlenKTileCoord& c, int row_base, int wg_thread,
                                                   int barrier_id) {
    constexpr int kBlockElems = kRows * 64;  // one 64 x 64 bf16 block: 8 KiB, half the buffer
    auto* staged = reinterpret_cast<__nv_bfloat16*>(st.staged);
    const bool empty = c.k_tiles == 0;  // no k-block: zeros (see apply)
    const int n_valid = p.N - c.n_tile * kTileN;
    // The buffer is free once this thread's earlier stores have read it (thread 0 issued them all) and every thread
    // of the warpgroup knows it: the previous tile's last block left long ago, so this rarely waits.
    if (wg_thread == 0) bulk_wait_group_read0();
    named_barrier_sync(barrier_id, 128);
    int block = 0;  // blocks staged in this call: block % 2 is the half of the buffer
    CUTE_UNROLL
    for (int m = 0; m < kRowAtoms; ++m) {
      const int row = c.m_tile * kTileM + row_base + m * kRows;  // the block's first row in the expert (< 2^30)
      CUTE_UNROLL
      for (int b = 0; b < kTileN / 64; ++b, ++block) {
        if (b * 64 >= n_valid) break;  // an edge tile's all-padding block (uniform across the warpgroup)
        __nv_bfloat16* buf = staged + (block % 2) * kBlockElems;
        stage_block<kConcat>(acc, m, b, empty, wg_thread, [&](int offset, __nv_bfloat162 pair) {
          *reinterpret_cast<__nv_bfloat162*>(&buf[offset]) = pair;
        });
        fence_proxy_async_shared();  // the st.shared writes, visible to the copy engine
        // Thread 0 waits for the store that read the other half (the previous block's) before the barrier, so that
        // after it every thread may stage the next block there.
        if (wg_thread == 0) bulk_wait_group_read0();
        named_barrier_sync(barrier_id, 128);
        if (wg_thread == 0) {
          const int col0 = c.n_tile * kTileN + b * 64;
          if constexpr (kConcat) {  // tile rows [row, row + 64) hold gate and up rows [row / 2, row / 2 + 32)
            tma_store_4d(&p.tma_out, buf, col0, row / 2, 0, c.expert);
            tma_store_4d(&p.tma_out, buf + 32 * 64, col0, row / 2, 1, c.expert);
          } else {
            tma_store_3d(&p.tma_out, buf, col0, row, c.expert);
          }
          bulk_commit_group();
        }
      }
    }
  }

  /// row_base: the warpgroup's first row in the tile (cooperative: 0 or 64).
  /// borrowed (Variant::kBorrowStage): 16 KiB of the tile's last ring stage (32-bit shared address; 0 for a tile
  /// without k-blocks).
  template <class Variant, class Accumulator>
  __device__ __forceinline__ static void apply(const Params& p, Storage& st, Accumulator& acc,
                                               const VarlenKTileCoord& c, int row_base, int wg_thread,
                                               int barrier_id, std::uint32_t borrowed = 0) {
    using namespace cute;
    if constexpr (Variant::kBorrowStage) {
      if (c.k_tiles > 0) {  // a stage was held (uniform across both warpgroups: the same tile)
        store_tma_borrowed<Variant::kConcat>(p, st, acc, c, row_base, wg_thread, barrier_id, borrowed);
        return;
      }
    }
    if constexpr (Variant::kTma) {
      store_tma<Variant::kConcat>(p, st, acc, c, row_base, wg_thread, barrier_id);
      return;
    }
    constexpr bool kFp32 = Variant::kFp32;
    using Out = std::conditional_t<kFp32, float, __nv_bfloat16>;
    using Stage = Staged<Variant>;
    constexpr int kPassCols = Stage::kPassCols;
    auto* staged = reinterpret_cast<typename Stage::Element*>(st.staged);
    // Accumulating a tile without rows adds nothing: its output stays bitwise as it was (also -0 and NaN payloads).
    if (Variant::kAccumulate && c.k_tiles == 0) return;  // uniform across the warpgroup
    // No k-block: the accumulator holds the previous tile's values (the mainloop leaves it alone; on a CTA's first
    // tile, whatever the registers held, as the WGMMA's first scale-d = 0 step would read too), and zeros are stored
    // by selecting them below. Clearing the accumulator instead (cute::clear) is a non-WGMMA write to its registers,
    // which makes ptxas serialise every wgmma of the kernel (warning C7515), so the select stays.
    const bool empty = c.k_tiles == 0;
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    const int quad = lane % 4, row_in_warp = lane / 4;
    const int chunk = wg_thread % kChunksPerRow, row0 = wg_thread / kChunksPerRow;  // rows row0 + 8 j
    Out* out = static_cast<Out*>(p.out) + static_cast<std::int64_t>(c.expert) * p.out_expert_stride;
    // Valid columns of the tile past its first (>= kTileN for a whole tile): a pass or a chunk at or past it is padding.
    const int n_valid = p.N - c.n_tile * kTileN;
    CUTE_UNROLL
    for (int m = 0; m < kRowAtoms; ++m) {
      // This thread's destination rows of the atom (the row map applied once per atom); null: a padded row (>= M).
      Out* dst_row[kChunksPerThread];
      CUTE_UNROLL
      for (int j = 0; j < kChunksPerThread; ++j) {
        const std::int64_t tile_row =
            static_cast<std::int64_t>(c.m_tile) * kTileM + row_base + m * kRows + row0 + 8 * j;
        const std::int64_t row_offset = p.glu_concat_n > 0
                                            ? (tile_row & 1) * p.glu_half_stride + (tile_row >> 1) * p.ld_out
                                            : tile_row * p.ld_out;
        dst_row[j] = tile_row < p.M
                         ? out + row_offset + static_cast<std::int64_t>(c.n_tile) * kTileN + chunk * Stage::kChunkValues
                         : nullptr;
      }
      CUTE_UNROLL
      for (int pass = 0; pass < kTileN / kPassCols; ++pass) {
        if (pass * kPassCols >= n_valid) break;  // an edge tile's all-padding pass (uniform across the warpgroup)
        const bool col_ok = pass * kPassCols + chunk * Stage::kChunkValues < n_valid;
        float4 old[kChunksPerThread];
        if constexpr (Variant::kAccumulate) {
          CUTE_UNROLL
          for (int j = 0; j < kChunksPerThread; ++j)
            old[j] = dst_row[j] != nullptr && col_ok ? load4<kFp32>(dst_row[j] + pass * kPassCols)
                                                     : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        // Fragments of columns [pass 64, pass 64 + 64) -> staging.
        CUTE_UNROLL
        for (int v2 = pass * (kPassCols / 8); v2 < (pass + 1) * (kPassCols / 8); ++v2) {
          CUTE_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            const int r = warp * 16 + v1 * 8 + row_in_warp, col = (v2 - pass * (kPassCols / 8)) * 8 + quad * 2;
            const float x0 = empty ? 0.0f : acc(make_coord(make_coord(0, v1, v2), m, 0));
            const float x1 = empty ? 0.0f : acc(make_coord(make_coord(1, v1, v2), m, 0));
            if constexpr (Stage::kBf16)
              *reinterpret_cast<__nv_bfloat162*>(&staged[Stage::index(r, col)]) = __floats2bfloat162_rn(x0, x1);
            else
              *reinterpret_cast<float2*>(&staged[Stage::index(r, col)]) = make_float2(x0, x1);
          }
        }
        named_barrier_sync(barrier_id, 128);
        CUTE_UNROLL
        for (int j = 0; j < kChunksPerThread; ++j) {
          const int idx = Stage::index(row0 + 8 * j, chunk * Stage::kChunkValues);
          if constexpr (Stage::kBf16) {  // 8 bf16, rounded when staged
            const uint4 v = *reinterpret_cast<const uint4*>(&staged[idx]);
            if (dst_row[j] != nullptr && col_ok) *reinterpret_cast<uint4*>(dst_row[j] + pass * kPassCols) = v;
          } else {
            float4 v = *reinterpret_cast<const float4*>(&staged[idx]);
            if constexpr (Variant::kAccumulate) v.x += old[j].x, v.y += old[j].y, v.z += old[j].z, v.w += old[j].w;
            if (dst_row[j] != nullptr && col_ok) store4<kFp32>(dst_row[j] + pass * kPassCols, v);
          }
        }
        named_barrier_sync(barrier_id, 128);  // the staging buffer is free for the next pass
      }
    }
  }
};

}  // namespace machmoe::gpu::hopper
