// Routing metadata without a global sort and without host synchronisation (docs/SPEC.md §2.2):
//   1. per-tile expert histograms (tiles of kMetadataTile pairs, one thread per pair; or written by the top-K
//      kernel as it selects, MetadataArgs::histograms_written),
//   2. per-expert exclusive scans over tiles, then (the scan's last block) an exclusive scan over experts -> offsets,
//   3. per tile, each pair's stable rank among same-expert pairs before it in the tile; up to 256 experts a block of
//      eight tiles then sorts its pairs by grouped row in shared memory and writes scatter and gather in runs.
// Grouped row of pair p = offsets[e] + (pairs of e in earlier tiles) + rank: ascending pair order inside each
// expert, the order of the CPU reference. Integer atomics only (exact, so the result is deterministic).
// With the forward's chunks of tokens, a step between 2 and 3 builds their plan from the scanned histograms (the pairs
// of expert e before a chunk's first pair: the tile's prefix plus a count inside the boundary tile), and step 3 also
// writes each pair's row in its chunk.
#include <cub/block/block_scan.cuh>

#include <cstdlib>

#include "core/env.hpp"
#include "gpu/chunk_plan.cuh"
#include "gpu/cuda_check.hpp"
#include "gpu/dependent_launch.cuh"
#include "gpu/device_math.cuh"
#include "gpu/expert_scan.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

constexpr int kScanThreads = kChunkPlanThreads;  // the plan kernels write their plans with write_chunk_plan
using BlockScan = cub::BlockScan<std::int32_t, kScanThreads>;

__global__ void tile_histogram_kernel(const std::int32_t* __restrict__ pair_expert, std::int64_t P, int E,
                                      std::int64_t n_tiles, std::int32_t* __restrict__ hist) {
  const std::int64_t tile = blockIdx.x;
  const std::int64_t p = tile * kMetadataTile + threadIdx.x;
  const std::int32_t e = p < P ? pair_expert[p] : -1;
  // One integer atomic per distinct expert of a warp (the lowest lane of each group adds the group's size).
  const unsigned group = __match_any_sync(0xffffffffu, e);
  const int lane = threadIdx.x & 31;
  if (e >= 0 && e < E && (__ffs(group) - 1) == lane) atomicAdd(&hist[e * n_tiles + tile], __popc(group));
}

/// In one block: counts (held in offsets[1..E]) -> exclusive offsets; also expert_counts and expert_tiles. `load`
/// reads offsets (L2 for the scan's last block, which reads what the other blocks wrote).
template <class Load>
__device__ void expert_offsets_from_counts(std::int32_t* offsets, int E, std::int32_t* counts, std::int32_t* tiles,
                                          bool counts_in_offsets, Load load) {
  std::int32_t total_rows, total_tiles;
  scan_expert_rows_and_tiles<kScanThreads>(
      E, [&](int e) { return counts_in_offsets ? load(offsets + e + 1) : load(offsets + e + 1) - load(offsets + e); },
      [&](int e, std::int32_t c, std::int32_t t, std::int32_t c_before, std::int32_t t_before) {
        if (counts) counts[e] = c;
        if (counts_in_offsets) offsets[e + 1] = c_before + c;
        if (tiles) tiles[e + 1] = t_before + t;
      },
      total_rows, total_tiles);
  if (threadIdx.x == 0) {
    if (counts_in_offsets) offsets[0] = 0;
    if (tiles) tiles[0] = 0;
  }
}

/// Row e of hist (one block per expert): exclusive scan over tiles in place, kScanThreads * Items tiles a step, every
/// load of a step issued before its scan (one step covers 2048 tiles, 524288 pairs, at Items = 8); the expert's total
/// goes to offsets[e + 1]. The last block to finish (an integer counter, zeroed with the histograms) then turns the
/// counts into the expert offsets, counts and tiles, so no kernel of its own follows.
template <int Items>
__global__ void scan_tiles_kernel(std::int32_t* __restrict__ hist, std::int64_t n_tiles, std::int32_t* offsets, int E,
                                  std::int32_t* __restrict__ counts, std::int32_t* __restrict__ tiles,
                                  unsigned* __restrict__ blocks_done) {
  __shared__ typename BlockScan::TempStorage temp;
  __shared__ std::int32_t carry;
  __shared__ bool last;
  wait_for_prior_grid();  // the histograms (a programmatic dependent launch: launch_routing_metadata)
  std::int32_t* row = hist + static_cast<std::int64_t>(blockIdx.x) * n_tiles;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (std::int64_t base = 0; base < n_tiles; base += kScanThreads * Items) {
    const std::int64_t first = base + static_cast<std::int64_t>(threadIdx.x) * Items;  // blocked: Items in a row
    std::int32_t v[Items];
#pragma unroll
    for (int j = 0; j < Items; ++j) v[j] = first + j < n_tiles ? row[first + j] : 0;
    std::int32_t total;
    BlockScan(temp).ExclusiveSum(v, v, total);
#pragma unroll
    for (int j = 0; j < Items; ++j)
      if (first + j < n_tiles) row[first + j] = carry + v[j];
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    offsets[blockIdx.x + 1] = carry;
    __threadfence();  // this count is visible before the counter says so
    last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  allow_dependent_launch();
  if (!last) return;
  __threadfence();
  expert_offsets_from_counts(offsets, E, counts, tiles, true, [](const std::int32_t* q) { return __ldcg(q); });
}

/// In one block: expert_offsets_from_counts (the routing metadata without pairs, and launch_expert_tiles).
__global__ void expert_offsets_kernel(std::int32_t* __restrict__ offsets, int E, std::int32_t* __restrict__ counts,
                                      std::int32_t* __restrict__ tiles, bool counts_in_offsets) {
  expert_offsets_from_counts(offsets, E, counts, tiles, counts_in_offsets, [](const std::int32_t* q) { return *q; });
}

/// The forward's chunks of tokens, for the place kernel: each pair's row in its chunk (pair_rows null: none).
struct ChunkRows {
  const std::int32_t* bounds = nullptr;  // (chunks + 1) token bounds of the plan
  const std::int32_t* shifts = nullptr;  // (chunks, E)
  int chunks = 0;
  std::int32_t* pair_rows = nullptr;
};

/// The row in its chunk of a pair of token t, expert e and grouped row g (the forward's chunks of tokens).
__device__ __forceinline__ std::int32_t chunk_row_of(const ChunkRows& chunk_rows, std::int32_t t, int E, int e,
                                                     std::int32_t g) {
  int c = 0;  // the chunk holding token t: bounds ascend, bounds[0] = 0
  while (c + 1 < chunk_rows.chunks && chunk_rows.bounds[c + 1] <= t) ++c;
  return g - chunk_rows.shifts[static_cast<std::int64_t>(c) * E + e];
}

__global__ void place_kernel(const std::int32_t* __restrict__ pair_expert, const std::int32_t* __restrict__ pair_token,
                             std::int64_t P, std::int64_t K, int E, std::int64_t n_tiles,
                             const std::int32_t* __restrict__ hist, const std::int32_t* __restrict__ offsets,
                             std::int32_t* __restrict__ scatter, std::int32_t* __restrict__ inverse,
                             std::int32_t* __restrict__ gather, ChunkRows chunk_rows) {
  __shared__ alignas(16) std::int32_t tile_expert[kMetadataTile];
  wait_for_prior_grid();  // the scan's offsets (and the plan's shifts)
  const std::int64_t tile = blockIdx.x, base = tile * kMetadataTile;
  const int i = threadIdx.x, lane = i & 31, warp_begin = i & ~31;
  const std::int64_t p = base + i;
  const std::int32_t e = p < P ? pair_expert[p] : -1;
  tile_expert[i] = e;
  __syncthreads();
  // Stable rank of p among the tile's pairs of expert e: earlier warps counted from shared memory (16-byte reads,
  // the same address across the warp), this warp's earlier lanes from the match mask.
  const unsigned same = __match_any_sync(0xffffffffu, e);
  std::int32_t rank = __popc(same & ((1u << lane) - 1u));
  const int4* earlier = reinterpret_cast<const int4*>(tile_expert);
  for (int j = 0; j < warp_begin / 4; ++j) {
    const int4 q = earlier[j];
    rank += (q.x == e) + (q.y == e) + (q.z == e) + (q.w == e);
  }
  allow_dependent_launch();
  if (p >= P) return;
  if (e < 0 || e >= E) {
    inverse[p] = -1;
    if (chunk_rows.pair_rows) chunk_rows.pair_rows[p] = -1;  // routed nowhere: the gather-sum skips it
    return;
  }
  const std::int32_t g = offsets[e] + hist[e * n_tiles + tile] + rank;
  const std::int32_t t = pair_token ? pair_token[p] : static_cast<std::int32_t>(p / K);
  inverse[p] = g;
  scatter[g] = static_cast<std::int32_t>(p);
  gather[g] = t;
  if (chunk_rows.pair_rows) chunk_rows.pair_rows[p] = chunk_row_of(chunk_rows, t, E, e, g);
}

/// The place kernel over kPlaceTiles metadata tiles a block, for up to kPlaceMaxExperts experts: the same rows as
/// place_kernel, with scatter and gather written in grouped order. place_kernel's block holds one tile, about two pairs
/// of each expert at E = 128, so nearly every 4-byte write of scatter and gather lands in a sector of its own. Here a
/// block's pairs of one expert are kPlaceTiles times as many and take consecutive grouped rows, so the block sorts its
/// pairs by grouped row in shared memory (a counting sort: the rows are known) and writes runs of them.
/// Warp w takes tile tb + w, 32 pairs a step: a pair's rank among its tile's earlier pairs of its expert is the warp's
/// running count (shared memory, one row of E per warp) plus its lane's rank in the match mask, so no pass over the
/// tile's earlier pairs is made. Integer counts only: deterministic.
constexpr int kPlaceTiles = kMetadataTile / 32;  // one warp a tile: 8 tiles, 2048 pairs a block
constexpr int kPlaceMaxExperts = kMetadataTile;  // one expert a thread in the scans below
constexpr int kPlacePairs = kPlaceTiles * kMetadataTile;
constexpr int kPlaceSteps = kMetadataTile / 32;  // a warp's steps over its tile
using PlaceScan = cub::BlockScan<std::int32_t, kMetadataTile>;

__global__ void __launch_bounds__(kMetadataTile)
    place_sorted_kernel(const std::int32_t* __restrict__ pair_expert, const std::int32_t* __restrict__ pair_token,
                        std::int64_t P, std::int64_t K, int E, std::int64_t n_tiles,
                        const std::int32_t* __restrict__ hist, const std::int32_t* __restrict__ offsets,
                        std::int32_t* __restrict__ scatter, std::int32_t* __restrict__ inverse,
                        std::int32_t* __restrict__ gather, ChunkRows chunk_rows) {
  __shared__ std::int32_t warp_count[kPlaceTiles][kPlaceMaxExperts];  // counts, then each warp's exclusive prefix
  __shared__ std::int32_t local_base[kPlaceMaxExperts];  // first slot of each expert in the block's sorted order
  __shared__ std::int32_t row_base[kPlaceMaxExperts];    // grouped row of each expert's first pair in the block
  __shared__ std::int32_t sorted_row[kPlacePairs], sorted_pair[kPlacePairs], sorted_token[kPlacePairs];
  __shared__ typename PlaceScan::TempStorage temp;
  const int i = threadIdx.x, lane = i & 31, w = i >> 5;
  const std::int64_t tb = static_cast<std::int64_t>(blockIdx.x) * kPlaceTiles;
  for (int e = i; e < E; e += kMetadataTile)
    for (int v = 0; v < kPlaceTiles; ++v) warp_count[v][e] = 0;
  const std::int64_t p0 = (tb + w) * kMetadataTile + lane;
  // Every global load is issued before the first use of one. The pairs are read before the wait: their writer ran
  // before the scan, and the scan (like the plan after it) lets its dependents start only after its own wait, so
  // that writer has finished before this kernel starts. The scan's results follow the wait, and the ranking below
  // hides their latency.
  std::int32_t expert[kPlaceSteps], token[kPlaceSteps], rank[kPlaceSteps];
#pragma unroll
  for (int j = 0; j < kPlaceSteps; ++j) {
    const std::int64_t p = p0 + 32 * j;
    expert[j] = p < P ? pair_expert[p] : -1;
    token[j] = p >= P ? 0 : pair_token ? pair_token[p] : static_cast<std::int32_t>(p / K);
  }
  wait_for_prior_grid();  // the scan's offsets and scanned histograms (and the plan's shifts)
  const std::int32_t block_row_base = i < E ? offsets[i] + hist[static_cast<std::int64_t>(i) * n_tiles + tb] : 0;
  __syncthreads();  // the zeroed counts
#pragma unroll
  for (int j = 0; j < kPlaceSteps; ++j) {
    const std::int32_t e = expert[j];
    const bool routed = e >= 0 && e < E;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    rank[j] = (routed ? warp_count[w][e] : 0) + __popc(same & ((1u << lane) - 1u));
    __syncwarp();
    if (routed && (__ffs(same) - 1) == lane) warp_count[w][e] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  // Per expert: the warps' counts -> exclusive prefixes (a pair's rank among the block's earlier pairs of its expert
  // is its warp's prefix plus its rank), then the block's counts -> first slots of the sorted order.
  std::int32_t total = 0;
  if (i < E) {
    for (int v = 0; v < kPlaceTiles; ++v) {
      const std::int32_t c = warp_count[v][i];
      warp_count[v][i] = total;
      total += c;
    }
    row_base[i] = block_row_base;
  }
  std::int32_t first_slot, routed_pairs;
  PlaceScan(temp).ExclusiveSum(total, first_slot, routed_pairs);
  if (i < E) local_base[i] = first_slot;
  __syncthreads();
  allow_dependent_launch();
#pragma unroll
  for (int j = 0; j < kPlaceSteps; ++j) {
    const std::int64_t p = p0 + 32 * j;
    if (p >= P) break;
    const std::int32_t e = expert[j];
    if (e < 0 || e >= E) {
      inverse[p] = -1;
      if (chunk_rows.pair_rows) chunk_rows.pair_rows[p] = -1;  // routed nowhere: the gather-sum skips it
      continue;
    }
    const std::int32_t r = warp_count[w][e] + rank[j];
    const std::int32_t g = row_base[e] + r, slot = local_base[e] + r;
    const std::int32_t t = token[j];
    inverse[p] = g;
    sorted_row[slot] = g;
    sorted_pair[slot] = static_cast<std::int32_t>(p);
    sorted_token[slot] = t;
    if (chunk_rows.pair_rows) chunk_rows.pair_rows[p] = chunk_row_of(chunk_rows, t, E, e, g);
  }
  __syncthreads();
  for (int s = i; s < routed_pairs; s += kMetadataTile) {  // runs of consecutive grouped rows
    const std::int32_t g = sorted_row[s];
    scatter[g] = sorted_pair[s];
    gather[g] = sorted_token[s];
  }
}

/// Pairs of expert e before pair b (b in [0, P]): its tile's exclusive prefix (hist scanned in place) plus, from the
/// boundary tile's histogram in shared memory, those of the tile's pairs before b. A boundary at or past the last
/// tile counts every pair of e.
__device__ std::int32_t pairs_before(const std::int32_t* hist, std::int64_t n_tiles, const std::int32_t* offsets,
                                     int e, std::int64_t b, const std::int32_t* boundary_tile_hist) {
  const std::int64_t tile = b / kMetadataTile;
  if (tile >= n_tiles) return offsets[e + 1] - offsets[e];
  return hist[e * n_tiles + tile] + boundary_tile_hist[e];
}

/// One block per chunk of tokens: the plan launch_dx_chunk_plan builds by searching each expert's grouped rows,
/// here from counts. Chunk c holds the tokens [t0, t1), i.e. the pairs [b0, b1) (pairs ascend in token); an
/// expert's rows in the chunk are its pairs in [b0, b1), the first of them at grouped row offsets[e] + (its pairs
/// before b0). Runs after the tile scan and the expert offsets, before the place kernel (which reads the shifts).
__global__ void chunk_plan_from_histograms_kernel(const std::int32_t* __restrict__ pair_expert, std::int64_t P, int E,
                                                  std::int64_t n_tiles, const std::int32_t* __restrict__ hist,
                                                  const std::int32_t* __restrict__ offsets,
                                                  const std::int32_t* __restrict__ token_offsets, std::int64_t K,
                                                  std::int64_t T, std::int64_t chunks, std::int64_t pairs_per_chunk,
                                                  DxChunkPlan plan) {
  extern __shared__ std::int32_t boundary_hist[];  // 2 E: the pairs of each expert before b0, then before b1,
  std::int32_t* before_b0 = boundary_hist;          // inside their boundary tiles
  std::int32_t* before_b1 = boundary_hist + E;
  wait_for_prior_grid();  // the scanned histograms and the offsets
  const std::int64_t c = blockIdx.x;
  const std::int64_t t0 = first_token_at(c * pairs_per_chunk, token_offsets, K, T);
  const std::int64_t t1 = c == chunks - 1 ? T : first_token_at((c + 1) * pairs_per_chunk, token_offsets, K, T);
  const std::int64_t b0 = token_offsets ? token_offsets[t0] : t0 * K;
  const std::int64_t b1 = token_offsets ? token_offsets[t1] : t1 * K;
  for (int e = threadIdx.x; e < 2 * E; e += blockDim.x) boundary_hist[e] = 0;
  __syncthreads();
  // Each boundary tile's pairs before the boundary (fewer than kMetadataTile), counted by integer atomics.
  const std::int64_t q0 = (b0 / kMetadataTile) * kMetadataTile + threadIdx.x;
  const std::int64_t q1 = (b1 / kMetadataTile) * kMetadataTile + threadIdx.x;
  static_assert(kScanThreads >= kMetadataTile, "one thread per pair of a boundary tile");
  if (threadIdx.x < kMetadataTile && q0 < b0 && q0 < P) {
    const std::int32_t e = pair_expert[q0];
    if (e >= 0 && e < E) atomicAdd(&before_b0[e], 1);
  }
  if (threadIdx.x < kMetadataTile && q1 < b1 && q1 < P) {
    const std::int32_t e = pair_expert[q1];
    if (e >= 0 && e < E) atomicAdd(&before_b1[e], 1);
  }
  __syncthreads();
  write_chunk_plan(plan, E, c, chunks, t0, T, [&](int e, std::int32_t& first) {
    const std::int32_t before0 = pairs_before(hist, n_tiles, offsets, e, b0, before_b0);
    const std::int32_t before1 = pairs_before(hist, n_tiles, offsets, e, b1, before_b1);
    first = offsets[e] + before0;
    return before1 - before0;  // b1 >= b0
  });
  allow_dependent_launch();
}

/// token_offsets[t] = first pair whose token is >= t (pair tokens ascending).
__global__ void token_offsets_kernel(const std::int32_t* __restrict__ pair_token, std::int64_t P, std::int64_t T,
                                     std::int32_t* __restrict__ token_offsets) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t > T) return;
  std::int64_t lo = 0, hi = P;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) >> 1;
    if (pair_token[mid] < t) lo = mid + 1;
    else hi = mid;
  }
  token_offsets[t] = static_cast<std::int32_t>(lo);
}

}  // namespace

namespace {

/// MACHMOE_PLACE_BY_TILE=1: place_kernel wherever PlaceKernel::kAuto would sort (a measurement switch, read once).
bool place_by_tile_requested() {
  static const bool requested = detail::env_switch("MACHMOE_PLACE_BY_TILE", false);
  return requested;
}

}  // namespace

bool place_kernel_sorts(const MetadataArgs& a) {
  if (a.E > kPlaceMaxExperts) return false;
  switch (a.place) {
    case PlaceKernel::kByTile: return false;
    case PlaceKernel::kSorted: return true;
    case PlaceKernel::kAuto: break;
  }
  return a.E >= 128 && a.P >= kPlaceSortedMinPairs && !place_by_tile_requested();
}

void launch_routing_metadata(const MetadataArgs& a, cudaStream_t stream) {
  const std::int64_t n_tiles = (a.P + kMetadataTile - 1) / kMetadataTile;
  const int E = static_cast<int>(a.E);
  const bool plan = metadata_built_plan(a) && n_tiles > 0;
  if (a.token_offsets) {  // first: the chunk plan reads it
    token_offsets_kernel<<<ceil_div(a.T + 1, 256), 256, 0, stream>>>(a.pair_token, a.P, a.T, a.token_offsets);
    MACHMOE_CUDA_CHECK_LAUNCH("token_offsets");
  }
  // The tile scan writes every expert's count into offsets[e + 1], and its last block the offsets.
  // The scan, the plan and the place kernel are programmatic dependent launches (dependent_launch.cuh): each is
  // scheduled while the kernel before it finishes and waits for its writes, so the chain has no launch gaps.
  if (n_tiles > 0) {
    // The histograms and, after them, the scan's counter of finished blocks (the top-K kernel's, or here).
    auto* blocks_done = reinterpret_cast<unsigned*>(a.tile_hist + a.E * n_tiles);
    if (!a.histograms_written) {
      MACHMOE_CUDA_CHECK(cudaMemsetAsync(a.tile_hist, 0, sizeof(std::int32_t) * (a.E * n_tiles + 1), stream));
      tile_histogram_kernel<<<static_cast<unsigned>(n_tiles), kMetadataTile, 0, stream>>>(a.pair_expert, a.P, E,
                                                                                         n_tiles, a.tile_hist);
      MACHMOE_CUDA_CHECK_LAUNCH("tile_histogram");
    }
    auto scan = [&](auto kernel) {
      launch_dependent(kernel, dim3(static_cast<unsigned>(E)), dim3(kScanThreads), 0, stream, a.tile_hist, n_tiles,
                       a.expert_offsets, E, a.expert_counts, a.expert_tiles, blocks_done);
    };
    if (n_tiles <= kScanThreads) scan(scan_tiles_kernel<1>);
    else if (n_tiles <= 2 * kScanThreads) scan(scan_tiles_kernel<2>);
    else if (n_tiles <= 4 * kScanThreads) scan(scan_tiles_kernel<4>);
    else scan(scan_tiles_kernel<8>);
    MACHMOE_CUDA_CHECK_LAUNCH("scan_tiles");
  } else {
    // No pairs: no tile is scanned, and the counts (offsets[1..E]) are zeros.
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(a.expert_offsets, 0, sizeof(std::int32_t) * (a.E + 1), stream));
    expert_offsets_kernel<<<1, kScanThreads, 0, stream>>>(a.expert_offsets, E, a.expert_counts, a.expert_tiles, true);
    MACHMOE_CUDA_CHECK_LAUNCH("expert_offsets");
  }
  ChunkRows chunk_rows;
  if (plan) {
    launch_dependent(chunk_plan_from_histograms_kernel, dim3(static_cast<unsigned>(a.chunks)), dim3(kScanThreads),
                     2 * sizeof(std::int32_t) * static_cast<std::size_t>(a.E), stream, a.pair_expert, a.P, E, n_tiles,
                     a.tile_hist, a.expert_offsets, a.token_offsets, a.K, a.T, a.chunks, a.pairs_per_chunk, a.plan);
    MACHMOE_CUDA_CHECK_LAUNCH("chunk_plan_from_histograms");
    chunk_rows.bounds = a.plan.bounds, chunk_rows.shifts = a.plan.shifts;
    chunk_rows.chunks = static_cast<int>(a.chunks), chunk_rows.pair_rows = a.pair_rows;
  }
  if (n_tiles > 0) {
    if (place_kernel_sorts(a)) {
      launch_dependent(place_sorted_kernel, dim3(static_cast<unsigned>(ceil_div(n_tiles, kPlaceTiles))),
                       dim3(kMetadataTile), 0, stream, a.pair_expert, a.pair_token, a.P, a.K, E, n_tiles, a.tile_hist,
                       a.expert_offsets, a.scatter, a.inverse, a.gather, chunk_rows);
      MACHMOE_CUDA_CHECK_LAUNCH("place_sorted");
    } else {
      launch_dependent(place_kernel, dim3(static_cast<unsigned>(n_tiles)), dim3(kMetadataTile), 0, stream,
                       a.pair_expert, a.pair_token, a.P, a.K, E, n_tiles, a.tile_hist, a.expert_offsets, a.scatter,
                       a.inverse, a.gather, chunk_rows);
      MACHMOE_CUDA_CHECK_LAUNCH("place");
    }
  }
}

namespace {

/// The first positions in gather[lo, hi) (ascending tokens) holding a token >= t0 and >= t1. The plan kernel is
/// latency-bound (one thread per expert, each step's loads depending on the last), so both searches run in lockstep
/// and each wide step probes 7 evenly spaced positions at once, keeping the eighth of the range they bracket: about
/// log8 of the segment's length in dependent steps (4 for 2560 rows, where halving took 12), then binary steps below
/// 8 positions. The same lower bounds as a binary search.
__device__ void lower_bound_tokens(const std::int32_t* gather, std::int32_t lo, std::int32_t hi, std::int64_t t0,
                                   std::int64_t t1, std::int32_t& first, std::int32_t& end) {
  constexpr int kProbes = 7;
  std::int32_t lo0 = lo, hi0 = hi, lo1 = lo, hi1 = hi;
  // Invariant of each search: positions before lo hold tokens < t, positions at or past hi tokens >= t.
  auto narrow = [](const std::int32_t (&g)[kProbes], std::int64_t t, std::int32_t step, std::int32_t& l,
                   std::int32_t& h) {
    int below = 0;  // probes holding tokens < t: a prefix of them, tokens ascending
#pragma unroll
    for (int j = 0; j < kProbes; ++j) below += g[j] < t;
    const std::int32_t new_lo = below > 0 ? l + step * below + 1 : l;
    const std::int32_t new_hi = below < kProbes ? l + step * (below + 1) : h;
    l = new_lo, h = new_hi;
  };
  for (;;) {
    const std::int32_t s0 = (hi0 - lo0) / (kProbes + 1), s1 = (hi1 - lo1) / (kProbes + 1);
    if (s0 == 0 && s1 == 0) break;
    std::int32_t g0[kProbes], g1[kProbes];
#pragma unroll
    for (int j = 0; j < kProbes; ++j) {  // every load of the step before any compare
      g0[j] = s0 > 0 ? gather[lo0 + s0 * (j + 1)] : 0;
      g1[j] = s1 > 0 ? gather[lo1 + s1 * (j + 1)] : 0;
    }
    if (s0 > 0) narrow(g0, t0, s0, lo0, hi0);
    if (s1 > 0) narrow(g1, t1, s1, lo1, hi1);
  }
  while (lo0 < hi0 || lo1 < hi1) {
    const std::int32_t mid0 = lo0 + (hi0 - lo0) / 2, mid1 = lo1 + (hi1 - lo1) / 2;
    const std::int32_t g0 = lo0 < hi0 ? gather[mid0] : 0, g1 = lo1 < hi1 ? gather[mid1] : 0;
    if (lo0 < hi0) {
      if (g0 >= t0) hi0 = mid0;
      else lo0 = mid0 + 1;
    }
    if (lo1 < hi1) {
      if (g1 >= t1) hi1 = mid1;
      else lo1 = mid1 + 1;
    }
  }
  first = lo0, end = lo1;
}

/// Expert e's rows in the tokens [t0, t1): the positions of its segment's first token >= t0 and >= t1.
__device__ std::int32_t rows_in_tokens(const std::int32_t* gather, const std::int32_t* offsets, int e, std::int64_t t0,
                                       std::int64_t t1, std::int32_t& first) {
  std::int32_t end = 0;
  lower_bound_tokens(gather, offsets[e], offsets[e + 1], t0, t1, first, end);
  return end - first;  // t1 >= t0: end >= first
}

/// The plan and the pairs' rows in their chunks in one pass (plan_chunk_and_pair_rows), each expert's rows in a
/// chunk searched for among its grouped rows' tokens. E <= kFusedPlanMaxExperts (the offsets and the chunk's shifts
/// in shared memory).
__global__ void __launch_bounds__(kChunkPlanThreads)
    chunk_plan_and_pair_rows_kernel(const std::int32_t* __restrict__ offsets, const std::int32_t* __restrict__ gather,
                                    const std::int32_t* __restrict__ token_offsets,
                                    const std::int32_t* __restrict__ inverse, std::int64_t K, std::int64_t T, int E,
                                    std::int64_t chunks, std::int64_t pairs_per_chunk, DxChunkPlan plan,
                                    std::int32_t* __restrict__ pair_rows) {
  plan_chunk_and_pair_rows(offsets, token_offsets, K, T, E, inverse, chunks, pairs_per_chunk, plan, pair_rows,
                           [&](const std::int32_t* offsets_s, int e, std::int64_t t0, std::int64_t t1,
                               std::int32_t& first) { return rows_in_tokens(gather, offsets_s, e, t0, t1, first); });
}

/// More experts than plan_chunk_and_pair_rows holds in shared memory: one block per chunk, its token range, then per
/// expert (256 at a time, scanned with a carry) the rows of its segment whose tokens fall in the range; the pairs'
/// rows follow from dx_pair_rows_kernel.
__global__ void dx_chunk_plan_kernel(const std::int32_t* __restrict__ offsets, const std::int32_t* __restrict__ gather,
                                     const std::int32_t* __restrict__ token_offsets, std::int64_t K, std::int64_t T,
                                     int E, std::int64_t chunks, std::int64_t pairs_per_chunk, DxChunkPlan plan) {
  const std::int64_t c = blockIdx.x;
  const std::int64_t t0 = first_token_at(c * pairs_per_chunk, token_offsets, K, T);
  const std::int64_t t1 = c == chunks - 1 ? T : first_token_at((c + 1) * pairs_per_chunk, token_offsets, K, T);
  write_chunk_plan(plan, E, c, chunks, t0, T,
                   [&](int e, std::int32_t& first) { return rows_in_tokens(gather, offsets, e, t0, t1, first); });
}

/// Block (e, c): pair_rows[scatter[g]] = g - shift for the rows g of expert e in chunk c. Each thread loads
/// kPairRowsUnroll scatter entries before storing any (a block covers about a thousand rows: the loads of a round are
/// in flight together instead of one load-store chain per row).
constexpr int kPairRowsThreads = 256, kPairRowsUnroll = 4;
__global__ void dx_pair_rows_kernel(const std::int32_t* __restrict__ scatter, DxChunkPlan plan,
                                    std::int32_t* __restrict__ pair_rows) {
  const std::int64_t e = blockIdx.x, c = blockIdx.y;
  const std::int32_t* off = plan.offsets + c * (plan.E + 1);
  const std::int32_t shift = plan.shifts[c * plan.E + e];
  const std::int32_t stop = off[e + 1];
  for (std::int32_t r0 = off[e] + static_cast<std::int32_t>(threadIdx.x); r0 < stop;
       r0 += kPairRowsThreads * kPairRowsUnroll) {
    std::int32_t pair[kPairRowsUnroll];
#pragma unroll
    for (int u = 0; u < kPairRowsUnroll; ++u) {
      const std::int32_t r = r0 + u * kPairRowsThreads;
      pair[u] = r < stop ? scatter[r + shift] : 0;
    }
#pragma unroll
    for (int u = 0; u < kPairRowsUnroll; ++u) {
      const std::int32_t r = r0 + u * kPairRowsThreads;
      if (r < stop) pair_rows[pair[u]] = r;
    }
  }
}

}  // namespace

void launch_dx_chunk_plan(const std::int32_t* expert_offsets, const std::int32_t* gather,
                          const std::int32_t* scatter, const std::int32_t* inverse,
                          const std::int32_t* token_offsets, std::int64_t K,
                          std::int64_t T, std::int64_t E, std::int64_t P_max, std::int64_t chunks,
                          std::int64_t pairs_per_chunk, const DxChunkPlan& plan, std::int32_t* pair_rows,
                          bool every_pair_routed, cudaStream_t stream) {
  if (chunks <= 0 || E <= 0) return;
  if (E <= kFusedPlanMaxExperts) {
    // One kernel: every chunk's pairs, and only they, are written (those routed nowhere with -1).
    chunk_plan_and_pair_rows_kernel<<<chunk_plan_grid(chunks, pairs_per_chunk), kChunkPlanThreads,
                                      chunk_plan_shared_bytes(E), stream>>>(
        expert_offsets, gather, token_offsets, inverse, K, T, static_cast<int>(E), chunks, pairs_per_chunk, plan,
        pair_rows);
    MACHMOE_CUDA_CHECK_LAUNCH("chunk_plan_and_pair_rows");
    return;
  }
  dx_chunk_plan_kernel<<<static_cast<unsigned>(chunks), kScanThreads, 0, stream>>>(
      expert_offsets, gather, token_offsets, K, T, static_cast<int>(E), chunks, pairs_per_chunk, plan);
  MACHMOE_CUDA_CHECK_LAUNCH("dx_chunk_plan");
  if (P_max == 0) return;
  // Pairs routed to no expert (skipped caller pairs) keep -1: the gather-sum skips them. Where every pair is
  // routed (top-K), the kernel below writes every entry and the fill is not needed.
  if (!every_pair_routed)
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(pair_rows, 0xff, static_cast<std::size_t>(P_max) * 4, stream));
  dx_pair_rows_kernel<<<dim3(static_cast<unsigned>(E), static_cast<unsigned>(chunks)), kPairRowsThreads, 0, stream>>>(
      scatter, plan, pair_rows);
  MACHMOE_CUDA_CHECK_LAUNCH("dx_pair_rows");
}

void launch_expert_tiles(const std::int32_t* expert_offsets, std::int64_t E, std::int32_t* expert_tiles,
                         cudaStream_t stream) {
  expert_offsets_kernel<<<1, kScanThreads, 0, stream>>>(const_cast<std::int32_t*>(expert_offsets),
                                                        static_cast<int>(E), nullptr, expert_tiles, false);
  MACHMOE_CUDA_CHECK_LAUNCH("expert_tiles");
}

}  // namespace machmoe::gpu

namespace machmoe::gpu {
namespace {

/// Claims the status of index checking for this violation unless an earlier one holds it, then fills the host
/// record and publishes it (fields first, system-scope fence, then `ready`), so the host never reads a torn record.
__device__ void record_violation(const IndexCheck& check, IndexViolation violation, std::int64_t position,
                                 std::int64_t value, std::int64_t bound) {
  if (atomicCAS(check.claim, 0, 1) != 0) return;
  IndexViolationRecord* r = check.record;
  r->violation = static_cast<std::int32_t>(violation);
  r->position = position;
  r->value = value;
  r->bound = bound;
  __threadfence_system();
  r->ready = 1;
}

// Caller pairs are made safe for every later kernel whatever they hold. Those kernels need the pair tokens ascending
// (the per-token offsets are a binary search) and at most K pairs per token (a chunk of tokens holds at most
// ceil(P / chunks) + K - 1 rows). So each pair's token becomes the running maximum of the valid tokens up to it, and a
// pair is routed only if its token is in range, equals that maximum (it is not below an earlier token) and is not
// the (K+1)-th pair of its token; the others get expert -1 and are skipped. Routed pairs of valid routing keep their
// token and expert (only a skipped pair's token can change), so valid routing gives bitwise the results it gave before. The running maximum takes three launches: a block's
// own maximum scan, a scan of the blocks' maxima, and the pass that adds each block's carry and decides.
constexpr int kConvertThreads = 256;
constexpr int kConvertPerThread = 4;
constexpr std::int64_t kConvertPairsPerBlock = kConvertThreads * kConvertPerThread;
using ConvertScan = cub::BlockScan<std::int32_t, kConvertThreads>;

struct MaxOp {
  __device__ std::int32_t operator()(std::int32_t a, std::int32_t b) const { return a > b ? a : b; }
};

/// The token of pair p if it is a valid token of a valid pair, else -1 (it then raises no running maximum).
template <class I, class J>
__device__ std::int32_t routable_token(const I* token, const J* expert, std::int64_t p, std::int64_t T,
                                       std::int64_t E) {
  const std::int64_t t = static_cast<std::int64_t>(token[p]), e = static_cast<std::int64_t>(expert[p]);
  return t >= 0 && t < T && e >= 0 && e < E ? static_cast<std::int32_t>(t) : -1;
}

/// Step 1: per block of kConvertPairsPerBlock pairs, the running maximum inside the block (into pair_token) and the
/// block's maximum (into block_max); with checking on, records the first violation of the CPU's rules.
template <class I, class J>
__global__ void __launch_bounds__(kConvertThreads)
    convert_pairs_block_kernel(const I* __restrict__ token, const J* __restrict__ expert, std::int64_t P,
                               std::int64_t T, std::int64_t E, std::int64_t K, std::int32_t* __restrict__ pair_token,
                               std::int32_t* __restrict__ block_max, const IndexCheck check) {
  __shared__ typename ConvertScan::TempStorage temp;
  const std::int64_t p0 = static_cast<std::int64_t>(blockIdx.x) * kConvertPairsPerBlock +
                          static_cast<std::int64_t>(threadIdx.x) * kConvertPerThread;
  std::int32_t v[kConvertPerThread];
  for (int i = 0; i < kConvertPerThread; ++i) {
    const std::int64_t p = p0 + i;
    v[i] = p < P ? routable_token(token, expert, p, T, E) : -1;
    if (p >= P || check.claim == nullptr) continue;
    const std::int64_t t = static_cast<std::int64_t>(token[p]), e = static_cast<std::int64_t>(expert[p]);
    if (t < 0 || t >= T) {
      record_violation(check, IndexViolation::kTokenRange, p, t, T);
    } else if (e < 0 || e >= E) {
      record_violation(check, IndexViolation::kExpertRange, p, e, E);
    } else if (p > 0) {
      const std::int64_t before = static_cast<std::int64_t>(token[p - 1]);
      if (before > t) {
        record_violation(check, IndexViolation::kTokenOrder, p, t, before);
      } else if (p >= K && static_cast<std::int64_t>(token[p - K]) == t) {
        // Ascending up to here, so pairs p - K .. p all belong to token t: one more than K (the CPU's rule).
        record_violation(check, IndexViolation::kTokenRun, p, t, K);
      }
    }
  }
  std::int32_t block_total;
  ConvertScan(temp).InclusiveScan(v, v, MaxOp{}, block_total);
  for (int i = 0; i < kConvertPerThread; ++i)
    if (p0 + i < P) pair_token[p0 + i] = v[i];
  if (threadIdx.x == 0) block_max[blockIdx.x] = block_total;
}

/// Step 2 (one block): block_max[b] <- the maximum of block_max[0 .. b), -1 for block 0, in place.
__global__ void __launch_bounds__(kConvertThreads) convert_pairs_carry_kernel(std::int32_t* __restrict__ block_max,
                                                                             std::int64_t blocks) {
  __shared__ typename ConvertScan::TempStorage temp;
  __shared__ std::int32_t carry_s;
  if (threadIdx.x == 0) carry_s = -1;
  __syncthreads();
  for (std::int64_t base = 0; base < blocks; base += kConvertThreads) {
    const std::int64_t b = base + threadIdx.x;
    const std::int32_t own = b < blocks ? block_max[b] : -1;
    std::int32_t before, total;
    ConvertScan(temp).ExclusiveScan(own, before, carry_s, MaxOp{}, total);
    if (b < blocks) block_max[b] = before;
    __syncthreads();  // every thread has read carry_s and temp
    if (threadIdx.x == 0) carry_s = max(carry_s, total);
    __syncthreads();
  }
}

/// Step 3: each pair's token becomes the running maximum (its block's carry added), floored at 0: pairs before the
/// first valid token get token 0, which keeps the tokens ascending. The pair keeps its expert only if its own token is
/// valid and equal to that token and the pair K places before it has another (so no token has more than K routed
/// pairs); else it gets -1. pair_token is finished in place, so the read of pair p - K can see step 1's value or the
/// finished one: adding the carry of its block and the floor gives the finished value from either.
template <class I, class J>
__global__ void convert_pairs_finish_kernel(const I* __restrict__ token, const J* __restrict__ expert, std::int64_t P,
                                            std::int64_t T, std::int64_t E, std::int64_t K,
                                            const std::int32_t* __restrict__ carry, std::int32_t* pair_token,
                                            std::int32_t* __restrict__ pair_expert) {
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const auto finished = [&](std::int64_t q) {
    return max(max(pair_token[q], carry[q / kConvertPairsPerBlock]), 0);
  };
  const std::int32_t running = finished(p);
  bool routed = routable_token(token, expert, p, T, E) == running;  // -1 (not routable) never equals running
  if (routed && p >= K) routed = finished(p - K) != running;
  pair_expert[p] = routed ? static_cast<std::int32_t>(expert[p]) : -1;
  pair_token[p] = running;
}

constexpr int kGroupedThreads = 256;
constexpr std::int64_t kGroupedRowsPerBlock = 2048;
// Counts are clamped to this magnitude before they are summed: no valid count (rows < 2^31) changes, and the sum of
// up to 65536 of them cannot overflow.
constexpr std::int64_t kCountClamp = std::int64_t{1} << 40;

/// Each block writes the experts of its kGroupedRowsPerBlock rows: it scans the counts in chunks of kGroupedThreads
/// experts and finds each of its rows that a chunk covers by a binary search over the chunk's running ends (shared
/// memory). Rows no chunk covers keep expert E. Block 0 scans every count and, with checking on, validates them.
template <class C, class O>
__global__ void __launch_bounds__(kGroupedThreads)
    grouped_expert_index_kernel(const C* __restrict__ counts, int E, O* __restrict__ expert_index, std::int64_t rows,
                                const IndexCheck check) {
  using Scan = cub::BlockScan<std::int64_t, kGroupedThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ std::int64_t ends[kGroupedThreads];
  __shared__ std::int64_t carry_s;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * kGroupedRowsPerBlock;
  const std::int64_t r1 = min(rows, r0 + kGroupedRowsPerBlock);
  for (std::int64_t r = r0 + threadIdx.x; r < r1; r += kGroupedThreads) expert_index[r] = static_cast<O>(E);
  if (threadIdx.x == 0) carry_s = 0;
  __syncthreads();
  const bool validate = blockIdx.x == 0 && check.claim != nullptr;
  for (int base = 0; base < E; base += kGroupedThreads) {
    const std::int64_t carry = carry_s;
    if (!validate && carry >= r1) break;  // carry is uniform across the block: every thread leaves together
    const int e = base + static_cast<int>(threadIdx.x);
    const int n = min(kGroupedThreads, E - base);
    std::int64_t c = 0;
    if (e < E) {
      const std::int64_t raw = static_cast<std::int64_t>(counts[e]);
      if (validate && raw < 0) record_violation(check, IndexViolation::kCountNegative, e, raw, 0);
      c = max(-kCountClamp, min(kCountClamp, raw));
    }
    std::int64_t inclusive, total;
    Scan(temp).InclusiveSum(c, inclusive, total);
    ends[threadIdx.x] = carry + inclusive;
    __syncthreads();
    for (std::int64_t r = max(r0, carry) + threadIdx.x; r < min(r1, carry + total); r += kGroupedThreads) {
      int lo = 0, hi = n - 1;  // first i with ends[i] > r; clamped to the chunk when negative counts break the order
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ends[mid] > r) hi = mid;
        else lo = mid + 1;
      }
      expert_index[r] = static_cast<O>(base + lo);
    }
    __syncthreads();  // ends and temp are reused by the next chunk
    if (threadIdx.x == 0) carry_s = carry + total;
    __syncthreads();
  }
  if (validate && threadIdx.x == 0 && carry_s != rows)
    record_violation(check, IndexViolation::kCountTotal, -1, carry_s, rows);
}

}  // namespace

void launch_convert_pairs(const void* token, DType token_dt, const void* expert, DType expert_dt, std::int64_t P,
                          std::int64_t T, std::int64_t E, std::int64_t K, std::int32_t* pair_token,
                          std::int32_t* pair_expert, std::int32_t* scratch, const IndexCheck& check,
                          cudaStream_t stream) {
  if (P == 0) return;
  const std::int64_t blocks = (P + kConvertPairsPerBlock - 1) / kConvertPairsPerBlock;
  auto run = [&](auto tok_tag, auto exp_tag) {
    using I = decltype(tok_tag);
    using J = decltype(exp_tag);
    const I* tok = static_cast<const I*>(token);
    const J* exp = static_cast<const J*>(expert);
    convert_pairs_block_kernel<I, J><<<static_cast<unsigned>(blocks), kConvertThreads, 0, stream>>>(
        tok, exp, P, T, E, K, pair_token, scratch, check);
    MACHMOE_CUDA_CHECK_LAUNCH("convert_pairs_block");
    convert_pairs_carry_kernel<<<1, kConvertThreads, 0, stream>>>(scratch, blocks);
    MACHMOE_CUDA_CHECK_LAUNCH("convert_pairs_carry");
    convert_pairs_finish_kernel<I, J><<<ceil_div(P, 256), 256, 0, stream>>>(tok, exp, P, T, E, K, scratch,
                                                                              pair_token, pair_expert);
    MACHMOE_CUDA_CHECK_LAUNCH("convert_pairs_finish");
  };
  const bool t64 = token_dt == DType::kInt64, e64 = expert_dt == DType::kInt64;
  if (t64 && e64) run(std::int64_t{}, std::int64_t{});
  else if (t64) run(std::int64_t{}, std::int32_t{});
  else if (e64) run(std::int32_t{}, std::int64_t{});
  else run(std::int32_t{}, std::int32_t{});
}

std::int64_t convert_pairs_scratch_entries(std::int64_t P) {
  return (P + kConvertPairsPerBlock - 1) / kConvertPairsPerBlock;
}

void launch_grouped_expert_index(const void* counts, DType counts_dt, std::int64_t E, void* expert_index,
                                 DType index_dt, std::int64_t rows, const IndexCheck& check, cudaStream_t stream) {
  // No rows and nothing to validate: no launch. With checking on, one block still validates the counts.
  const std::int64_t blocks = (rows + kGroupedRowsPerBlock - 1) / kGroupedRowsPerBlock;
  if (blocks == 0 && check.claim == nullptr) return;
  const unsigned grid = static_cast<unsigned>(blocks > 0 ? blocks : 1);
  auto run = [&](auto count_tag, auto index_tag) {
    using C = decltype(count_tag);
    using O = decltype(index_tag);
    grouped_expert_index_kernel<C, O><<<grid, kGroupedThreads, 0, stream>>>(
        static_cast<const C*>(counts), static_cast<int>(E), static_cast<O*>(expert_index), rows, check);
  };
  const bool c64 = counts_dt == DType::kInt64, o64 = index_dt == DType::kInt64;
  if (c64 && o64) run(std::int64_t{}, std::int64_t{});
  else if (c64) run(std::int64_t{}, std::int32_t{});
  else if (o64) run(std::int32_t{}, std::int64_t{});
  else run(std::int32_t{}, std::int32_t{});
  MACHMOE_CUDA_CHECK_LAUNCH("grouped_expert_index");
}

}  // namespace machmoe::gpu
