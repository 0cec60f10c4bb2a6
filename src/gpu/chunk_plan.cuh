// The plan of a grouped GEMM run one chunk of tokens at a time (DxChunkPlan, kernels.hpp): the forward's Y in chunks
// and the backward's dX~ in chunks (memory.hpp, forward_y_chunks and backward_dx_chunks). Chunk c holds the tokens
// [t0, t1), t0 the first token whose first pair is at or past c * pairs_per_chunk (the last chunk ends at T); the
// pieces every kernel that builds such a plan shares: where a chunk starts, and the per-expert scan that writes it.
#pragma once

#include <cstdint>

#include "gpu/device_math.cuh"
#include "gpu/expert_scan.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {

/// Threads of a block that writes a chunk's plan (write_chunk_plan).
inline constexpr int kChunkPlanThreads = 256;

/// Smallest token t in [0, T] whose first pair is at or past q (first pair of t: token_offsets[t], or t K). One
/// thread: a binary search over the token offsets.
__device__ inline std::int64_t first_token_at(std::int64_t q, const std::int32_t* token_offsets, std::int64_t K,
                                              std::int64_t T) {
  if (q <= 0) return 0;
  if (token_offsets == nullptr) return min(T, (q + K - 1) / K);
  std::int64_t lo = 0, hi = T;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi) / 2;
    if (token_offsets[mid] >= q) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/// first_token_at for two pair positions q[0] and q[1] at once, by the whole block (every thread calls it, q
/// uniform): each step probes kThreads evenly spaced tokens of the range left instead of one, so a range of T tokens
/// takes ceil(log_kThreads T) dependent loads (2 for T = 40960 at 256 threads) where the binary search takes
/// log2 T (16). The two searches run in lockstep. A query of kPastLastToken answers T.
inline constexpr std::int64_t kPastLastToken = -1;
template <int kThreads>
__device__ void block_first_tokens_at(const std::int64_t (&q)[2], const std::int32_t* token_offsets, std::int64_t T,
                                      std::int64_t (&t)[2]) {
  std::int64_t lo[2], hi[2];  // each answer lies in [lo, hi]; the tokens before lo start below q
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    lo[j] = q[j] == kPastLastToken ? T : 0;
    hi[j] = q[j] == kPastLastToken || q[j] <= 0 ? lo[j] : T;
  }
  while (lo[0] < hi[0] || lo[1] < hi[1]) {  // uniform: lo and hi follow from block-wide counts
    std::int64_t step[2];
    bool below[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // every load of the step before the counts
      step[j] = (hi[j] - lo[j] + kThreads - 1) / kThreads;
      const std::int64_t pos = lo[j] + static_cast<std::int64_t>(threadIdx.x) * step[j];
      below[j] = lo[j] < hi[j] && pos < hi[j] && token_offsets[pos] < q[j];
    }
    // The probes below q are a prefix of them (the offsets ascend): the answer is past the last of them and at or
    // before the next probe.
    const int count[2] = {__syncthreads_count(below[0]), __syncthreads_count(below[1])};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (lo[j] >= hi[j]) continue;
      if (count[j] == 0) {
        hi[j] = lo[j];
      } else {
        const std::int64_t last_below = lo[j] + (count[j] - 1) * step[j];
        lo[j] = last_below + 1;
        hi[j] = min(hi[j], last_below + step[j]);
      }
    }
  }
  t[0] = lo[0], t[1] = lo[1];
}

/// Chunk c's part of a DxChunkPlan: its first token, the last chunk's end, and per expert the exclusive scans of its
/// rows and GEMM tiles in the chunk and its shift. locate(e, first) returns expert e's rows in the chunk and sets
/// `first` to the first of them in grouped order. Called by every thread of a kChunkPlanThreads block. With
/// write_plan false nothing goes to the plan; shift_copy (shared memory, E entries, may be null) receives the shifts
/// either way, for the block's own use after a barrier.
template <class Locate>
__device__ void write_chunk_plan(const DxChunkPlan& plan, int E, std::int64_t c, std::int64_t chunks, std::int64_t t0,
                                 std::int64_t T, Locate locate, bool write_plan = true,
                                 std::int32_t* shift_copy = nullptr) {
  // (DxChunkPlan's accessors are host code: kernels.hpp is plain C++)
  std::int32_t* off = plan.offsets + c * (E + 1);
  std::int32_t* tiles = plan.tiles + c * (E + 1);
  std::int32_t* shift = plan.shifts + c * E;
  if (write_plan && threadIdx.x == 0) {
    plan.bounds[c] = static_cast<std::int32_t>(t0);
    if (c == chunks - 1) plan.bounds[chunks] = static_cast<std::int32_t>(T);
  }
  std::int32_t first = 0;  // this thread's expert: the first grouped row of its rows in the chunk
  std::int32_t total_rows, total_tiles;
  scan_expert_rows_and_tiles<kChunkPlanThreads>(
      E, [&](int e) { return locate(e, first); },
      [&](int e, std::int32_t, std::int32_t, std::int32_t rows_before, std::int32_t tiles_before) {
        if (write_plan) {
          off[e] = rows_before;
          tiles[e] = tiles_before;
          shift[e] = first - rows_before;
        }
        if (shift_copy) shift_copy[e] = first - rows_before;
      },
      total_rows, total_tiles);
  if (write_plan && threadIdx.x == 0) off[E] = total_rows, tiles[E] = total_tiles;
}

/// Chunks of a plan built by plan_chunk_and_pair_rows, and the grid of blocks that builds it: chunks x splits blocks
/// of kChunkPlanThreads, splits enough for about kChunkPlanPairsPerBlock pairs a block (at most kChunkPlanMaxSplits a
/// chunk; the blocks of a chunk stride over its pairs), and the dynamic shared memory they need (E <=
/// kFusedPlanMaxExperts).
inline constexpr std::int64_t kChunkPlanPairsPerBlock = 1024;
inline constexpr std::int64_t kChunkPlanMaxSplits = 256;
inline dim3 chunk_plan_grid(std::int64_t chunks, std::int64_t pairs_per_chunk) {
  const std::int64_t splits = (pairs_per_chunk + kChunkPlanPairsPerBlock - 1) / kChunkPlanPairsPerBlock;
  return dim3(static_cast<unsigned>(chunks),
              static_cast<unsigned>(splits < 1 ? 1 : splits > kChunkPlanMaxSplits ? kChunkPlanMaxSplits : splits));
}
inline std::size_t chunk_plan_shared_bytes(std::int64_t E) { return (2 * static_cast<std::size_t>(E) + 1) * 4; }

/// Block (c, s) of a chunk plan and of the pairs' rows in their chunks, in one pass: chunk c's tokens [t0, t1) (t K
/// pairs a token without token offsets, else block-wide searches of them), every expert's rows in the chunk from
/// rows_in(offsets_s, e, t0, t1, first) (which returns them and sets `first` to the first, in grouped order; the
/// expert offsets are in shared memory by then), their scan (write_chunk_plan; block s = 0 writes the plan); then a
/// share of the chunk's pairs, strided over the chunk's blocks, gets each pair's row in its chunk, pair_rows[p] =
/// inverse[p] - the shift of the pair's expert (found by binary search among the offsets in shared memory), or -1 for
/// a pair routed nowhere. Needs chunk_plan_shared_bytes(E) of dynamic shared memory and the chunk_plan_grid.
template <class RowsIn>
__device__ void plan_chunk_and_pair_rows(const std::int32_t* expert_offsets, const std::int32_t* token_offsets,
                                         std::int64_t K, std::int64_t T, int E, const std::int32_t* inverse,
                                         std::int64_t chunks, std::int64_t pairs_per_chunk, const DxChunkPlan& plan,
                                         std::int32_t* pair_rows, RowsIn rows_in) {
  extern __shared__ std::int32_t plan_s[];  // the expert offsets (E + 1), then the chunk's shifts (E)
  std::int32_t* offsets_s = plan_s;
  std::int32_t* shift_s = plan_s + E + 1;
  const std::int64_t c = blockIdx.x;
  for (int e = threadIdx.x; e <= E; e += kChunkPlanThreads) offsets_s[e] = expert_offsets[e];
  __syncthreads();
  const std::int64_t q[2] = {c * pairs_per_chunk, c == chunks - 1 ? kPastLastToken : (c + 1) * pairs_per_chunk};
  std::int64_t t[2];
  if (token_offsets != nullptr) {
    block_first_tokens_at<kChunkPlanThreads>(q, token_offsets, T, t);
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) t[j] = q[j] == kPastLastToken ? T : first_token_at(q[j], nullptr, K, T);
  }
  write_chunk_plan(
      plan, E, c, chunks, t[0], T, [&](int e, std::int32_t& first) { return rows_in(offsets_s, e, t[0], t[1], first); },
      blockIdx.y == 0, shift_s);
  __syncthreads();  // every shift in shared memory
  const std::int64_t b0 = token_offsets ? token_offsets[t[0]] : t[0] * K;
  const std::int64_t b1 = token_offsets ? token_offsets[t[1]] : t[1] * K;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.y) * kChunkPlanThreads;
  for (std::int64_t p = b0 + static_cast<std::int64_t>(blockIdx.y) * kChunkPlanThreads + threadIdx.x; p < b1;
       p += stride) {
    const std::int32_t g = inverse[p];
    pair_rows[p] = g < 0 ? -1 : g - shift_s[expert_of_row(offsets_s, E, g)];
  }
}

}  // namespace machmoe::gpu
