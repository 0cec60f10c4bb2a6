// Token rounding on the device (docs/SPEC.md §5, docs/ROUTING.md): selection and the whole routing metadata in
// three kernels, no sort, no host synchronisation, no floating-point atomics.
//
// Ranking. Every (token t, expert e) gets one 32-bit key whose unsigned order is the reference's S' order:
//   chosen by t (token choice): 0x80000000 | bits(TC score)      (TC scores are in [0, 1]: bits are monotone)
//   otherwise:                  bits(softmax(z_t)[e])            (in [0, 1], so always below every chosen key)
// Ties go to the lower token. The reference ranks the others by p - 1 in its own precision; ranking by p itself
// is the same order without the fp32 cancellation of p - 1 (which would tie every p closer than 6e-8).
// The score a kept pair carries is in its key: the TC score (low 31 bits) or p.
//
// 1. keys (one warp per token, the row in registers for E <= 512): token choice by the top-K kernel's selection
//    (RankKey: 32-bit keys for bf16, one redux per round; for rows of up to 256 each lane's keys sorted once, as the
//    top-K kernel does), the TC scores of the score variant, the row's softmax (each exp kept for the keys), the keys,
//    the selection's statistics and a copy of the logits for the backward (so no separate copy reads them again), the
//    token-choice counts f_e (a shared histogram per block, then one integer atomic per expert and block: sums, so the
//    order of the atomics cannot show). The block writes its keys expert-major through a shared-memory transpose filled
//    from the registers that hold them (rows of more than 512 experts go through the token-major keys in memory
//    instead, and the transpose reads them back).
// 2. select, bounded (one block per expert; see tr_select_bounded_kernel): the keys kernel also writes, per expert
//    and block of 32 tokens, the largest unchosen and the smallest chosen key and the mask of chosen tokens; from
//    them the few keys that can hold the threshold are read (only the blocks that can hold one), the threshold found
//    among them, and the kept tokens written from the masks. Each select CTA first sums the rounded counts r_e' and
//    GEMM tiles of the experts before its own, and writes its expert's offset, tiles and count (so the keys kernel
//    needs no completion count and no last-block scan, whose fence and barrier every one of its blocks paid). Each
//    select writes, per expert and block, the mask of the kept tokens and the grouped row of the first of them, per
//    grouped row the pair's score, and adds each block's kept pairs to that block's count and to its group's (32
//    blocks), integer atomics whose order cannot show.
//    Experts with too many such keys (repeated tokens) are flagged for the full select:
// 2'. select (one block per expert): the r_e-th key of the expert's column by a 3-pass radix select (12, 12 and 8
//    bits, a shared histogram with one atomic per distinct digit of a warp) over the column, held in shared
//    memory when it fits. Experts whose count needs no rounding (r_e = f_e, 0 or T) skip it. When keys tie at the
//    threshold and only some of the ties are kept, one ordered pass finds the token where they stop (the cut).
//    Then the kept tokens, ascending, go to gather at the expert's offset (per-warp chunks, ballots), with the
//    blocks' kept masks and first grouped rows as the bounded select writes them.
// 3. emit (32 warps per block, each over 2 consecutive tokens): kept(t, e) from the select's kept masks, counted
//    per token and scanned within the block; the block's first pair is the sum of the selects' kept counts of the
//    groups and blocks before it, so no block waits for another (a decoupled look-back did that before: ncu put 37 %
//    of the kernel's stall samples on the barrier behind it, H200, 1.4B (1024,32,2)). Then every kept pair in
//    (token, expert) order gets its grouped row (the block's first kept row plus the kept tokens before it in the
//    mask), score, inverse and scatter, and the token offsets are written. Slots past the pair count get expert -1
//    semantics (inverse -1, score 0).
// 4. Where the forward computes Y in chunks of tokens, their plan (tr_chunk_plan_kernel): each chunk's experts' rows
//    from the per-block first kept rows and kept masks at the chunk's two boundary tokens, each routed pair's row in
//    its chunk (what the top-K metadata builds from its tile histograms, and launch_dx_chunk_plan by searching).
// Launches: the selects, the emit and the plan are programmatic dependent launches (dependent_launch.cuh): each may be
// placed on the GPU while the kernel before it drains, and waits for that kernel's completion before it reads its
// results.
// Cost: the logits are read once, the keys written once expert-major (twice for E > 512) and read back only at the
// experts' boundaries and for the kept pairs; no per-expert loop runs over the token-choice lists.
//
// Backward: one warp per token takes the token's choices from the statistics the keys kernel saved (the K-th
// choice's rank key, the sums of exp, the row's max; the exponentials recomputed by the same expression, so every
// score is bitwise the forward's), places the token's pair gradients by expert (in registers for rows of up to 128
// experts, else in shared memory), and writes dz in one pass with fixed-order warp sums.
#include <algorithm>
#include <map>
#include <mutex>
#include <type_traits>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include "gpu/chunk_plan.cuh"
#include "gpu/cuda_check.hpp"
#include "gpu/dependent_launch.cuh"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

constexpr std::uint32_t kChosen = 0x80000000u;
constexpr unsigned kFull = 0xffffffffu;

// Pass 1.
constexpr int kKeyWarps = 16;
constexpr int kKeyTokens = 32;  // per block: 2 tokens per warp, one 32-token transpose
constexpr int kKeyTokensPerWarp = kKeyTokens / kKeyWarps;
constexpr int kKeyHistBins = 4096;  // block histogram of choices for E <= this; larger E adds to global directly
constexpr int kTransposeExperts = 64;
// Pass 2.
constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectBins = 4096;
constexpr int kSelectUnroll = 4;  // keys per thread and trip of a radix pass's histogram loop
constexpr int kSelectMaxCluster = 4;              // CTAs per expert at most (a portable cluster size)
constexpr std::int64_t kSelectClusterMinTokens = 8192;  // below this a column is one CTA's
// Pass 3. Each warp takes kEmitTokensPerWarp consecutive tokens. Measured when the blocks still found their first pair
// by a look-back over their predecessors (token-rounding stage with 1 / 2 / 4 / 8 tokens per warp, same call, two
// rounds; docs/BENCHMARKS.md, session 36): 2 was 1-6 % faster than 1 on every row tried, 4 about as fast as 2, 8 12 %
// slower than 1 where E = 256 (more keys per token and warp).
constexpr int kEmitWarps = 32;
constexpr int kEmitTokensPerWarp = 2;
constexpr int kEmitTokens = kEmitWarps * kEmitTokensPerWarp;  // per block
// Backward.
constexpr int kBwdWarps = 8;
constexpr int kBwdWindow = 512;  // experts whose pair gradients a warp holds in shared memory at a time
template <int PerLane>
constexpr bool kBwdGradientsInRegisters = PerLane >= 1 && PerLane <= 4;  // see tr_backward_token

static_assert(kKeyTokens == 32, "the transpose writes one 32-token row segment per expert, a warp's");
static_assert(kEmitWarps == 32, "warp 0 scans the emit block's per-warp counts");

__device__ __forceinline__ std::int64_t rounded_count(std::int64_t f, std::int64_t T, std::int64_t M,
                                                      RoundingRule rule) {
  const std::int64_t down = (f / M) * M;
  const std::int64_t up = min(((f + M - 1) / M) * M, T);
  if (rule == RoundingRule::kDown) return down;
  if (rule == RoundingRule::kUp) return up;
  return (up - f < f - down) ? up : down;
}

__device__ __forceinline__ bool kept(std::uint32_t key, std::uint32_t thr, std::uint32_t cut, std::int64_t t) {
  return key > thr || (key == thr && t < static_cast<std::int64_t>(cut));
}

/// Warp-wide, lane l holding the kept mask m of block blk = c0 + l (0 past the warp's blocks): the block's kept pairs
/// added to its count and to its group's (32 blocks), which the emit pass sums into its first pair. Integer adds: the
/// totals do not depend on their order.
__device__ __forceinline__ void add_kept_counts(std::int32_t* block_kept, std::int32_t* group_kept, std::int64_t c0,
                                                std::int64_t blk, std::uint32_t m) {
  const int n = __popc(m);
  if (n != 0) atomicAdd(&block_kept[blk], n);
  const std::int64_t first_group = c0 / 32;  // a warp's 32 blocks lie in at most two groups
  const bool in_first = blk / 32 == first_group;
  const int n_first = __reduce_add_sync(kFull, in_first ? n : 0);
  const int n_second = __reduce_add_sync(kFull, in_first ? 0 : n);
  if ((threadIdx.x & 31) == 0) {
    if (n_first != 0) atomicAdd(&group_kept[first_group], n_first);
    if (n_second != 0) atomicAdd(&group_kept[first_group + 1], n_second);
  }
}

/// A token's row as the warp sees it: lane l owns elements l, l + 32, ... (slot j holds element 32 j + l), in
/// registers for PerLane > 0, else read from memory on each use. Holds the top-K selection's outcome (the K-th
/// selected rank key, the top value and the sum of exp over the selection) and the row's softmax (max, sum of
/// exp), all computed in the order the top-K kernel uses, so the scores are bitwise those of launch_topk_scores.
template <class T, int PerLane>
struct RowSelection {
  static constexpr bool kRegs = PerLane > 0;
  // Rows in registers have at most 512 elements: bf16's 32-bit key holds them. Rows read from memory may be longer.
  using Key = RankKey<std::conditional_t<kRegs, T, float>>;
  using KeyType = typename Key::Type;
  static_assert(32 * PerLane <= Key::kMaxRow, "row longer than the rank key holds");
  const T* row;
  int E, lane, slots;
  float v[kRegs ? PerLane : 1];
  float ex[kRegs ? PerLane : 1];  // exp(v - max), kept by select (or restore)
  KeyType key[kRegs ? PerLane : 1];
  KeyType kth = ~KeyType{0};
  float first = 0.0f, sum_k = 0.0f, m = -INFINITY, total = 0.0f;

  __device__ __forceinline__ RowSelection(const T* r, int E_, int lane_) : row(r), E(E_), lane(lane_) {
    slots = kRegs ? PerLane : (E + 31) / 32;
    if constexpr (kRegs) {
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        const int i = j * 32 + lane;
        v[j] = i < E ? to_float(row[i]) : 0.0f;
        key[j] = i < E ? Key::make(v[j], i) : 0u;  // 0: below every element of the row
      }
    }
  }
  __device__ __forceinline__ float value(int j) const {
    if constexpr (kRegs) return v[j];
    else return to_float(row[j * 32 + lane]);
  }
  __device__ __forceinline__ KeyType rank(int j) const {
    if constexpr (kRegs) return key[j];
    else return Key::make(to_float(row[j * 32 + lane]), j * 32 + lane);
  }
  /// f(j) for the slots j in [lo, hi) that hold an element; constant slot indices for the register variant.
  template <class F>
  __device__ __forceinline__ void for_each(int lo, int hi, F&& f) const {
    if constexpr (kRegs) {
#pragma unroll
      for (int j = 0; j < PerLane; ++j)
        if (j >= lo && j < hi && j * 32 + lane < E) f(j);
    } else {
      for (int j = lo; j < hi; ++j)
        if (j * 32 + lane < E) f(j);
    }
  }
  __device__ __forceinline__ void select(int K) {
    if constexpr (kRegs && PerLane <= 8) {
      // As the top-K kernel selects (router_kernels.cu): each lane's keys sorted once, so a round's candidate is the
      // lane's first key and the winning lane moves its next one up; lane r keeps selection r (K <= 32), and the
      // selection's exponentials come once after the rounds, summed in selection order. The same selections, kth,
      // first and sum_k as the pass below, bit for bit.
      KeyType sorted[PerLane];
#pragma unroll
      for (int j = 0; j < PerLane; ++j) sorted[j] = key[j];
      sort_keys_descending<PerLane>(sorted);
      KeyType prev = ~KeyType{0}, mine = 0;
      for (int r = 0; r < K; ++r) {
        prev = Key::warp_max(sorted[0]);
        if (sorted[0] == prev) {
#pragma unroll
          for (int j = 0; j + 1 < PerLane; ++j) sorted[j] = sorted[j + 1];
          sorted[PerLane - 1] = 0;  // below every element: this lane has nothing left
        }
        if (r == 0) first = Key::value(prev);
        if (K <= 32) mine = r == lane ? prev : mine;
        else sum_k += expf(Key::value(prev) - first);
      }
      if (K <= 32) {
        const float mine_exp = lane < K ? expf(Key::value(mine) - first) : 0.0f;
        for (int r = 0; r < K; ++r) sum_k += __shfl_sync(kFull, mine_exp, r);
      }
      kth = prev;
    } else {
      KeyType prev = ~KeyType{0};
      for (int r = 0; r < K; ++r) {
        KeyType best = 0;
        for_each(0, slots, [&](int j) {
          const KeyType k = rank(j);
          best = (k < prev && k > best) ? k : best;
        });
        prev = Key::warp_max(best);
        const float sel = Key::value(prev);
        if (r == 0) first = sel;  // selections come in descending order: the first is the selection's maximum
        sum_k += expf(sel - first);
      }
      kth = prev;
    }
    // The full softmax, in the order of warp_row_max / warp_row_sumexp (per-lane slots, then a fixed butterfly). Rows
    // in registers keep each exp(x - max) for prob.
    float mx = -INFINITY;
    for_each(0, slots, [&](int j) { mx = fmaxf(mx, value(j)); });
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    float s = 0.0f;
    for_each(0, slots, [&](int j) {
      const float x = expf(value(j) - mx);
      if constexpr (kRegs) ex[j] = x;
      s += x;
    });
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
    m = mx, total = s;
  }
  /// The selection as select(K) left it, for the router backward: everything but the exponentials comes from the
  /// forward's saved statistics; those are exp(x - max) again, the same expression, so every probability, TC score
  /// and choice below is bitwise the forward's.
  __device__ __forceinline__ TokenSelectionStats stats() const {
    return {static_cast<std::uint64_t>(kth), first, sum_k, m, total};
  }
  __device__ __forceinline__ void restore(const TokenSelectionStats& s) {
    kth = static_cast<KeyType>(s.kth), first = s.first, sum_k = s.sum_k, m = s.max, total = s.sum;
    if constexpr (kRegs) for_each(0, slots, [&](int j) { ex[j] = expf(value(j) - m); });
  }
  __device__ __forceinline__ bool chosen(int j) const { return rank(j) >= kth; }
  /// Slot j's full-softmax probability, exp(x - max) / sum (the exponential kept by select or restore for rows in
  /// registers).
  __device__ __forceinline__ float prob(int j) const {
    if constexpr (kRegs) return ex[j] / total;
    else return expf(value(j) - m) / total;
  }
  /// TC score of slot j, a chosen element: the softmax over the selection (renormalised variants, as
  /// launch_topk_scores computes it) or the full-softmax probability.
  __device__ __forceinline__ float tc_score(ScoreVariant variant, int j) const {
    return variant == ScoreVariant::kTopKOfSoftmax ? prob(j) : expf(value(j) - first) / sum_k;
  }
};

// ---- pass 1: keys, token-choice counts, expert offsets -----------------------------------------------------------

template <class T, int PerLane>
__global__ void __launch_bounds__(32 * kKeyWarps)
    tr_keys_kernel(const T* __restrict__ z, std::int64_t ld, std::int64_t T_, int E, int K, ScoreVariant variant,
                   std::uint32_t* keys, std::uint32_t* keys_by_expert, std::uint32_t* bounds,
                   TokenSelectionStats* __restrict__ selection, T* __restrict__ logits_copy, std::int32_t* tc_count) {
  __shared__ std::int32_t hist[kKeyHistBins];
  __shared__ std::uint32_t tile[kTransposeExperts][kKeyTokens + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool local_hist = E <= kKeyHistBins;
  if (local_hist)
    for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * kKeyTokens;
  constexpr bool kRegs = PerLane > 0;
  // Rows in registers keep their keys there for the transpose below (slot j of token r: kk[r][j]).
  std::uint32_t kk[kKeyTokensPerWarp][kRegs ? PerLane : 1];
#pragma unroll
  for (int r = 0; r < kKeyTokensPerWarp; ++r) {
    const std::int64_t t = t0 + warp * kKeyTokensPerWarp + r;
    if (t >= T_) break;  // warp-uniform
    RowSelection<T, PerLane> row(z + t * ld, E, lane);
    if (logits_copy) {  // the backward's copy, bit for bit, from the row just loaded (in L1)
      T* copy = logits_copy + t * E;
      const T* src = z + t * ld;
      if constexpr (kRegs) {
#pragma unroll
        for (int j = 0; j < PerLane; ++j)
          if (j * 32 + lane < E) copy[j * 32 + lane] = src[j * 32 + lane];
      } else {
        for (int i = lane; i < E; i += 32) copy[i] = src[i];
      }
    }
    row.select(K);
    if (lane == 0) selection[t] = row.stats();  // for the router backward
    row.for_each(0, row.slots, [&](int j) {
      const int i = j * 32 + lane;
      std::uint32_t key;
      if (row.chosen(j)) {
        key = kChosen | __float_as_uint(row.tc_score(variant, j));
        if (local_hist) atomicAdd(&hist[i], 1);
        else atomicAdd(&tc_count[i], 1);
      } else {
        key = __float_as_uint(row.prob(j));
      }
      if constexpr (kRegs)
        kk[r][j] = key;
      else
        keys[t * E + i] = key;  // the token-major row, read back by the transpose below
    });
  }
  __syncthreads();  // also makes this block's key rows visible to all its threads
  if (local_hist)
    for (int i = threadIdx.x; i < E; i += blockDim.x)
      if (hist[i] != 0) atomicAdd(&tc_count[i], hist[i]);
  // Transpose the block's keys into the expert-major keys: 64 experts x 32 tokens at a time, one 128-byte row
  // segment per expert written by a warp. Rows in registers fill the tile from there (experts [64 g, 64 g + 64) are
  // slots 2 g and 2 g + 1); longer rows read back the key rows this block wrote (not through the read-only path).
  const int nt = static_cast<int>(min(static_cast<std::int64_t>(kKeyTokens), T_ - t0));
  auto write_tile = [&](int e0) {
    __syncthreads();
    // Warp w writes the tile rows of experts e0 + w, e0 + w + kKeyWarps, ... (kKeyTokens == 32 tokens, a lane each)
    // and reduces the block's bounds from each: the largest key not chosen (0 if none), the smallest chosen key (all
    // ones if none) and the mask of chosen tokens, per (expert, block). Lanes past the last token hold key 0, neutral
    // to all three.
    // A warp's addresses are computed once per tile and stepped by a fixed stride per expert, the tile's experts
    // unrolled: the per-expert loop with its 64-bit products was about a fifth of this kernel's executed instructions
    // on 1.4B (256,128,8) (ncu source view).
    const bool token = lane < nt;
    const int experts = min(kTransposeExperts, E - e0);
    std::uint32_t* key_out = keys_by_expert + static_cast<std::int64_t>(e0 + warp) * T_ + t0 + lane;
    uint4* bounds_out =
        reinterpret_cast<uint4*>(bounds) + static_cast<std::int64_t>(e0 + warp) * gridDim.x + blockIdx.x;
    const std::int64_t key_step = static_cast<std::int64_t>(kKeyWarps) * T_;
    const std::int64_t bounds_step = static_cast<std::int64_t>(kKeyWarps) * gridDim.x;
    static_assert(kTransposeExperts % kKeyWarps == 0, "every warp takes the same number of a tile's experts");
#pragma unroll
    for (int i = 0; i < kTransposeExperts / kKeyWarps; ++i) {
      const int ec = warp + i * kKeyWarps;
      if (ec >= experts) break;  // warp-uniform
      const std::uint32_t key = token ? tile[ec][lane] : 0u;
      if (token) *key_out = key;
      const bool chosen = (key & kChosen) != 0u;
      const std::uint32_t hi = __reduce_max_sync(kFull, chosen ? 0u : key);
      const std::uint32_t lo = __reduce_min_sync(kFull, chosen ? key : ~0u);
      const unsigned mask = __ballot_sync(kFull, chosen);
      if (lane == 0) *bounds_out = make_uint4(hi, lo, mask, 0u);
      key_out += key_step;
      bounds_out += bounds_step;
    }
    __syncthreads();
  };
  if constexpr (kRegs) {
    static_assert(kTransposeExperts == 64, "a tile is two slots of a row in registers");
#pragma unroll
    for (int g = 0; g < (PerLane + 1) / 2; ++g) {
      if (64 * g >= E) break;  // uniform
#pragma unroll
      for (int r = 0; r < kKeyTokensPerWarp; ++r) {
        const int tl = warp * kKeyTokensPerWarp + r;
#pragma unroll
        for (int j = 2 * g; j < 2 * g + 2 && j < PerLane; ++j)
          if (tl < nt && j * 32 + lane < E) tile[j * 32 + lane - 64 * g][tl] = kk[r][j];
      }
      write_tile(64 * g);
    }
  } else {
    for (int e0 = 0; e0 < E; e0 += kTransposeExperts) {
      for (int i = threadIdx.x; i < kTransposeExperts * kKeyTokens; i += blockDim.x) {
        const int tl = i / kTransposeExperts, ec = i % kTransposeExperts;
        if (tl < nt && e0 + ec < E) tile[ec][tl] = keys[(t0 + tl) * E + e0 + ec];
      }
      write_tile(e0);
    }
  }
  allow_dependent_launch();
}

// ---- pass 2: per expert, the threshold and the grouped rows -------------------------------------------------------

/// Block-wide: the digit d of hist[0, bins) with (count above d) < need <= (count above d) + hist[d], scanning
/// from the largest digit, and need minus the count above d. 1 <= need <= the histogram's total.
template <class Scan>
__device__ void find_digit(const std::int32_t* hist, int bins, std::int32_t need, typename Scan::TempStorage& tmp,
                           std::uint32_t& digit_s, std::int32_t& need_s) {
  const int per = bins >= kSelectThreads ? bins / kSelectThreads : 1;
  const bool mine = static_cast<int>(threadIdx.x) * per < bins;
  const int top = bins - 1 - static_cast<int>(threadIdx.x) * per;  // this thread's bins: top, top - 1, ...
  std::int32_t s = 0;
  if (mine)
    for (int k = 0; k < per; ++k) s += hist[top - k];
  std::int32_t above;
  Scan(tmp).ExclusiveSum(s, above);
  if (mine && above < need && need <= above + s) {
    std::int32_t acc = above;
    for (int k = 0; k < per; ++k) {
      const int b = top - k;
      if (acc + hist[b] >= need) {
        digit_s = static_cast<std::uint32_t>(b);
        need_s = need - acc;
        break;
      }
      acc += hist[b];
    }
  }
  __syncthreads();
}

/// Block-wide radix select, 12 + 12 + 8 bits from the top: the need-th largest of the n keys key_at(i) (1 <= need <=
/// n). After each pass's histogram of this CTA's keys, total_of(bins) returns the histogram to search (this CTA's,
/// or a cluster's sum) and sync_all() runs once the digit is taken (the next pass clears hist). Returns the key; need
/// becomes how many of the keys equal to it the need-th largest takes, ties their count.
template <class Scan, class KeyAt, class TotalOf, class SyncAll>
__device__ std::uint32_t radix_select(KeyAt&& key_at, std::int64_t n, std::int32_t& need, std::int32_t& ties,
                                      std::int32_t* hist, typename Scan::TempStorage& scan_tmp, std::uint32_t& digit_s,
                                      std::int32_t& need_s, TotalOf&& total_of, SyncAll&& sync_all) {
  const int lane = threadIdx.x & 31;
  std::uint32_t prefix = 0;
  const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    const std::uint32_t high = pass == 0 ? 0u : ~((1u << (shift + widths[pass])) - 1u);
    for (int b = threadIdx.x; b < bins; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    // kSelectUnroll keys per thread and trip, loaded and matched independently: the loop is bound by the latency
    // of load -> match -> atomic, which the independent chains overlap.
    const unsigned lanes_below = (1u << lane) - 1u;
    for (std::int64_t base = 0; base < n; base += kSelectUnroll * kSelectThreads) {  // uniform trip count
      std::uint32_t d[kSelectUnroll];
      bool in[kSelectUnroll];
#pragma unroll
      for (int u = 0; u < kSelectUnroll; ++u) {
        const std::int64_t i = base + u * kSelectThreads + threadIdx.x;
        d[u] = 0xffffffffu;
        in[u] = false;
        if (i < n) {
          const std::uint32_t key = key_at(i);
          in[u] = ((key ^ prefix) & high) == 0u;
          if (in[u]) d[u] = (key >> shift) & static_cast<std::uint32_t>(bins - 1);
        }
      }
#pragma unroll
      for (int u = 0; u < kSelectUnroll; ++u) {
        // One shared atomic per distinct digit of the warp (its lowest lane): keys crowd into few digits (similar
        // scores). Integer adds: the histogram does not depend on their order.
        const unsigned group = __match_any_sync(kFull, d[u]);
        if (in[u] && (group & lanes_below) == 0u) atomicAdd(&hist[d[u]], __popc(group));
      }
    }
    const std::int32_t* total = total_of(bins);
    __syncthreads();
    find_digit<Scan>(total, bins, need, scan_tmp, digit_s, need_s);
    prefix |= digit_s << shift;
    need = need_s;
    if (pass == 2) ties = total[digit_s];
    sync_all();  // hist is cleared by the next pass, once every CTA has read it
  }
  return prefix;
}

/// Block-wide radix select for short lists (a few thousand keys at most, the bounded select's): 8 + 8 + 8 + 8 bits
/// from the top, 256 bins, each digit found by warp 0 alone (8 bins a lane and a shuffle scan): one pass more than
/// radix_select, but no block-wide scan of 4096 bins per pass. Same contract as radix_select for one CTA.
template <class KeyAt>
__device__ std::uint32_t short_radix_select(KeyAt&& key_at, std::int32_t n, std::int32_t& need, std::int32_t& ties,
                                            std::int32_t* hist, std::uint32_t& digit_s, std::int32_t& need_s) {
  constexpr int kBins = 256, kPerLane = kBins / 32;
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  std::uint32_t prefix = 0;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const std::uint32_t high = pass == 0 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (std::int32_t base = 0; base < n; base += static_cast<std::int32_t>(blockDim.x)) {  // uniform trip count
      const std::int32_t i = base + static_cast<std::int32_t>(threadIdx.x);
      std::uint32_t d = 0xffffffffu;
      bool in = false;
      if (i < n) {
        const std::uint32_t key = key_at(i);
        in = ((key ^ prefix) & high) == 0u;
        if (in) d = (key >> shift) & static_cast<std::uint32_t>(kBins - 1);
      }
      const unsigned group = __match_any_sync(kFull, d);
      if (in && (group & lanes_below) == 0u) atomicAdd(&hist[d], __popc(group));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds bins 255 - 8 l down to 248 - 8 l; the lanes below it hold the larger digits.
      const int top = kBins - 1 - kPerLane * lane;
      std::int32_t h[kPerLane], s = 0;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) h[q] = hist[top - q], s += h[q];
      std::int32_t incl = s;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const std::int32_t v = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += v;
      }
      std::int32_t acc = incl - s;  // keys in the larger digits
      if (acc < need && need <= incl) {
#pragma unroll
        for (int q = 0; q < kPerLane; ++q) {
          if (acc < need && need <= acc + h[q]) digit_s = static_cast<std::uint32_t>(top - q), need_s = need - acc;
          acc += h[q];
        }
      }
    }
    __syncthreads();
    prefix |= digit_s << shift;
    need = need_s;
    if (pass == 3) ties = hist[digit_s];
    __syncthreads();  // hist is cleared by the next pass once every thread has read it
  }
  return prefix;
}

// A cluster of `ranks` CTAs per expert (1, 2 or 4: the launcher spreads few experts over the GPU): CTA rank q owns
// the expert's tokens [q S, (q + 1) S), S = T / ranks rounded up to 32, and caches that slice. Each radix pass
// counts its slice into its own histogram; after a cluster barrier every CTA adds up the cluster's histograms
// (distributed shared memory, integer sums: the same total in every CTA) and finds the digit itself. The tie cut
// and the compaction take each CTA's count from the others in rank order (token order), so the result is the one
// of a single CTA scanning the whole column.
__global__ void __launch_bounds__(kSelectThreads)
    tr_select_kernel(const std::uint32_t* __restrict__ keys_by_expert, std::int64_t T_,
                     const std::int32_t* __restrict__ tc_count,
                     const std::int32_t* __restrict__ expert_offsets, std::uint32_t* __restrict__ thresholds,
                     std::int32_t* __restrict__ gather, float* __restrict__ row_scores,
                     std::uint32_t* __restrict__ bounds, std::int64_t n_blocks, bool cache,
                     const std::int32_t* __restrict__ only, std::int32_t* __restrict__ block_kept,
                     std::int32_t* __restrict__ group_kept) {
  namespace cg = cooperative_groups;
  using Scan = cub::BlockScan<std::int32_t, kSelectThreads>;
  // Dynamic: the cluster's summed histogram (clusters only), then the slice's keys when `cache`.
  extern __shared__ std::uint32_t dyn_s[];
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ std::int32_t hist[kSelectBins];
  __shared__ std::int32_t warp_count[kSelectWarps];
  __shared__ std::uint32_t digit_s;
  __shared__ std::int32_t need_s, target_warp_s, target_rank_s;
  __shared__ std::int32_t slice_count_s;  // this CTA's ties or kept tokens, read by the cluster
  __shared__ std::int64_t cut_s;
  const cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = static_cast<int>(blockIdx.x) / ranks;
  allow_dependent_launch();  // the emit's CTAs may be placed now; they wait for this grid before they read
  wait_for_prior_grid();     // the bounded select's flags and bounds
  if (only != nullptr && only[e] == 0) return;  // resolved by the bounded select (uniform across the cluster)
  const std::uint32_t* gcol = keys_by_expert + static_cast<std::int64_t>(e) * T_;
  const std::int64_t f = tc_count[e];
  const std::int64_t g0 = expert_offsets[e];
  const std::int64_t r = expert_offsets[e + 1] - g0;
  // This CTA's slice of tokens: local index i is token s_begin + i.
  const std::int64_t slice = ((T_ + ranks - 1) / ranks + 31) / 32 * 32;
  const std::int64_t s_begin = min(T_, rank * slice), n = min(T_, (rank + 1) * slice) - s_begin;
  std::int32_t* total = ranks > 1 ? reinterpret_cast<std::int32_t*>(dyn_s) : hist;
  std::uint32_t* column_s = dyn_s + (ranks > 1 ? kSelectBins : 0);
  if (cache) {
    for (std::int64_t i = threadIdx.x; i < n; i += kSelectThreads) column_s[i] = gcol[s_begin + i];
    __syncthreads();
  }
  const std::uint32_t* col = cache ? column_s : gcol + s_begin;
  // Per-warp contiguous chunks of the slice (multiples of 32) for the ordered passes.
  const std::int64_t chunk = ((n + kSelectWarps - 1) / kSelectWarps + 31) / 32 * 32;
  const std::int64_t w_begin = min(n, warp * chunk), w_end = min(n, (warp + 1) * chunk);
  // Every CTA of the cluster has written slice_count_s (and whatever else is read remotely): a cluster barrier, or
  // the block's own barrier without a cluster.
  auto sync_all = [&] {
    if (ranks > 1)
      cluster.sync();
    else
      __syncthreads();
  };
  // Each warp's count c to warp_count, and their sum, this CTA's count, to slice_count_s (the cluster reads it after
  // a cluster barrier).
  auto publish_counts = [&](std::int32_t c) {
    if (lane == 0) warp_count[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
      std::int32_t sum = 0;
      for (int w = 0; w < kSelectWarps; ++w) sum += warp_count[w];
      slice_count_s = sum;
    }
  };

  std::uint32_t thr;
  std::int64_t cut;
  if (r == f) {
    thr = 0x7fffffffu, cut = 0;  // exactly the token choices: every chosen key is above, no other key is
  } else if (r == 0) {
    thr = 0xffffffffu, cut = 0;  // nothing
  } else if (r >= T_) {
    thr = 0u, cut = T_;  // every token
  } else {
    // Radix select of the r-th largest key.
    std::int32_t need = static_cast<std::int32_t>(r), ties = 0;
    const std::uint32_t prefix = radix_select<Scan>(
        [&](std::int64_t i) { return col[i]; }, n, need, ties, hist, scan_tmp, digit_s, need_s,
        [&](int bins) -> const std::int32_t* {
          if (ranks > 1) {
            cluster.sync();  // every CTA's histogram is complete
            for (int b = threadIdx.x; b < bins; b += kSelectThreads) {
              std::int32_t sum = 0;
              for (int q = 0; q < ranks; ++q) sum += cluster.map_shared_rank(hist, q)[b];
              total[b] = sum;
            }
          }
          return total;
        },
        sync_all);
    thr = prefix;
    if (need == ties) {
      cut = T_;  // every key equal to the threshold is kept
    } else {
      // Keep the first `need` ties in token order: find the token of tie number `need` (0-based), the cut.
      std::int32_t c = 0;
      for (std::int64_t base = w_begin; base < w_end; base += 32) {
        const std::int64_t i = base + lane;
        c += __popc(__ballot_sync(kFull, i < w_end && col[i] == thr));
      }
      publish_counts(c);
      sync_all();
      // The CTA whose slice holds tie number `need`, and the ties of the slices before it.
      int target = 0;
      std::int32_t before_slice = 0;
      for (int q = 0; q < ranks; ++q) {
        const std::int32_t cq = ranks > 1 ? *cluster.map_shared_rank(&slice_count_s, q) : slice_count_s;
        if (need < before_slice + cq) {
          target = q;
          break;
        }
        before_slice += cq;
      }
      if (rank == target) {  // uniform across the CTA
        const std::int32_t local_need = need - before_slice;
        if (threadIdx.x == 0) {
          std::int32_t before = 0;
          for (int w = 0; w < kSelectWarps; ++w) {
            if (local_need < before + warp_count[w]) {
              target_warp_s = w, target_rank_s = local_need - before;
              break;
            }
            before += warp_count[w];
          }
        }
        __syncthreads();
        if (warp == target_warp_s) {
          std::int32_t seen = 0;
          for (std::int64_t base = w_begin; base < w_end; base += 32) {
            const std::int64_t i = base + lane;
            unsigned b = __ballot_sync(kFull, i < w_end && col[i] == thr);
            const int cnt = __popc(b);
            if (seen + cnt > target_rank_s) {
              for (int k = 0; k < target_rank_s - seen; ++k) b &= b - 1;
              if (lane == 0) {
                const std::int64_t token = s_begin + base + (__ffs(b) - 1);
                if (ranks > 1)
                  for (int q = 0; q < ranks; ++q) *cluster.map_shared_rank(&cut_s, q) = token;
                else
                  cut_s = token;
              }
              break;
            }
            seen += cnt;
          }
        }
      }
      sync_all();  // the cut has reached every CTA
      cut = cut_s;
    }
  }
  if (rank == 0 && threadIdx.x == 0) {
    thresholds[2 * e] = thr;
    thresholds[2 * e + 1] = static_cast<std::uint32_t>(cut);
  }
  if (r == 0) return;  // uniform across the cluster: no CTA reads another's shared memory after this
  // The kept tokens in ascending order -> gather[g0 ...], their scores -> row_scores.
  std::int32_t c = 0;
  for (std::int64_t base = w_begin; base < w_end; base += 32) {
    const std::int64_t i = base + lane;
    c += __popc(__ballot_sync(kFull, i < w_end && kept(col[i], thr, static_cast<std::uint32_t>(cut), s_begin + i)));
  }
  publish_counts(c);
  std::int64_t pos = g0;
  if (ranks > 1) {
    cluster.sync();
    for (int q = 0; q < rank; ++q) pos += *cluster.map_shared_rank(&slice_count_s, q);
  }
  for (int w = 0; w < warp; ++w) pos += warp_count[w];
  const unsigned below = (1u << lane) - 1u;
  // Each trip is one block of 32 tokens (slices and chunks start at multiples of 32): its kept mask goes to word 3
  // of the block's bounds and the grouped row of its first kept token to word 0, for the emit pass.
  std::uint32_t* block_words = bounds + 4 * static_cast<std::int64_t>(e) * n_blocks;
  for (std::int64_t base = w_begin; base < w_end; base += 32) {
    const std::int64_t i = base + lane;
    const std::int64_t t = s_begin + i;
    const std::uint32_t key = i < w_end ? col[i] : 0u;
    const bool k = i < w_end && kept(key, thr, static_cast<std::uint32_t>(cut), t);
    const unsigned b = __ballot_sync(kFull, k);
    if (lane == 0) {
      const std::int64_t blk = (s_begin + base) / 32;
      std::uint32_t* w = block_words + 4 * blk;
      w[0] = static_cast<std::uint32_t>(pos), w[3] = b;
      if (b != 0u) atomicAdd(&block_kept[blk], __popc(b)), atomicAdd(&group_kept[blk / 32], __popc(b));
    }
    if (k) {
      const std::int64_t g = pos + __popc(b & below);
      gather[g] = static_cast<std::int32_t>(t);
      row_scores[g] = __uint_as_float(key & ~kChosen);  // the TC score of a chosen pair, p of an added one
    }
    pos += __popc(b);
  }
  if (ranks > 1) cluster.sync();  // no CTA leaves while another may still read its shared memory
}

// Pass 2, bounded: nearest rounding moves at most tile / 2 pairs of an expert, so its threshold lies among a few keys
// at the boundary of the expert's choices, and the keys kernel's per-block bounds tell which they are before any
// pass over the column. With k = r - f > 0 (tokens added), the k-th largest of the blocks' largest unchosen keys, B,
// is at most the k-th largest unchosen key (k blocks hold a key >= B), so every unchosen key above the threshold, and
// every key equal to it, is >= B; with k = f - r > 0 (tokens dropped), the (k + 1)-th smallest of the blocks'
// smallest chosen keys bounds the (k + 1)-th smallest chosen key, the threshold, from above the same way. A block
// holds such a candidate only if its own bound reaches B, so each warp reads the keys of those blocks alone, stages
// the candidates (in token order) and counts its chosen keys from the blocks' choice masks; the threshold and the tie
// cut come from the candidates alone (short_radix_select), each warp's kept count from its chosen count and its kept
// candidates. Every key outside the candidates keeps its chosen state (above the threshold if chosen, below if not),
// so a block's kept tokens are its choice mask corrected at the candidates, and the write reads masks, and keys only
// where they are kept (each kept pair's score goes to row_scores at its grouped row).
// Where a warp's candidates pass kBoundedCandidates (many equal keys: repeated tokens), the expert is flagged and
// tr_select_kernel, launched after, selects it over the whole column.
constexpr int kBoundedCandidates = 64;  // per warp
constexpr int kBoundedBatch = 8;        // blocks whose kept keys the write loads before it writes any

template <int Threads>
__global__ void __launch_bounds__(Threads)
    tr_select_bounded_kernel(const std::uint32_t* __restrict__ keys_by_expert, std::int64_t T_,
                             const std::int32_t* __restrict__ tc_count, std::int64_t M, RoundingRule rule,
                             std::int32_t* __restrict__ expert_counts, std::int32_t* __restrict__ expert_offsets,
                             std::int32_t* __restrict__ expert_tiles, std::uint32_t* __restrict__ bounds,
                             std::int64_t n_blocks, std::uint32_t* __restrict__ thresholds,
                             std::int32_t* __restrict__ gather, float* __restrict__ row_scores,
                             std::int32_t* __restrict__ fallback, std::int32_t* __restrict__ block_kept,
                             std::int32_t* __restrict__ group_kept) {
  constexpr int kWarps = Threads / 32;
  __shared__ std::int32_t hist[256];  // short_radix_select's
  __shared__ std::uint32_t staged_key[kWarps][kBoundedCandidates];
  __shared__ std::int32_t staged_token[kWarps][kBoundedCandidates];
  __shared__ std::uint32_t cand_key[kWarps * kBoundedCandidates];
  __shared__ std::int32_t cand_token[kWarps * kBoundedCandidates];
  __shared__ std::int32_t warp_cand[kWarps], warp_kept[kWarps];
  __shared__ std::int32_t warp_rows[kWarps], warp_tiles[kWarps];
  __shared__ std::uint32_t digit_s;
  __shared__ std::int32_t need_s;
  __shared__ std::int64_t cut_s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  const int e = static_cast<int>(blockIdx.x);
  const std::uint32_t* gcol = keys_by_expert + static_cast<std::int64_t>(e) * T_;
  wait_for_prior_grid();  // the keys kernel's keys, bounds and token-choice counts
  allow_dependent_launch();
  // The expert's rows r_e (its count rounded) and where they start: each CTA sums the rounded counts and GEMM tiles
  // of the experts before its own (integer sums in a fixed order), so no kernel waits for a scan of them, and writes
  // its own expert's entries of the offsets, the tiles and the counts. That is up to E loads a CTA, E^2 / 2 over the
  // grid (at E = 4096 and 512 threads, 8 a thread), against the keys kernel's T E keys.
  const std::int64_t f = tc_count[e];
  const std::int64_t r = rounded_count(f, T_, M, rule);
  std::int64_t g0 = 0;
  {
    std::int32_t rows_before = 0, tiles_before = 0;
    for (int i = static_cast<int>(threadIdx.x); i < e; i += Threads) {
      const std::int32_t ri = static_cast<std::int32_t>(rounded_count(tc_count[i], T_, M, rule));
      rows_before += ri, tiles_before += (ri + kGemmTileM - 1) / kGemmTileM;
    }
    rows_before = __reduce_add_sync(kFull, rows_before);
    tiles_before = __reduce_add_sync(kFull, tiles_before);
    if (lane == 0) warp_rows[warp] = rows_before, warp_tiles[warp] = tiles_before;
    __syncthreads();
    rows_before = tiles_before = 0;
    for (int w = 0; w < kWarps; ++w) rows_before += warp_rows[w], tiles_before += warp_tiles[w];
    g0 = rows_before;
    if (threadIdx.x == 0) {
      if (e == 0) expert_offsets[0] = 0, expert_tiles[0] = 0;
      expert_offsets[e + 1] = rows_before + static_cast<std::int32_t>(r);
      expert_tiles[e + 1] = tiles_before + static_cast<std::int32_t>((r + kGemmTileM - 1) / kGemmTileM);
      if (expert_counts) expert_counts[e] = static_cast<std::int32_t>(r);
    }
  }
  if (r == 0) {  // nothing kept (the words tr_select_kernel writes: f = 0 counts as "exactly the choices")
    if (threadIdx.x == 0) thresholds[2 * e] = f == 0 ? 0x7fffffffu : 0xffffffffu, thresholds[2 * e + 1] = 0u;
    return;
  }
  const bool trivial = r == f || r >= T_;
  const bool drop = r < f;
  const std::int64_t k = drop ? f - r : r - f;
  // Per-warp contiguous chunks of the column (multiples of 32), in token order.
  const std::int64_t chunk = ((T_ + kWarps - 1) / kWarps + 31) / 32 * 32;
  const std::int64_t w_begin = min(T_, warp * chunk), w_end = min(T_, (warp + 1) * chunk);

  // 1. The bound (the side's k-th or (k + 1)-th value of the blocks' bounds; the smallest chosen keys complemented,
  //    so that both are a k-th largest). Fewer blocks than that: no bound, every key of the side is a candidate.
  std::uint32_t bound = drop ? 0xffffffffu : 0u;
  const std::int64_t need_b = drop ? k + 1 : k;
  if (!trivial && need_b <= n_blocks) {
    const std::uint32_t* b = bounds + 4 * static_cast<std::int64_t>(e) * n_blocks + (drop ? 1 : 0);
    std::int32_t need = static_cast<std::int32_t>(need_b), ties = 0;
    const std::uint32_t v = short_radix_select([&](std::int32_t i) { return drop ? ~b[4 * i] : b[4 * i]; },
                                               static_cast<std::int32_t>(n_blocks), need, ties, hist, digit_s, need_s);
    bound = drop ? ~v : v;
  }
  // 2. Each warp over its blocks' bounds: its chosen keys counted from the blocks' choice masks, and only the blocks
  //    whose bound reaches past the expert's bound read, their candidates staged in token order.
  const uint4* block_bounds = reinterpret_cast<const uint4*>(bounds) + static_cast<std::int64_t>(e) * n_blocks;
  // An empty chunk (w_begin == w_end == T_ past the last warp with tokens) has no blocks, even with T_ % 32 != 0.
  const std::int64_t blk_begin = w_begin / 32, blk_end = w_end > w_begin ? (w_end + 31) / 32 : blk_begin;
  std::int32_t n_chosen = 0, n_cand = 0;
  for (std::int64_t c0 = blk_begin; c0 < blk_end; c0 += 32) {  // uniform trip count
    const std::int64_t blk = c0 + lane;
    const uint4 bd = blk < blk_end ? block_bounds[blk] : make_uint4(0u, ~0u, 0u, 0u);
    n_chosen += __popc(bd.z);
    const bool reaches = !trivial && blk < blk_end && (drop ? bd.y <= bound : bd.x >= bound);
    for (unsigned todo = __ballot_sync(kFull, reaches); todo != 0u; todo &= todo - 1u) {  // uniform, in block order
      const std::int64_t i = (c0 + __ffs(todo) - 1) * 32 + lane;
      const bool valid = i < w_end;
      const std::uint32_t key = valid ? gcol[i] : 0u;
      const bool chosen = (key & kChosen) != 0u;
      const bool cand = valid && (drop ? chosen && key <= bound : !chosen && key >= bound);
      const unsigned c = __ballot_sync(kFull, cand);
      const std::int32_t slot = n_cand + __popc(c & below);
      if (cand && slot < kBoundedCandidates)
        staged_key[warp][slot] = key, staged_token[warp][slot] = static_cast<std::int32_t>(i);
      n_cand += __popc(c);
    }
  }
  for (int o = 16; o > 0; o >>= 1) n_chosen += __shfl_xor_sync(kFull, n_chosen, o);
  if (lane == 0) warp_cand[warp] = n_cand;
  __syncthreads();
  std::int32_t cand_before = 0, n_cands = 0;
  bool overflow = false;
  for (int w = 0; w < kWarps; ++w) {
    overflow = overflow || warp_cand[w] > kBoundedCandidates;
    if (w < warp) cand_before += warp_cand[w];
    n_cands += warp_cand[w];
  }
  if (overflow) {  // uniform: tr_select_kernel takes this expert
    if (threadIdx.x == 0) fallback[e] = 1;
    return;
  }
  // 3. The threshold and the tie cut from the candidates, contiguous in token order.
  std::uint32_t thr;
  std::int64_t cut;
  if (r == f) {
    thr = 0x7fffffffu, cut = 0;  // exactly the token choices
  } else if (r >= T_) {
    thr = 0u, cut = T_;  // every token
  } else {
    for (int j = lane; j < n_cand; j += 32)
      cand_key[cand_before + j] = staged_key[warp][j], cand_token[cand_before + j] = staged_token[warp][j];
    __syncthreads();
    // Added tokens: the k-th largest unchosen key. Dropped: the (k + 1)-th smallest chosen key, the candidates being
    // the n_cands smallest chosen keys.
    std::int32_t need = static_cast<std::int32_t>(drop ? n_cands - k : k), ties = 0;
    thr = short_radix_select([&](std::int32_t i) { return cand_key[i]; }, n_cands, need, ties, hist, digit_s, need_s);
    if (need == ties) {
      cut = T_;  // every key equal to the threshold is kept
    } else {
      // The token of tie number `need` (0-based) in token order: the first `need` ties are kept.
      if (warp == 0) {
        std::int32_t seen = 0;
        for (std::int32_t base = 0; base < n_cands; base += 32) {
          const std::int32_t i = base + lane;
          unsigned b = __ballot_sync(kFull, i < n_cands && cand_key[i] == thr);
          const int cnt = __popc(b);
          if (seen + cnt > need) {
            for (int q = 0; q < need - seen; ++q) b &= b - 1;
            if (lane == 0) cut_s = cand_token[base + __ffs(b) - 1];
            break;
          }
          seen += cnt;
        }
      }
      __syncthreads();
      cut = cut_s;
    }
  }
  if (threadIdx.x == 0) {
    thresholds[2 * e] = thr;
    thresholds[2 * e + 1] = static_cast<std::uint32_t>(cut);
  }
  // 4. Each warp's kept count: every chosen key is kept when tokens are added, every chosen key above the
  //    candidates when tokens are dropped; of the candidates, those kept(). r >= T_: the whole chunk.
  std::int32_t kept_c = 0;
  if (!trivial)
    for (int j = lane; j < n_cand; j += 32)
      kept_c += kept(staged_key[warp][j], thr, static_cast<std::uint32_t>(cut), staged_token[warp][j]) ? 1 : 0;
  for (int o = 16; o > 0; o >>= 1) kept_c += __shfl_xor_sync(kFull, kept_c, o);
  if (lane == 0)
    warp_kept[warp] = r >= T_ ? static_cast<std::int32_t>(w_end - w_begin)
                              : (drop ? n_chosen - n_cand : n_chosen) + (trivial ? 0 : kept_c);
  __syncthreads();
  // 5. The kept tokens in ascending order -> gather[g0 ...], their scores -> row_scores; per block, its kept mask
  //    (word 3 of its bounds) and its first kept token's grouped row (word 0, read in steps 1-2 only). A block's
  //    kept tokens are its chosen ones (every token when r >= T_) with the kept candidates added and the others
  //    removed: outside the candidates only the kept tokens' keys are read (for their scores). 32 blocks at a time,
  //    lane i holding block c0 + i's mask.
  std::int64_t pos = g0;
  for (int w = 0; w < warp; ++w) pos += warp_kept[w];
  std::int32_t next = 0;  // the warp's first staged candidate not yet applied (they are in token order)
  for (std::int64_t c0 = blk_begin; c0 < blk_end; c0 += 32) {  // uniform trip count
    const std::int64_t blk = c0 + lane;
    std::uint32_t m = 0u;
    if (blk < blk_end) {
      const std::int64_t nt = min(static_cast<std::int64_t>(32), T_ - blk * 32);
      m = r >= T_ ? (nt == 32 ? ~0u : (1u << nt) - 1u) : block_bounds[blk].z;
    }
    if (!trivial) {
      const std::int64_t chunk_end = min(c0 + 32, blk_end) * 32;
      for (; next < n_cand && staged_token[warp][next] < chunk_end; ++next) {  // uniform
        const std::int32_t tok = staged_token[warp][next];
        if (tok / 32 == blk) {
          const std::uint32_t bit = 1u << (tok & 31);
          m = kept(staged_key[warp][next], thr, static_cast<std::uint32_t>(cut), tok) ? (m | bit) : (m & ~bit);
        }
      }
    }
    std::int32_t incl = __popc(m);
    for (int o = 1; o < 32; o <<= 1) {
      const std::int32_t v = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += v;
    }
    const std::int32_t before = incl - __popc(m);  // kept tokens of the chunk's earlier blocks
    if (blk < blk_end) {  // for the emit pass
      std::uint32_t* w = bounds + 4 * (static_cast<std::int64_t>(e) * n_blocks + blk);
      w[0] = static_cast<std::uint32_t>(pos + before), w[3] = m;
    }
    add_kept_counts(block_kept, group_kept, c0, blk, m);
    // kBoundedBatch blocks at a time: the kept tokens' keys (for their scores) all loaded before any is used, so
    // that the loads overlap instead of waiting one block after another.
    for (int i0 = 0; i0 < 32; i0 += kBoundedBatch) {
      std::uint32_t key[kBoundedBatch];
#pragma unroll
      for (int u = 0; u < kBoundedBatch; ++u) {
        const std::uint32_t mi = __shfl_sync(kFull, m, i0 + u);
        key[u] = (mi >> lane) & 1u ? gcol[(c0 + i0 + u) * 32 + lane] : 0u;
      }
#pragma unroll
      for (int u = 0; u < kBoundedBatch; ++u) {
        const int i = i0 + u;
        const std::uint32_t mi = __shfl_sync(kFull, m, i);
        const std::int32_t bi = __shfl_sync(kFull, before, i);
        if ((mi >> lane) & 1u) {
          const std::int64_t t = (c0 + i) * 32 + lane;
          const std::int64_t g = pos + bi + __popc(mi & below);
          gather[g] = static_cast<std::int32_t>(t);
          row_scores[g] = __uint_as_float(key[u] & ~kChosen);  // the TC score of a chosen pair, p of an added one
        }
      }
    }
    pos += __shfl_sync(kFull, incl, 31);
  }
}

// ---- pass 3: pair order ---------------------------------------------------------------------------------------------

// The kept pairs come from the select's kept masks (word 3 of each expert's block bounds: bit i of expert e's mask
// of block B is token 32 B + i), so no (token, expert) key is read: a warp's tokens lie in one block of 32 and share
// its masks. PerLane > 0 (E <= 32 PerLane): each lane loads the masks of its experts once, all before the count.
// PerLane = 0: 32 experts at a time, twice. A kept pair's grouped row is the block's first kept row (word 0 of the
// same 16 bytes, written by the select) plus the kept tokens before it in the block's mask; its score is in
// row_scores at that row.
// Two CTAs an SM up to 8 masks a lane (32 registers): faster than at half the occupancy, even when the 8-mask
// variant spilled 40 bytes to the stack (ncu, H100, (16384,4096,1024,256,4): 22.7 us against 29.2 with one CTA an SM).
template <int PerLane>
__global__ void __launch_bounds__(32 * kEmitWarps, PerLane <= 8 ? 2 : 1)
    tr_emit_kernel(const std::uint32_t* __restrict__ bounds, std::int64_t n_blocks,
                   const float* __restrict__ row_scores, std::int64_t T_,
                   int E, const std::int32_t* __restrict__ expert_offsets, std::int64_t P_max,
                   const std::int32_t* __restrict__ block_kept, const std::int32_t* __restrict__ group_kept,
                   float* __restrict__ scores, std::int32_t* __restrict__ inverse,
                   std::int32_t* __restrict__ scatter, std::int32_t* __restrict__ token_offsets) {
  constexpr bool kRegs = PerLane > 0;
  static_assert(PerLane <= 32, "a token's kept experts of a lane are the bits of one word");
  static_assert(32 % kEmitTokensPerWarp == 0 && kEmitTokens % 32 == 0, "a warp's tokens lie in one block of 32");
  static_assert(kEmitTokens <= 32 * 32, "a CTA's blocks of 32 tokens lie in one group of 32 blocks");
  __shared__ std::int32_t offset_s[kEmitWarps];
  __shared__ std::int64_t before_s[kEmitWarps];
  __shared__ std::int64_t prefix_s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  wait_for_prior_grid();  // the selects' kept masks, rows and kept counts
  const std::int64_t b = blockIdx.x;
  const std::int64_t t0 = b * kEmitTokens + warp * kEmitTokensPerWarp;  // this warp's first token
  // The CTA's first pair: the kept pairs of the 32-token blocks before its own, as the selects counted them, in
  // whole groups of 32 blocks, then the blocks of its own group before it. Loaded first, summed after the masks'
  // loads are issued; integer sums in a fixed order.
  std::int64_t before = 0;
  {
    const std::int64_t first_blk = b * (kEmitTokens / 32), groups = first_blk / 32;
    for (std::int64_t i = threadIdx.x; i < groups; i += blockDim.x) before += group_kept[i];
    if (static_cast<std::int64_t>(threadIdx.x) < first_blk - 32 * groups)
      before += block_kept[32 * groups + threadIdx.x];
  }
  const std::int64_t blk = t0 / 32;
  auto kept_mask = [&](int e) { return bounds[4 * (static_cast<std::int64_t>(e) * n_blocks + blk) + 3]; };
  std::uint32_t masks[kRegs ? PerLane : 1];  // register variant: slot s is expert 32 s + lane
  if constexpr (kRegs) {
#pragma unroll
    for (int sl = 0; sl < PerLane; ++sl) {
      const int e = 32 * sl + lane;
      masks[sl] = t0 < T_ && e < E ? kept_mask(e) : 0u;
    }
  }
  // Kept pairs of each of the warp's tokens (0 past T), every lane holding all of them; the register variant also
  // keeps, per token, bit s set where the pair with expert 32 s + lane is kept (the masks themselves die here).
  std::int32_t n[kEmitTokensPerWarp];
  std::uint32_t kept_bits[kEmitTokensPerWarp];
#pragma unroll
  for (int j = 0; j < kEmitTokensPerWarp; ++j) {
    const std::int64_t t = t0 + j;
    const int bit = static_cast<int>(t & 31);
    n[j] = 0, kept_bits[j] = 0u;
    if constexpr (kRegs) {
#pragma unroll
      for (int sl = 0; sl < PerLane; ++sl) {
        const bool k = t < T_ && (masks[sl] >> bit) & 1u;
        kept_bits[j] |= static_cast<std::uint32_t>(k) << sl;
        n[j] += __popc(__ballot_sync(kFull, k));
      }
    } else if (t < T_) {
      for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        n[j] += __popc(__ballot_sync(kFull, e < E && (kept_mask(e) >> bit) & 1u));
      }
    }
  }
  std::int32_t warp_total = 0;
#pragma unroll
  for (int j = 0; j < kEmitTokensPerWarp; ++j) warp_total += n[j];
  for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(kFull, before, o);
  if (lane == 0) offset_s[warp] = warp_total, before_s[warp] = before;
  __syncthreads();
  if (warp == 0) {
    const std::int32_t mine = offset_s[lane];
    std::int32_t incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const std::int32_t y = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += y;
    }
    std::int64_t prefix = before_s[lane];
    for (int o = 16; o > 0; o >>= 1) prefix += __shfl_xor_sync(kFull, prefix, o);
    if (lane == 0) prefix_s = prefix;
    offset_s[lane] = incl - mine;
  }
  __syncthreads();
  std::int64_t q = prefix_s + offset_s[warp];  // the warp's first pair
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kEmitTokensPerWarp; ++j) {
    const std::int64_t t = t0 + j;
    if (t >= T_) break;  // warp-uniform
    if (lane == 0) token_offsets[t] = static_cast<std::int32_t>(q);
    // The kept pair with expert e -> slot p in pair order, its score, its grouped row g both ways.
    const int bit = static_cast<int>(t & 31);
    auto emit = [&](int e, bool k, unsigned bal) {
      if (k) {
        const std::int64_t p = q + __popc(bal & below);
        const uint4 w = reinterpret_cast<const uint4*>(bounds)[static_cast<std::int64_t>(e) * n_blocks + blk];
        const std::int32_t g = static_cast<std::int32_t>(w.x + __popc(w.w & ((1u << bit) - 1u)));
        scores[p] = row_scores[g];
        inverse[p] = g;
        scatter[g] = static_cast<std::int32_t>(p);
      }
      q += __popc(bal);
    };
    if constexpr (kRegs) {
#pragma unroll
      for (int sl = 0; sl < PerLane; ++sl) {
        const bool k = (kept_bits[j] >> sl) & 1u;
        emit(32 * sl + lane, k, __ballot_sync(kFull, k));
      }
    } else {
      for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        const bool k = e < E && (kept_mask(e) >> bit) & 1u;
        emit(e, k, __ballot_sync(kFull, k));
      }
    }
  }
  // Past the routed pairs: sentinel slots (inverse -1 is skipped by every kernel), and the last token offset.
  const std::int64_t routed = expert_offsets[E];
  if (blockIdx.x == 0 && threadIdx.x == 0) token_offsets[T_] = static_cast<std::int32_t>(routed);
  for (std::int64_t p = routed + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < P_max;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    inverse[p] = -1;
    scores[p] = 0.0f;
  }
}

// ---- the forward's chunk plan ---------------------------------------------------------------------------------------

// The plan of the forward's chunks of tokens (TokenRoundingArgs::chunks; plan_chunk_and_pair_rows), after the emit:
// every expert's rows in a chunk from the 16-byte bounds of the 32-token blocks holding the chunk's first and end
// token (the first kept row of the block, word 0, plus the kept tokens before the boundary in its mask, word 3: the
// grouped row of the expert's first kept token at or past the boundary), no search over the grouped rows.
__global__ void __launch_bounds__(kChunkPlanThreads)
    tr_chunk_plan_kernel(const std::uint32_t* __restrict__ bounds, std::int64_t n_blocks,
                         const std::int32_t* __restrict__ expert_offsets,
                         const std::int32_t* __restrict__ token_offsets, const std::int32_t* __restrict__ inverse,
                         std::int64_t T_, int E, std::int64_t chunks, std::int64_t pairs_per_chunk, DxChunkPlan plan,
                         std::int32_t* __restrict__ pair_rows) {
  wait_for_prior_grid();  // the emit's token offsets and pair rows, the selects' bounds before it
  const uint4* block_bounds = reinterpret_cast<const uint4*>(bounds);
  plan_chunk_and_pair_rows(
      expert_offsets, token_offsets, 0, T_, E, inverse, chunks, pairs_per_chunk, plan, pair_rows,
      [&](const std::int32_t* offsets, int e, std::int64_t t0, std::int64_t t1, std::int32_t& first) {
        // Expert e's first kept row at or past tok. An expert that keeps no token has no bounds of its own (the
        // selects return before they write them): its rows are empty everywhere.
        auto first_row = [&](std::int64_t tok) -> std::int32_t {
          if (tok >= T_ || offsets[e] == offsets[e + 1]) return offsets[e + 1];
          const uint4 w = block_bounds[static_cast<std::int64_t>(e) * n_blocks + (tok >> 5)];
          return static_cast<std::int32_t>(w.x + __popc(w.w & ((1u << (tok & 31)) - 1u)));
        };
        first = first_row(t0);
        return first_row(t1) - first;  // t1 >= t0
      });
}

// ---- backward -------------------------------------------------------------------------------------------------------

/// One warp per token: dz = upstream + the TC scores' backward at the choices + the full softmax's backward of the
/// padded pairs (dp_i = the pair's gradient; for kTopKOfSoftmax the choices are full-softmax probabilities too).
/// The token's selection comes from the forward's saved statistics, not from selecting again.
///
/// Where the pair gradients go (kBwdGradientsInRegisters): up to 4 keys a lane, in registers, slot j of lane l for
/// expert 32 j + l. Each of the token's few pairs (K and the rounding's padding) is broadcast to the warp and taken by
/// the lane whose expert's grouped rows [offsets[e], offsets[e + 1]) hold the pair's row, so no pair searches the
/// offsets for its expert (a chain of dependent loads: ncu put a quarter of this kernel's stall samples there on
/// 1.4B (256,128,8)). Wider rows place them in a shared-memory window of kBwdWindow experts, each pair's expert found
/// by binary search: with 8 keys a lane the registers' version needs 115 registers (two CTAs an SM) or spills, and
/// ran 45-56 us against 40.5 (H100, ncu, (16384,4096,1024,256,4)). Each width's occupancy was measured too: 1 key a
/// lane at five CTAs an SM (48 registers; 21.5 us against 31.5 on 1.4B (1024,32,2)), 2 and 4 at four (with 4 keys
/// that spills 36 bytes: 47.4 us on 1.4B (256,128,8), 53.1 at three CTAs an SM without spilling, 50.0 with the
/// shared-memory window).
template <class T, int PerLane>
__device__ __forceinline__ void tr_backward_token(ScoreVariant variant, const T* __restrict__ z, std::int64_t T_,
                                                  int E, const TokenSelectionStats* __restrict__ selection,
                                                  const float* __restrict__ ds, const std::int32_t* __restrict__ inverse,
                                                  const std::int32_t* __restrict__ offsets,
                                                  const std::int32_t* __restrict__ token_offsets,
                                                  const T* __restrict__ up, std::int64_t ld_up,
                                                  T* __restrict__ dlogits) {
  constexpr bool kRegs = kBwdGradientsInRegisters<PerLane>;
  constexpr int kWindow = kRegs ? 32 * PerLane : kBwdWindow;  // experts whose pair gradients a warp holds at a time
  __shared__ float dp_s[kRegs ? 1 : kBwdWarps][kRegs ? 1 : kBwdWindow];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kBwdWarps + warp;
  if (t >= T_) return;  // warp-uniform; no block-wide synchronisation below
  RowSelection<T, PerLane> row(z + t * E, E, lane);
  row.restore(selection[t]);
  const std::int64_t q0 = token_offsets[t], q1 = token_offsets[t + 1];
  float dp_r[kRegs ? PerLane : 1];
  float* dp = dp_s[kRegs ? 0 : warp];
  // The token's pair gradients of experts [w0, w0 + kWindow) (zero where the token has no pair).
  auto place = [&](int w0) {
    if constexpr (kRegs) {
      std::int32_t lo[PerLane], hi[PerLane];  // slot j's expert's grouped rows; an empty range past E
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        const int e = j * 32 + lane;
        lo[j] = e < E ? offsets[e] : 0;
        hi[j] = e < E ? offsets[e + 1] : 0;
        dp_r[j] = 0.0f;
      }
      for (std::int64_t base = q0; base < q1; base += 32) {
        const std::int64_t q = base + lane;
        const std::int32_t g = q < q1 ? inverse[q] : -1;  // -1: no pair, in no expert's range
        const float d = q < q1 ? ds[q] : 0.0f;
        const int n = static_cast<int>(min(static_cast<std::int64_t>(32), q1 - base));
        for (int s = 0; s < n; ++s) {
          const std::int32_t gs_ = __shfl_sync(kFull, g, s);
          const float ds_ = __shfl_sync(kFull, d, s);
#pragma unroll
          for (int j = 0; j < PerLane; ++j)
            if (gs_ >= lo[j] && gs_ < hi[j]) dp_r[j] = ds_;  // a token has at most one pair per expert
        }
      }
    } else {
      for (int i = lane; i < kBwdWindow; i += 32) dp[i] = 0.0f;
      __syncwarp();
      for (std::int64_t q = q0 + lane; q < q1; q += 32) {
        const std::int32_t g = inverse[q];
        if (g < 0) continue;
        const int e = expert_of_row(offsets, E, g);
        if (e >= w0 && e < w0 + kBwdWindow) dp[e - w0] = ds[q];  // a token has at most one pair per expert
      }
      __syncwarp();
    }
  };
  auto grad = [&](int j, int w0) -> float {
    if constexpr (kRegs) return dp_r[j];
    else return dp[j * 32 + lane - w0];
  };
  // Sums over the row: dot = sum_i dp_i p_i over the full-softmax part, gs = sum_k g_k s_k over the choices.
  float dot = 0.0f, gs = 0.0f;
  for (int w0 = 0; w0 < E; w0 += kWindow) {
    place(w0);
    row.for_each(w0 / 32, (w0 + kWindow) / 32, [&](int j) {
      const float g = grad(j, w0), p = row.prob(j);
      if (variant == ScoreVariant::kTopKOfSoftmax || !row.chosen(j)) dot += g * p;
      else gs += g * row.tc_score(variant, j);
    });
  }
  for (int o = 16; o > 0; o >>= 1) {
    dot += __shfl_xor_sync(kFull, dot, o);
    gs += __shfl_xor_sync(kFull, gs, o);
  }
  T* out = dlogits + t * E;
  const T* u = up ? up + t * ld_up : nullptr;
  for (int w0 = 0; w0 < E; w0 += kWindow) {
    if (E > kWindow) place(w0);  // one window: the gradients are still there
    row.for_each(w0 / 32, (w0 + kWindow) / 32, [&](int j) {
      const int i = j * 32 + lane;
      const float p = row.prob(j);
      float g = grad(j, w0), direct = 0.0f;
      if (variant != ScoreVariant::kTopKOfSoftmax && row.chosen(j)) {
        direct = row.tc_score(variant, j) * (g - gs);  // dz_k = s_k (g_k - sum_j g_j s_j)
        g = 0.0f;                                      // not part of the full softmax
      }
      out[i] = from_float<T>((u ? to_float(u[i]) : 0.0f) + direct + p * (g - dot));
    });
  }
}

/// The router backward where the pair gradients sit in registers (1, 2 or 4 keys a lane), at the occupancy
/// measured best for each width (tr_backward_token).
template <class T, int PerLane>
__global__ void __launch_bounds__(32 * kBwdWarps, PerLane == 1 ? 5 : 4)
    tr_backward_kernel(ScoreVariant variant, const T* __restrict__ z, std::int64_t T_, int E,
                       const TokenSelectionStats* __restrict__ selection, const float* __restrict__ ds,
                       const std::int32_t* __restrict__ inverse, const std::int32_t* __restrict__ offsets,
                       const std::int32_t* __restrict__ token_offsets, const T* __restrict__ up, std::int64_t ld_up,
                       T* __restrict__ dlogits) {
  static_assert(kBwdGradientsInRegisters<PerLane>, "wider rows use tr_backward_wide_kernel");
  tr_backward_token<T, PerLane>(variant, z, T_, E, selection, ds, inverse, offsets, token_offsets, up, ld_up, dlogits);
}

/// The router backward for rows of 8 or 16 keys a lane or read from memory (pair gradients in shared memory); the
/// compiler's own register budget.
template <class T, int PerLane>
__global__ void __launch_bounds__(32 * kBwdWarps)
    tr_backward_wide_kernel(ScoreVariant variant, const T* __restrict__ z, std::int64_t T_, int E,
                            const TokenSelectionStats* __restrict__ selection, const float* __restrict__ ds,
                            const std::int32_t* __restrict__ inverse, const std::int32_t* __restrict__ offsets,
                            const std::int32_t* __restrict__ token_offsets, const T* __restrict__ up,
                            std::int64_t ld_up, T* __restrict__ dlogits) {
  static_assert(!kBwdGradientsInRegisters<PerLane>, "narrow rows use tr_backward_kernel");
  tr_backward_token<T, PerLane>(variant, z, T_, E, selection, ds, inverse, offsets, token_offsets, up, ld_up, dlogits);
}

/// Calls run(std::integral_constant<int, PerLane>) for the register variant that holds a row of E experts, PerLane
/// keys a lane (0: read from memory).
template <class F>
void by_row_width(std::int64_t E, F&& run) {
  static_assert(kTokenRoundingRegisterExperts == 32 * 16, "the widest register variant holds 16 keys a lane");
  if (E <= 32) run(std::integral_constant<int, 1>{});
  else if (E <= 64) run(std::integral_constant<int, 2>{});
  else if (E <= 128) run(std::integral_constant<int, 4>{});
  else if (E <= 256) run(std::integral_constant<int, 8>{});
  else if (E <= kTokenRoundingRegisterExperts) run(std::integral_constant<int, 16>{});
  else run(std::integral_constant<int, 0>{});
}

/// The select kernel's static shared memory and the most shared memory a block may opt into on a device, queried
/// once per device. The default limit of 48 KiB counts static and dynamic shared memory together, so a dynamic size
/// needs the opt-in whenever static + dynamic passes 48 KiB, not only when the dynamic part alone does.
struct SelectSharedMemory {
  int static_bytes = 0;
  int optin = 0;
  int sm_count = 0;
};
SelectSharedMemory select_shared_memory() {
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, SelectSharedMemory> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find(dev);
  if (it != known.end()) return it->second;
  SelectSharedMemory m;
  cudaFuncAttributes attr{};
  MACHMOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, tr_select_kernel));
  m.static_bytes = static_cast<int>(attr.sharedSizeBytes);
  MACHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&m.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  MACHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&m.sm_count, cudaDevAttrMultiProcessorCount, dev));
  known.emplace(dev, m);
  return m;
}

}  // namespace

void launch_token_rounding(const TokenRoundingArgs& a, cudaStream_t stream) {
  if (a.T == 0) return;
  if (a.selection == nullptr)  // a layout bug, not a caller's: the router backward reads it
    throw RuntimeError("machmoe: token rounding needs the saved token_selection region, given none");
  if (a.E > kTokenRoundingRegisterExperts && a.keys == nullptr)  // a layout bug, not a caller's: rows in memory need it
    throw RuntimeError("machmoe: token rounding with E = " + std::to_string(a.E) +
                       " needs the token-major keys region (ForwardWorkspaceLayout::tr_keys), given none");
  const int E = static_cast<int>(a.E), K = static_cast<int>(a.K);
  const std::int64_t emit_blocks = (a.T + kEmitTokens - 1) / kEmitTokens;
  // Counters region (TokenRoundingCounters): kept pairs per block of 32 tokens and per group of 32 blocks, f_e, the
  // experts the bounded select leaves to tr_select_kernel.
  const TokenRoundingCounters words = TokenRoundingCounters::of(a.T, a.E);
  if (a.counters_bytes < static_cast<std::size_t>(words.words) * 4)  // a layout bug, not a caller's
    throw RuntimeError("machmoe: token rounding's counters region holds " + std::to_string(a.counters_bytes) +
                       " bytes, needs " + std::to_string(words.words * 4));
  auto* counter_words = static_cast<std::int32_t*>(a.counters);
  std::int32_t* block_kept = counter_words + words.block_kept;
  std::int32_t* group_kept = counter_words + words.group_kept;
  std::int32_t* tc_count = counter_words + words.tc_count;
  std::int32_t* fallback = counter_words + words.full_select;
  MACHMOE_CUDA_CHECK(cudaMemsetAsync(a.counters, 0, a.counters_bytes, stream));
  dispatch_data_type(a.dt, [&](auto tag) {
    using Tp = decltype(tag);
    const auto* z = static_cast<const Tp*>(a.logits);
    by_row_width(a.E, [&](auto per_lane) {
      tr_keys_kernel<Tp, decltype(per_lane)::value><<<ceil_div(a.T, kKeyTokens), 32 * kKeyWarps, 0, stream>>>(
          z, a.ld_logits, a.T, E, K, a.variant, a.keys, a.keys_by_expert, a.bounds, a.selection,
          static_cast<Tp*>(a.logits_copy), tc_count);
    });
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_keys");
  const std::int32_t* counts = tc_count;
  const SelectSharedMemory smem = select_shared_memory();
  // One CTA per expert; 1024 threads where the experts fit one wave at one CTA an SM (the kernel is bound by each
  // warp's walk over its chunk of the column: more warps, shorter chunks), else 512 (two CTAs an SM).
  auto launch_bounded = [&](auto threads) {
    launch_dependent(tr_select_bounded_kernel<decltype(threads)::value>, dim3(static_cast<unsigned>(E)),
                     dim3(threads.value), 0, stream, a.keys_by_expert, a.T, counts, a.tile_m, a.rule, a.expert_counts,
                     a.expert_offsets, a.expert_tiles, a.bounds, ceil_div(a.T, kKeyTokens), a.thresholds, a.gather,
                     a.row_scores, fallback, block_kept, group_kept);
  };
  if (E <= smem.sm_count)
    launch_bounded(std::integral_constant<int, 2 * kSelectThreads>{});
  else
    launch_bounded(std::integral_constant<int, kSelectThreads>{});
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_select_bounded");
  // Few experts: a cluster of 2 or 4 CTAs per expert, each on a slice of its column (up to one CTA per SM; a column
  // of fewer than kSelectClusterMinTokens keys is not worth the cluster barriers). The slice's keys in shared memory
  // when they fit beside the kernel's static arrays (and, with a cluster, the summed histogram).
  int ranks = 1;
  if (a.T >= kSelectClusterMinTokens)
    while (ranks < kSelectMaxCluster && static_cast<std::int64_t>(E) * ranks * 2 <= smem.sm_count) ranks *= 2;
  const std::int64_t slice = ((a.T + ranks - 1) / ranks + 31) / 32 * 32;
  const int total_bytes = ranks > 1 ? kSelectBins * 4 : 0;
  const bool cache = smem.static_bytes + total_bytes + slice * 4 <= smem.optin;
  const int dyn = total_bytes + (cache ? static_cast<int>(slice * 4) : 0);
  if (smem.static_bytes + dyn > (48 << 10))
    MACHMOE_CUDA_CHECK(cudaFuncSetAttribute(tr_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(E * ranks));
  cfg.blockDim = dim3(kSelectThreads);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(dyn);
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2] = {dependent_launch_attribute(), {}};
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = static_cast<unsigned>(ranks);
  attrs[1].val.clusterDim.y = 1, attrs[1].val.clusterDim.z = 1;
  cfg.attrs = attrs, cfg.numAttrs = ranks > 1 ? 2 : 1;
  // Only the experts the bounded select flagged (their CTAs of the others return at once).
  MACHMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, tr_select_kernel, a.keys_by_expert, a.T, counts,
                                        static_cast<const std::int32_t*>(a.expert_offsets), a.thresholds, a.gather,
                                        a.row_scores, a.bounds, ceil_div(a.T, kKeyTokens), cache,
                                        static_cast<const std::int32_t*>(fallback), block_kept, group_kept));
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_select");
  by_row_width(a.E, [&](auto per_lane) {
    launch_dependent(tr_emit_kernel<decltype(per_lane)::value>, dim3(static_cast<unsigned>(emit_blocks)),
                     dim3(32 * kEmitWarps), 0, stream, a.bounds, ceil_div(a.T, kKeyTokens), a.row_scores, a.T, E,
                     a.expert_offsets, a.P_max, static_cast<const std::int32_t*>(block_kept),
                     static_cast<const std::int32_t*>(group_kept), a.scores, a.inverse, a.scatter, a.token_offsets);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_emit");
  if (token_rounding_built_plan(a)) {
    launch_dependent(tr_chunk_plan_kernel, chunk_plan_grid(a.chunks, a.pairs_per_chunk), dim3(kChunkPlanThreads),
                     chunk_plan_shared_bytes(a.E), stream,
                     a.bounds, ceil_div(a.T, kKeyTokens), a.expert_offsets, a.token_offsets, a.inverse, a.T, E,
                     a.chunks, a.pairs_per_chunk, a.plan, a.pair_rows);
    MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_chunk_plan");
  }
}

void launch_token_rounding_backward(DType dt, ScoreVariant variant, const void* logits, std::int64_t T,
                                    std::int64_t E, const TokenSelectionStats* selection, const float* ds,
                                    const std::int32_t* inverse, const std::int32_t* offsets,
                                    const std::int32_t* token_offsets, const void* grad_logits, std::int64_t ld_grad,
                                    void* dlogits, cudaStream_t stream) {
  if (T == 0) return;
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    by_row_width(E, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      auto launch = [&](auto kernel) {
        kernel<<<ceil_div(T, kBwdWarps), 32 * kBwdWarps, 0, stream>>>(
            variant, static_cast<const Tp*>(logits), T, static_cast<int>(E), selection, ds, inverse, offsets,
            token_offsets, static_cast<const Tp*>(grad_logits), ld_grad, static_cast<Tp*>(dlogits));
      };
      if constexpr (kBwdGradientsInRegisters<kPerLane>)
        launch(tr_backward_kernel<Tp, kPerLane>);
      else
        launch(tr_backward_wide_kernel<Tp, kPerLane>);
    });
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_backward");
}

}  // namespace machmoe::gpu
