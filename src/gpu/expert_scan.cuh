// One block-wide scan used by every kernel that lays experts out for the grouped GEMMs (the routing metadata, token
// rounding's offsets, the dX̃ chunk plan): per expert a row count, its GEMM tiles ceil(rows / kGemmTileM), and the
// exclusive prefix sums of both over the experts before it. E may exceed the block: experts are taken kThreads at a
// time and the sums carried from one group to the next. Integer sums in a fixed order, so the result is exact and
// deterministic.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "gpu/kernels.hpp"

namespace machmoe::gpu {

/// Called by all kThreads threads of the block (blockDim.x == kThreads). For each expert e in [0, E), the thread
/// that owns it calls rows_of(e) (its row count) and then emit(e, rows, tiles, rows_before, tiles_before), where the
/// two last are the sums over experts [0, e). Every rows_of of a group of kThreads experts runs before any emit of
/// that group (emit may overwrite what rows_of read), and an emit sees nothing of the next group. Returns, to every
/// thread, the totals over all E experts in `total_rows` and `total_tiles`.
template <int kThreads, class RowsOf, class Emit>
__device__ void scan_expert_rows_and_tiles(int E, RowsOf rows_of, Emit emit, std::int32_t& total_rows,
                                           std::int32_t& total_tiles) {
  using Scan = cub::BlockScan<std::int32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ std::int32_t carry_rows, carry_tiles;
  if (threadIdx.x == 0) carry_rows = carry_tiles = 0;
  __syncthreads();
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const std::int32_t rows = e < E ? rows_of(e) : 0;
    const std::int32_t tiles = (rows + kGemmTileM - 1) / kGemmTileM;
    std::int32_t rows_before, tiles_before, group_rows, group_tiles;
    Scan(temp).ExclusiveSum(rows, rows_before, group_rows);
    __syncthreads();
    Scan(temp).ExclusiveSum(tiles, tiles_before, group_tiles);
    __syncthreads();  // every rows_of of this group has returned before any emit
    if (e < E) emit(e, rows, tiles, carry_rows + rows_before, carry_tiles + tiles_before);
    __syncthreads();
    if (threadIdx.x == 0) carry_rows += group_rows, carry_tiles += group_tiles;
    __syncthreads();
  }
  total_rows = carry_rows;
  total_tiles = carry_tiles;
}

}  // namespace machmoe::gpu
