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
// 1. keys (one warp per token, the row in registers for E <= 512; four lanes a token for bf16 rows of at most 128
//    experts in whole 16-byte groups with K <= 8, tr_keys_lane_kernel, bitwise the same outputs): token choice by the
//    top-K kernel's selection
//    (RankKey: 32-bit keys for bf16, one redux per round; for rows of up to 256 each lane's keys sorted once, as the
//    top-K kernel does; for rows of 512 each lane's best two kept, a lane looking over its keys again only when it
//    wins a third time), the TC scores of the score variant, the row's softmax, the keys, the selection's statistics
//    and a copy of the logits for the backward (so no separate copy reads them again). Each key goes straight into a
//    shared tile of the block's 32 tokens by expert (every expert of a row in registers: each exp(x - max) as the
//    softmax sums it, made the probability key as the tile is written out, the K chosen keys written over it by a
//    lane a selection; rows of more than 512 experts go through token-major keys in memory, which the tile reads
//    back 64 experts at a time); after one
//    barrier each warp writes experts' 32-token rows of the expert-major keys from it, with the block's bounds (below)
//    and chosen mask per expert, and the token-choice counts f_e (popcounts of the masks, added with one integer
//    atomic per expert and block, a thread an expert so each atomic instruction covers 32 counters: sums, so the
//    order of the atomics cannot show).
// 2. select, bounded (one block per expert; see tr_select_bounded_kernel): the keys kernel also writes, per expert
//    and block of 32 tokens, the largest unchosen and the smallest chosen key and the mask of chosen tokens; from
//    them the few keys that can hold the threshold are read (only the blocks that can hold one), the threshold found
//    among them, and the kept tokens written from the masks. Each select CTA first sums the rounded counts r_e' and
//    GEMM tiles of the experts before its own, and writes its expert's offset, tiles and count (so the keys kernel
//    needs no completion count and no last-block scan, whose fence and barrier every one of its blocks paid). Each
//    select writes, per expert and block, the mask of the kept tokens and the grouped row of the first of them, per
//    grouped row the pair's score, and adds each block's kept pairs to that block's count and to its group's (32
//    blocks), integer atomics whose order cannot show.
//    The kept tokens' keys (their scores) are loaded with a lane per kept token, so a 32-block chunk's loads overlap.
//    Experts with too many such keys (repeated tokens) are flagged and selected by the same CTA over the whole
//    column: the r_e-th key by a 3-pass radix select (12, 12 and 8 bits, a shared histogram with one atomic per
//    distinct digit of a warp); when keys tie at the threshold and only some of the ties are kept, one ordered pass
//    finds the token where they stop (the cut); then the kept tokens, ascending, with the same per-block words.
// 3. emit (32 warps per block, each over 2 consecutive tokens, 8 where E <= 32): kept(t, e) from the select's kept
//    masks, counted per token and scanned within the block; the block's first pair is the sum of the select's kept
//    counts of the groups and blocks before it, so no block waits for another (a decoupled look-back did that before:
//    ncu put 37 % of the kernel's stall samples on the barrier behind it, H200, 1.4B (1024,32,2)). Then every kept pair
//    in (token, expert) order gets its grouped row (the block's first kept row plus the kept tokens before it in the
//    mask), score, inverse and scatter, and the token offsets are written. Slots past the pair count get expert -1
//    semantics (inverse -1, score 0).
// 4. Where the forward computes Y in chunks of tokens, their plan (tr_chunk_plan_kernel): each chunk's experts' rows
//    from the per-block first kept rows and kept masks at the chunk's two boundary tokens, each routed pair's row in
//    its chunk (what the top-K metadata builds from its tile histograms, and launch_dx_chunk_plan by searching).
// Launches: the select, the emit and the plan are programmatic dependent launches (dependent_launch.cuh): each may be
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
#include <mutex>
#include <set>
#include <utility>
#include <type_traits>

#include <cub/block/block_scan.cuh>

#include "gpu/chunk_plan.cuh"
#include "gpu/cuda_check.hpp"
#include "gpu/dependent_launch.cuh"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"
#include "machmoe/device.hpp"

namespace machmoe::gpu {
namespace {

constexpr std::uint32_t kChosen = 0x80000000u;
constexpr unsigned kFull = 0xffffffffu;

// Pass 1.
constexpr int kKeyWarps = 16;
constexpr int kKeyTokens = 32;  // per block: 2 tokens per warp, one 32-token transpose
constexpr int kKeyTokensPerWarp = kKeyTokens / kKeyWarps;
constexpr int kTransposeExperts = 64;  // rows read from memory: experts a block transposes at a time
/// The keys kernel's shared tile holds every expert of a row in registers, kTransposeExperts of a longer one.
template <int PerLane>
constexpr int kKeyTileExperts = PerLane > 0 ? 32 * PerLane : kTransposeExperts;
constexpr int kKeyTileRow = kKeyTokens + 1;  // words a row of the tile: a warp's writes of one token's 32 experts
                                             // and its reads of one expert's 32 tokens each touch 32 distinct banks
template <int PerLane>
constexpr std::size_t key_tile_bytes() {
  return static_cast<std::size_t>(kKeyTileExperts<PerLane>) * kKeyTileRow * sizeof(std::uint32_t);
}
/// Blocks of the keys kernel an SM should hold, for rows in registers with 32-bit (bf16) keys: rows of up to 64 fit 32
/// registers (four blocks, all 64 warps an SM), rows of 512 fit 64 without spilling (two blocks: at 126 registers and
/// one block the kernel issued on 38 % of cycles, ncu, H200, (16384,1536,256,512,8)). 64-bit keys (fp32 and fp16
/// rows) would spill there; rows of 128 and 256 take 40 and 48 registers unasked (three blocks and two).
template <class T, int PerLane>
constexpr int kKeyMinBlocks = PerLane == 0 || sizeof(typename RankKey<T>::Type) != 4 ? 1
                              : PerLane <= 2                                         ? 4
                              : PerLane == 16                                        ? 2
                                                                                     : 1;
// Pass 2.
constexpr int kSelectBins = 4096;  // the whole-column radix select's first two passes (12 bits)
constexpr int kSelectUnroll = 4;   // keys per thread and trip of a radix pass's histogram loop
// Pass 3. Each warp takes kEmitTokensPerWarp consecutive tokens. Measured when the blocks still found their first pair
// by a look-back over their predecessors (token-rounding stage with 1 / 2 / 4 / 8 tokens per warp, same call, two
// rounds; docs/BENCHMARKS.md, session 36): 2 was 1-6 % faster than 1 on every row tried, 4 about as fast as 2, 8 12 %
// slower than 1 where E = 256 (more keys per token and warp).
// Where E is small the warps of 2 tokens had little to do and the grid ran in waves: at E = 32 a warp's 2 tokens hold
// 4 kept pairs, and T = 40960 took 640 CTAs of 1024 threads, 2.4 waves of two CTAs an SM. Rows of up to
// kEmitWideMaxPerLane keys a lane take kEmitWideTokensPerWarp tokens a warp, one wave there: 12.5 -> 9.2 us on
// 1.4B (1024,32,2) (ncu, H200, session 83). The same at E = 64 and 128 was slower (13.2 -> 14.1 us on 1.4B (512,64,4),
// 18.8 -> 26.7 on 1.4B (256,128,8)): with 4 and 8 pairs a token a warp's serial ballots over its tokens and slots
// outweigh the wave saved.
constexpr int kEmitWarps = 32;
constexpr int kEmitWideMaxPerLane = 1;
constexpr int kEmitWideTokensPerWarp = 8;
template <int PerLane>
constexpr int kEmitTokensPerWarp = PerLane >= 1 && PerLane <= kEmitWideMaxPerLane ? kEmitWideTokensPerWarp : 2;
template <int PerLane>
constexpr int kEmitTokens = kEmitWarps * kEmitTokensPerWarp<PerLane>;  // per block
// Backward.
constexpr int kBwdWarps = 8;
constexpr int kBwdWindow = 512;  // experts whose pair gradients a warp holds in shared memory at a time
template <int PerLane>
constexpr bool kBwdGradientsInRegisters = PerLane >= 1 && PerLane <= 4;  // see tr_backward_token_in_registers

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

/// select()'s default: the row's exponentials are not kept outside the selection.
struct IgnoreExp {
  __device__ __forceinline__ void operator()(int, float) const {}
};

/// A token's row as the warp sees it: lane l owns elements l, l + 32, ... (slot j holds element 32 j + l), in
/// registers for PerLane > 0, else read from memory on each use. Holds the top-K selection's outcome (the K-th
/// selected rank key, the top value and the sum of exp over the selection) and the row's softmax (max, sum of
/// exp), all computed in the order the top-K kernel uses, so the scores are bitwise those of launch_topk_scores.
/// KeepExp: rows in registers keep each exp(v - max) of the softmax for prob(); otherwise prob() computes it again
/// (the same expression, so the same bits). The backward, which calls it up to three times a slot, keeps them; the
/// keys kernel keeps them in its shared tile instead (select's on_exp), where 16 more registers a lane would cost the
/// 512-wide rows half their occupancy.
template <class T, int PerLane, bool KeepExp = (PerLane <= 8)>
struct RowSelection {
  static constexpr bool kRegs = PerLane > 0;
  // Rows in registers have at most 512 elements: bf16's 32-bit key holds them. Rows read from memory may be longer.
  using Key = RankKey<std::conditional_t<kRegs, T, float>>;
  using KeyType = typename Key::Type;
  static_assert(32 * PerLane <= Key::kMaxRow, "row longer than the rank key holds");
  const T* row;
  int E, lane, slots;
  float v[kRegs ? PerLane : 1];
  static constexpr bool kKeepExp = kRegs && KeepExp;
  float ex[kKeepExp ? PerLane : 1];
  KeyType key[kRegs ? PerLane : 1];
  KeyType kth = ~KeyType{0};
  KeyType mine = 0;  // rows in registers, K <= 32: lane r's selection r (so each chosen key can be written by one lane)
  float first = 0.0f, sum_k = 0.0f, m = -INFINITY, total = 0.0f;
  float inv_total = 0.0f;  // 1 / total, once a row: prob() multiplies by it instead of dividing every element

  __device__ __forceinline__ RowSelection(const T* r, int E_, int lane_) : row(r), E(E_), lane(lane_) {
    slots = kRegs ? PerLane : (E + 31) / 32;
    if constexpr (kRegs) {
      // Past the row: value -inf (no part of the softmax; see select) and key 0 (below every element of the row).
      load_row_slots<T, PerLane>(row, E, lane, -INFINITY, v, key);
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
  /// The top-K selection and the full softmax. on_exp(j, x) sees slot j's exp(x - max) as the row's sum adds it (the
  /// keys kernel keeps them in its shared tile instead of registers).
  template <class OnExp = IgnoreExp>
  __device__ __forceinline__ void select(int K, OnExp&& on_exp = {}) {
    if constexpr (kRegs && PerLane <= 8) {
      // As the top-K kernel selects (router_kernels.cu): each lane's keys sorted once, so a round's candidate is the
      // lane's first key and the winning lane moves its next one up; lane r keeps selection r (K <= 32), and the
      // selection's exponentials come once after the rounds, summed in selection order. The same selections, kth,
      // first and sum_k as the pass below, bit for bit.
      KeyType sorted[PerLane];
#pragma unroll
      for (int j = 0; j < PerLane; ++j) sorted[j] = key[j];
      sort_keys_descending<PerLane>(sorted);
      KeyType prev = ~KeyType{0};
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
    } else if constexpr (kRegs) {
      // Rows of 16 keys a lane: a pass over every key a round (as the rows from memory below do) was about 400
      // instructions a token and lane at K = 8. Instead each lane keeps its best two keys below the last selection
      // (head, next): a round's winner moves its next up, and only a lane that wins again before refilling its next
      // looks over its keys (the warp pays that pass in those rounds alone). The same selections in the same order,
      // so kth, first and sum_k are bitwise those of the pass.
      KeyType head = 0, next = 0;  // 0: below every element of the row
#pragma unroll
      for (int j = 0; j < PerLane; ++j) {
        next = max(next, min(head, key[j]));
        head = max(head, key[j]);
      }
      bool next_known = true;
      KeyType prev = ~KeyType{0};
      for (int r = 0; r < K; ++r) {
        prev = Key::warp_max(head);
        if (head == prev) {  // keys are distinct (each holds its index): one lane
          if (next_known) {
            head = next;
            next_known = false;
          } else {
            head = 0;
#pragma unroll
            for (int j = 0; j < PerLane; ++j) head = (key[j] < prev && key[j] > head) ? key[j] : head;
          }
        }
        if (K <= 32) mine = r == lane ? prev : mine;
        const float sel = Key::value(prev);
        if (r == 0) first = sel;
        sum_k += expf(sel - first);
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
    // in registers take the maximum over every slot without a branch (a slot past the row holds -inf, which leaves it
    // as it is; a slot check costs three instructions of branch synchronisation). The sum keeps its checks: without
    // them the compiler held a lane's 16 exponentials live at once and spilled.
    float mx = -INFINITY;
    if constexpr (kRegs) {
#pragma unroll
      for (int j = 0; j < PerLane; ++j) mx = fmaxf(mx, v[j]);
    } else {
      for_each(0, slots, [&](int j) { mx = fmaxf(mx, value(j)); });
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    float s = 0.0f;
    auto add_exp = [&](int j) {
      const float x = expf(value(j) - mx);
      if constexpr (kKeepExp) ex[j] = x;
      on_exp(j, x);
      s += x;
    };
    for_each(0, slots, add_exp);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
    m = mx, total = s, inv_total = 1.0f / s;
  }
  /// The selection as select(K) left it, for the router backward: everything but the exponentials comes from the
  /// forward's saved statistics; those are exp(x - max) again, the same expression, so every probability, TC score
  /// and choice below is bitwise the forward's.
  __device__ __forceinline__ TokenSelectionStats stats() const {
    return {static_cast<std::uint64_t>(kth), first, sum_k, m, total};
  }
  __device__ __forceinline__ void restore(const TokenSelectionStats& s) {
    kth = static_cast<KeyType>(s.kth), first = s.first, sum_k = s.sum_k, m = s.max, total = s.sum;
    inv_total = 1.0f / total;  // as select() computed it
    if constexpr (kKeepExp) for_each(0, slots, [&](int j) { ex[j] = expf(value(j) - m); });
  }
  __device__ __forceinline__ bool chosen(int j) const { return rank(j) >= kth; }
  /// Slot j's exp(x - max) (kept by select or restore where kKeepExp).
  __device__ __forceinline__ float exp_of(int j) const {
    if constexpr (kKeepExp) return ex[j];
    else return expf(value(j) - m);
  }
  /// Slot j's full-softmax probability as the ranking and the backward use it: exp(x - max) times the row's
  /// reciprocal sum, within an ulp of the quotient. The keys kernel takes it for every element of the row that was
  /// not chosen and the backward for every element; an IEEE division each (a reciprocal, two FMAs, a range check and
  /// its branch) was about a tenth of the keys kernel's instructions at E = 512 (ncu, H200).
  __device__ __forceinline__ float prob(int j) const { return exp_of(j) * inv_total; }
  /// TC score of slot j, a chosen element, bitwise as launch_topk_scores computes it: the softmax over the selection
  /// (renormalised variants) or the full-softmax quotient exp(x - max) / sum.
  __device__ __forceinline__ float tc_score(ScoreVariant variant, int j) const {
    return variant == ScoreVariant::kTopKOfSoftmax ? exp_of(j) / total : expf(value(j) - first) / sum_k;
  }
  /// tc_score of the chosen element whose rank key is k, from the key's value: the same float as the element's
  /// (a key keeps an element's value but for -0, which it ranks as +0, and a NaN's payload; exp(x - max) of either is
  /// the same bits), so the same expressions give the same bits.
  __device__ __forceinline__ float tc_score_of_key(ScoreVariant variant, KeyType k) const {
    const float x = Key::value(k);
    return variant == ScoreVariant::kTopKOfSoftmax ? expf(x - m) / total : expf(x - first) / sum_k;
  }
};

// ---- pass 1: keys, token-choice counts, expert offsets -----------------------------------------------------------

/// The end of a keys kernel's block (Warps warps; its 32 tokens' keys of experts e0 .. e0 + TileExperts - 1 in
/// key_tile, row ec = expert e0 + ec, Row words a row; nt tokens live): warp w writes the expert-major keys of
/// experts e0 + w, e0 + w + Warps, ... (one 128-byte row segment of 32 tokens each, a lane a token) and reduces the
/// block's words from each: the largest key not chosen (0 if none), the smallest chosen key (all ones if none) and
/// the mask of chosen tokens, per (expert, block); and adds the block's choices of the expert to its token-choice
/// count f_e (one integer atomic per expert and block that chose it: sums, so the order of the atomics cannot show).
/// Lanes past the last token hold key 0, neutral to all of it. The caller has synchronised the block after filling
/// the tile. token_scale (may be null): the tile holds each unchosen pair's exp(x - max), and the key written is that
/// times its token's token_scale (the row's reciprocal sum: its probability, bitwise prob()'s); a chosen key (sign
/// bit set) is written as it is. An exponential's sign bit is clear, a NaN's too (the GPU's NaN is 0x7fffffff).
/// A warp's addresses are computed once and stepped by a fixed stride per expert, the experts unrolled: the per-expert
/// loop with its 64-bit products was about a fifth of the keys kernel's executed instructions on 1.4B (256,128,8) (ncu
/// source view, session 49).
template <int Warps, int TileExperts, int Row>
__device__ __forceinline__ void write_block_keys(const std::uint32_t* key_tile, std::int32_t* chosen_count, int e0,
                                                 int E, std::int64_t T_, std::int64_t t0, int nt,
                                                 std::uint32_t* keys_by_expert, std::uint32_t* bounds,
                                                 std::int32_t* tc_count, const float* token_scale = nullptr) {
  constexpr int kPerWarp = TileExperts / Warps;
  static_assert(TileExperts % Warps == 0, "every warp takes the same number of the tile's experts");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool token = lane < nt;
  const float scale = token_scale != nullptr && token ? token_scale[lane] : 1.0f;
  const int experts = min(TileExperts, E - e0);
  std::uint32_t* key_out = keys_by_expert + static_cast<std::int64_t>(e0 + warp) * T_ + t0 + lane;
  uint4* bounds_out = reinterpret_cast<uint4*>(bounds) + static_cast<std::int64_t>(e0 + warp) * gridDim.x + blockIdx.x;
  const std::int64_t key_step = static_cast<std::int64_t>(Warps) * T_;
  const std::int64_t bounds_step = static_cast<std::int64_t>(Warps) * gridDim.x;
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) {
    const int ec = warp + i * Warps;
    if (ec >= experts) break;  // warp-uniform
    std::uint32_t key = token ? key_tile[ec * Row + lane] : 0u;
    const bool chosen = (key & kChosen) != 0u;
    if (token_scale != nullptr && !chosen) key = __float_as_uint(__uint_as_float(key) * scale);
    if (token) *key_out = key;
    const std::uint32_t hi = __reduce_max_sync(kFull, chosen ? 0u : key);
    const std::uint32_t lo = __reduce_min_sync(kFull, chosen ? key : ~0u);
    const unsigned mask = __ballot_sync(kFull, chosen);
    if (lane == 0) {
      *bounds_out = make_uint4(hi, lo, mask, 0u);
      chosen_count[ec] = __popc(mask);
    }
    key_out += key_step;
    bounds_out += bounds_step;
  }
  // The counts go out after the block's barrier, a thread an expert, so each atomic instruction covers 32
  // consecutive counters: one per expert from lane 0 of its warp (E single-address requests a block, on the few L2
  // lines that hold f) made the kernel 1.4-1.6x slower on 1.4B and 30B rows (ncu, H200).
  __syncthreads();
  for (int ec = threadIdx.x; ec < experts; ec += blockDim.x)
    if (chosen_count[ec] != 0) atomicAdd(&tc_count[e0 + ec], chosen_count[ec]);
}

template <class T, int PerLane>
__global__ void __launch_bounds__(32 * kKeyWarps, kKeyMinBlocks<T, PerLane>)
    tr_keys_kernel(const T* __restrict__ z, std::int64_t ld, std::int64_t T_, int E, int K, ScoreVariant variant,
                   std::uint32_t* keys, std::uint32_t* keys_by_expert, std::uint32_t* bounds,
                   TokenSelectionStats* __restrict__ selection, T* __restrict__ logits_copy, std::int32_t* tc_count) {
  // The block's keys expert-major, key_tile_bytes<PerLane>() bytes: row ec holds expert e0 + ec's keys of the block's
  // 32 tokens, padded to 33 words, so a warp's writes of one token's 32 experts and its reads of one expert's 32
  // tokens each touch 32 distinct banks.
  extern __shared__ std::uint32_t key_tile[];
  __shared__ std::int32_t chosen_count[kKeyTileExperts<PerLane>];  // the block's choices of each of the tile's experts
  __shared__ float token_scale[kKeyTokens];  // rows in registers: each token's reciprocal sum (write_block_keys)
  constexpr int kRow = kKeyTileRow;
  constexpr bool kRegs = PerLane > 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * kKeyTokens;
  // The backward's copy of the logits, where not from registers (below), by 16-byte chunks where rows allow (a load
  // and a store each, where element by element took one of each per slot). Not for rows of up to 64 experts: two
  // elements a lane, and at the 32 registers of four blocks an SM the chunks' registers spilled.
  const int copy_chunks = static_cast<int>(static_cast<std::int64_t>(E) * sizeof(T) / 16);
  const bool copy_by_16_bytes = (PerLane == 0 || PerLane > 2) && logits_copy != nullptr &&
                                (static_cast<std::int64_t>(E) * sizeof(T)) % 16 == 0 &&
                                (ld * static_cast<std::int64_t>(sizeof(T))) % 16 == 0 &&
                                ((reinterpret_cast<std::uintptr_t>(z) | reinterpret_cast<std::uintptr_t>(logits_copy)) &
                                 15u) == 0;
#pragma unroll
  for (int r = 0; r < kKeyTokensPerWarp; ++r) {
    const int tl = warp * kKeyTokensPerWarp + r;
    const std::int64_t t = t0 + tl;
    if (t >= T_) break;  // warp-uniform
    RowSelection<T, PerLane, /*KeepExp=*/false> row(z + t * ld, E, lane);
    if (logits_copy) {  // the backward's copy, bit for bit
      T* copy = logits_copy + t * E;
      const T* src = z + t * ld;
      if constexpr (kRegs && (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float>)) {
        // From the registers: a bf16 element's float is its bits shifted up (NaN payloads too), an fp32 element is
        // itself; loads of the row again would wait for a second round trip.
#pragma unroll
        for (int j = 0; j < PerLane; ++j) {
          const int i = j * 32 + lane;
          if (i >= E) continue;
          if constexpr (std::is_same_v<T, float>)
            copy[i] = row.v[j];
          else
            reinterpret_cast<unsigned short*>(copy)[i] = static_cast<unsigned short>(__float_as_uint(row.v[j]) >> 16);
        }
      } else if (copy_by_16_bytes) {
        for (int c = lane; c < copy_chunks; c += 32)
          reinterpret_cast<uint4*>(copy)[c] = reinterpret_cast<const uint4*>(src)[c];
      } else if constexpr (kRegs) {
#pragma unroll
        for (int j = 0; j < PerLane; ++j)
          if (j * 32 + lane < E) copy[j * 32 + lane] = src[j * 32 + lane];
      } else {
        for (int i = lane; i < E; i += 32) copy[i] = src[i];
      }
    }
    if constexpr (kRegs) {
      // Rows in registers: each exp(x - max) goes into the tile as the softmax sums it (write_block_keys makes it the
      // probability key with the token's reciprocal sum), and the K chosen keys are written over those afterwards,
      // lane r taking selection r.
      // Each slot choosing between the TC score (an exponential and an IEEE division) and the probability (an
      // exponential) made the warp run both wherever one lane chose the slot, behind three levels of branch
      // synchronisation: 16 such slots a token at E = 512.
      row.select(K, [&](int j, float x) { key_tile[(j * 32 + lane) * kRow + tl] = __float_as_uint(x); });
      if (lane == 0) token_scale[tl] = row.inv_total;
      __syncwarp();  // every lane's exponentials written before any writes a chosen key over one
      using Key = typename RowSelection<T, PerLane, false>::Key;
      if (K <= 32) {
        if (lane < K) {
          const float score = row.tc_score_of_key(variant, row.mine);
          key_tile[Key::index(row.mine) * kRow + tl] = kChosen | __float_as_uint(score);
        }
      } else {
        row.for_each(0, row.slots, [&](int j) {
          if (row.chosen(j))
            key_tile[(j * 32 + lane) * kRow + tl] = kChosen | __float_as_uint(row.tc_score(variant, j));
        });
      }
    } else {
      row.select(K);
      row.for_each(0, row.slots, [&](int j) {
        const int i = j * 32 + lane;
        const std::uint32_t key = row.chosen(j) ? kChosen | __float_as_uint(row.tc_score(variant, j))
                                                : __float_as_uint(row.prob(j));
        keys[t * E + i] = key;  // the token-major row, read back by the transpose below
      });
    }
    if (lane == 0) selection[t] = row.stats();  // for the router backward
  }
  __syncthreads();  // the tile (rows in registers), or this block's key rows (rows from memory), complete
  const int nt = static_cast<int>(min(static_cast<std::int64_t>(kKeyTokens), T_ - t0));
  auto write_experts = [&](int e0) {
    write_block_keys<kKeyWarps, kKeyTileExperts<PerLane>, kKeyTileRow>(key_tile, chosen_count, e0, E, T_, t0, nt,
                                                                      keys_by_expert, bounds, tc_count,
                                                                      kRegs ? token_scale : nullptr);
  };
  if constexpr (kRegs) {
    write_experts(0);
  } else {
    for (int e0 = 0; e0 < E; e0 += kTransposeExperts) {
      if (e0 > 0) __syncthreads();  // the tile's previous experts and their counts read
      for (int i = threadIdx.x; i < kTransposeExperts * kKeyTokens; i += blockDim.x) {
        const int tl = i / kTransposeExperts, ec = i % kTransposeExperts;
        if (tl < nt && e0 + ec < E) key_tile[ec * kRow + tl] = keys[(t0 + tl) * E + e0 + ec];
      }
      __syncthreads();
      write_experts(e0);
    }
  }
  allow_dependent_launch();
}

// Pass 1 with four lanes a token, for the rows most models route: bf16 logits of at most kKeyLaneMaxExperts experts
// in whole 16-byte groups, rows 16-byte aligned, K <= KMax <= 8. The kernel above spends a warp on a token: K rounds
// of a warp-wide maximum, the softmax's two butterflies and every lane's share of the row's keys (28.6 M instructions
// at (40960, 128, 8), ncu, H200). Here a lane takes every fourth 16-byte group of its token's row, all loaded at once
// (and copied for the backward by 16-byte stores), and:
// - selects as top-K's lane kernel does (router_kernels.cu): each group's eight keys from the raw bits, sorted by a
//   network and merged into the lane's best KMax, the token's lanes' lists then merged through shuffles; the same
//   keys, so the same selections in the same order, kth and first;
// - sums the row's exponentials in the warp kernel's order (warp_row_sumexp's: per lane l of 32 the elements l, l + 32,
//   ..., then a butterfly over 16, 8, 4, 2, 1): element 8g + k belongs to that order's lane 8 (g % 4) + k, and lane
//   part holds exactly the groups with g % 4 == part, in the same order, so its eight accumulators are that order's
//   lanes 8 part + k. The butterfly's steps over 16 and 8 are shuffles across the token's lanes (part ^ 2, part ^ 1),
//   the last three add within the lane. Additions commute, so the total is bitwise the warp kernel's, and so are the
//   probabilities and every TC score (the selection's sum in selection order, as RowSelection::select adds it);
// - keeps each exp(x - max) in the tile, then makes it the probability key in place (one multiply), and writes the K
//   chosen keys over them afterwards, the lanes taking selections in turn (one exponential, one division each;
//   __syncwarp orders the lanes' writes).
// Four lanes rather than two: at most four groups a lane in registers (40-48 registers, where two lanes took 73-79),
// and ncu cycles of this kernel 25-51 % below the warp kernel's on the four rows measured (E = 32 to 128), against
// 6-50 % with two (H200, session 80).
// Outputs are bitwise the warp kernel's (tests/gpu/test_gpu_token_rounding.cpp, Bf16KeysRouteAsTheFp32KeysDo, holds
// them to the fp32 rows' warp kernel). A block is still 32 tokens, so the tile, the per-block bounds and
// write_block_keys are the warp kernel's.
constexpr int kKeyLaneMaxExperts = 128;
constexpr int kKeyLanes = 4;
/// Words a row of the lane kernel's tile. A store instruction writes element k of one group of each of a warp's eight
/// tokens, four groups (32 rows) apart across the token's lanes: 33 words put those lanes 8 banks apart.
constexpr int kKeyLaneTileRow = kKeyTokens + 1;

template <int KMax>
__global__ void __launch_bounds__(kKeyTokens * kKeyLanes)
    tr_keys_lane_kernel(const __nv_bfloat16* __restrict__ z, std::int64_t ld, std::int64_t T_, int E, int K,
                        ScoreVariant variant, std::uint32_t* keys_by_expert, std::uint32_t* bounds,
                        TokenSelectionStats* __restrict__ selection, __nv_bfloat16* __restrict__ logits_copy,
                        std::int32_t* tc_count) {
  constexpr int kLanes = kKeyLanes;
  constexpr int kGroups = kKeyLaneMaxExperts / 8 / kLanes;  // 16-byte groups a lane loads, at most
  constexpr int kRow = kKeyLaneTileRow;
  __shared__ std::uint32_t key_tile[kKeyLaneMaxExperts * kRow];
  __shared__ std::int32_t chosen_count[kKeyLaneMaxExperts];
  using Key = RankKey<__nv_bfloat16>;
  const int tl = static_cast<int>(threadIdx.x) / kLanes;
  const int part = static_cast<int>(threadIdx.x) % kLanes;
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * kKeyTokens;
  const int nt = static_cast<int>(min(static_cast<std::int64_t>(kKeyTokens), T_ - t0));
  // Lanes past the last token run on the last token's row and write nothing global (the tile's columns past nt are
  // not read): a token's lanes stay for the shuffles, and so does every lane of the warp.
  const bool live = tl < nt;
  const std::int64_t t = live ? t0 + tl : T_ - 1;
  const uint4* row = reinterpret_cast<const uint4*>(z + t * ld);
  const int groups = E / 8;  // this lane's: part, part + 4, ...
  uint4 v[kGroups];
#pragma unroll
  for (int u = 0; u < kGroups; ++u)
    if (part + kLanes * u < groups) v[u] = __ldg(row + part + kLanes * u);
  if (logits_copy != nullptr && live) {  // the backward's copy, bit for bit
    uint4* copy = reinterpret_cast<uint4*>(logits_copy + t * E);
#pragma unroll
    for (int u = 0; u < kGroups; ++u)
      if (part + kLanes * u < groups) copy[part + kLanes * u] = v[u];
  }
  // The selection (the best KMax keys, descending; 0 ranks below every element) and the row's maximum.
  std::uint32_t best[KMax];
#pragma unroll
  for (int j = 0; j < KMax; ++j) best[j] = 0u;
  float mx = -INFINITY;
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    const int g = part + kLanes * u;
    if (g >= groups) break;
    std::uint32_t group[8];
    bf16_group_keys(v[u], g, group);
    merge_group_into_best<KMax>(best, group);
    float x[8];
    bf16_group_values(v[u], x);
#pragma unroll
    for (int k = 0; k < 8; ++k) mx = fmaxf(mx, x[k]);
  }
#pragma unroll
  for (int o = 1; o < kLanes; o *= 2) {
    std::uint32_t other[KMax];
#pragma unroll
    for (int i = 0; i < KMax; ++i) other[i] = __shfl_xor_sync(kFull, best[KMax - 1 - i], o);
    merge_ascending_into_best<KMax>(best, other);
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
  }
  // exp(x - max) of every element into the tile, and the row's sum in the warp kernel's order (above).
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    const int g = part + kLanes * u;
    if (g >= groups) break;
    float x[8];
    bf16_group_values(v[u], x);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float e = expf(x[k] - mx);
      acc[k] += e;
      key_tile[(g * 8 + k) * kRow + tl] = __float_as_uint(e);
    }
  }
  float total;
  {
    float s[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = acc[k] + __shfl_xor_sync(kFull, acc[k], 2);  // over 16: 8 m + k, 8 (m ^ 2) + k
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] = s[k] + __shfl_xor_sync(kFull, s[k], 1);  // over 8: m ^ 1, the next lane
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = s[k] + s[k + 4];  // over 4
    s[0] = s[0] + s[2], s[1] = s[1] + s[3];              // over 2
    total = s[0] + s[1];                                 // over 1
  }
  const float inv_total = 1.0f / total;
  const float first = Key::value(best[0]);
  float sum_k = 0.0f;
  std::uint32_t kth = 0u;
#pragma unroll
  for (int r = 0; r < KMax; ++r)
    if (r < K) {
      sum_k += expf(Key::value(best[r]) - first);
      kth = best[r];
    }
  // Every element's key as if not chosen: its probability.
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    const int g = part + kLanes * u;
    if (g >= groups) break;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      std::uint32_t& w = key_tile[(g * 8 + k) * kRow + tl];
      w = __float_as_uint(__uint_as_float(w) * inv_total);
    }
  }
  __syncwarp();  // every lane's probability keys written before any writes a chosen key over one
#pragma unroll
  for (int r = 0; r < KMax; ++r)
    if (r < K && r % kLanes == part) {
      const float x = Key::value(best[r]);
      const float score = variant == ScoreVariant::kTopKOfSoftmax ? expf(x - mx) / total : expf(x - first) / sum_k;
      key_tile[Key::index(best[r]) * kRow + tl] = kChosen | __float_as_uint(score);
    }
  if (live && part == 0) selection[t] = {static_cast<std::uint64_t>(kth), first, sum_k, mx, total};
  __syncthreads();
  write_block_keys<kLanes, kKeyLaneMaxExperts, kRow>(key_tile, chosen_count, 0, E, T_, t0, nt, keys_by_expert, bounds,
                                                    tc_count);
  allow_dependent_launch();
}

// ---- pass 2: per expert, the threshold and the grouped rows -------------------------------------------------------

/// Block-wide (Threads threads): the digit d of hist[0, bins) with (count above d) < need <= (count above d) +
/// hist[d], scanning from the largest digit, and need minus the count above d. 1 <= need <= the histogram's total.
template <int Threads, class Scan>
__device__ void find_digit(const std::int32_t* hist, int bins, std::int32_t need, typename Scan::TempStorage& tmp,
                           std::uint32_t& digit_s, std::int32_t& need_s) {
  const int per = bins >= Threads ? bins / Threads : 1;
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

/// Block-wide radix select (Threads threads), 12 + 12 + 8 bits from the top: the need-th largest of the n keys
/// key_at(i) (1 <= need <= n). Returns the key; need becomes how many of the keys equal to it the need-th largest
/// takes, ties their count.
template <int Threads, class Scan, class KeyAt>
__device__ std::uint32_t radix_select(KeyAt&& key_at, std::int64_t n, std::int32_t& need, std::int32_t& ties,
                                      std::int32_t* hist, typename Scan::TempStorage& scan_tmp, std::uint32_t& digit_s,
                                      std::int32_t& need_s) {
  const int lane = threadIdx.x & 31;
  std::uint32_t prefix = 0;
  const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    const std::uint32_t high = pass == 0 ? 0u : ~((1u << (shift + widths[pass])) - 1u);
    for (int b = threadIdx.x; b < bins; b += Threads) hist[b] = 0;
    __syncthreads();
    // kSelectUnroll keys per thread and trip, loaded and matched independently: the loop is bound by the latency
    // of load -> match -> atomic, which the independent chains overlap.
    const unsigned lanes_below = (1u << lane) - 1u;
    for (std::int64_t base = 0; base < n; base += kSelectUnroll * Threads) {  // uniform trip count
      std::uint32_t d[kSelectUnroll];
      bool in[kSelectUnroll];
#pragma unroll
      for (int u = 0; u < kSelectUnroll; ++u) {
        const std::int64_t i = base + u * Threads + threadIdx.x;
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
    __syncthreads();
    find_digit<Threads, Scan>(hist, bins, need, scan_tmp, digit_s, need_s);
    prefix |= digit_s << shift;
    need = need_s;
    if (pass == 2) ties = hist[digit_s];
    __syncthreads();  // hist is cleared by the next pass once every thread has read it
  }
  return prefix;
}

/// Block-wide radix select for short lists (a few thousand keys at most, the bounded select's): 8 + 8 + 8 + 8 bits
/// from the top, 256 bins, each digit found by warp 0 alone (8 bins a lane and a shuffle scan): one pass more than
/// radix_select, but no block-wide scan of 4096 bins per pass. Same contract as radix_select. With Passes < 4 it
/// stops after the top 8 Passes bits: the result is the need-th largest key with its lower bits cleared (a lower
/// bound of it), and need and ties refer to that prefix. hist holds 2 x 256 counters, a pass counting into one half
/// while it clears the other for the next pass, so a pass costs two barriers (counts complete, digit found) and not
/// three. Warp 0 passes the digit, the rank left in it and its count through digit_s, need_s and ties_s, so no thread
/// reads hist after the last barrier and a next call may follow at once.
template <int Passes = 4, class KeyAt>
__device__ std::uint32_t short_radix_select(KeyAt&& key_at, std::int32_t n, std::int32_t& need, std::int32_t& ties,
                                            std::int32_t* hist, std::uint32_t& digit_s, std::int32_t& need_s,
                                            std::int32_t& ties_s) {
  static_assert(Passes >= 1 && Passes <= 4, "8 bits a pass of a 32-bit key");
  constexpr int kBins = 256, kPerLane = kBins / 32;
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  std::uint32_t prefix = 0;
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
#pragma unroll
  for (int pass = 0; pass < Passes; ++pass) {
    const int shift = 24 - 8 * pass;
    const std::uint32_t high = pass == 0 ? 0u : ~((1u << (shift + 8)) - 1u);
    std::int32_t* counts = hist + kBins * (pass & 1);
    if (pass + 1 < Passes) {  // the other half: last read before the previous pass's second barrier
      std::int32_t* next = hist + kBins * ((pass + 1) & 1);
      for (int b = threadIdx.x; b < kBins; b += blockDim.x) next[b] = 0;
    }
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
      if (in && (group & lanes_below) == 0u) atomicAdd(&counts[d], __popc(group));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds bins 255 - 8 l down to 248 - 8 l; the lanes below it hold the larger digits.
      const int top = kBins - 1 - kPerLane * lane;
      std::int32_t h[kPerLane], s = 0;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) h[q] = counts[top - q], s += h[q];
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
          if (acc < need && need <= acc + h[q])
            digit_s = static_cast<std::uint32_t>(top - q), need_s = need - acc, ties_s = h[q];
          acc += h[q];
        }
      }
    }
    __syncthreads();
    // digit_s, need_s and ties_s are written again by warp 0 only after the next pass's first barrier, which every
    // thread reaches after these reads.
    prefix |= digit_s << shift;
    need = need_s;
    if (pass == Passes - 1) ties = ties_s;
  }
  return prefix;
}

/// The position of the n-th (0-based) set bit of m (n < popc(m)): the largest p with at most n set bits below it.
__device__ __forceinline__ int nth_set_bit(std::uint32_t m, int n) {
  int p = 0;
#pragma unroll
  for (int s = 16; s > 0; s >>= 1)
    if (__popc(m & ((1u << (p + s)) - 1u)) <= n) p += s;
  return p;
}

/// Warp-wide: the position in [begin, end) of the n-th (0-based) position i, in order, where is_match(i) holds; -1 if
/// there are n or fewer. The ties at a select's threshold are ranked in token order with it (the cut).
template <class Index, class IsMatch>
__device__ __forceinline__ Index warp_nth_match(Index begin, Index end, std::int32_t n, IsMatch&& is_match, int lane) {
  std::int32_t seen = 0;
  for (Index base = begin; base < end; base += 32) {
    const Index i = base + lane;
    const unsigned b = __ballot_sync(kFull, i < end && is_match(i));
    const int cnt = __popc(b);
    if (seen + cnt > n) return base + nth_set_bit(b, n - seen);
    seen += cnt;
  }
  return -1;
}

/// Warp-wide, lane l holding the kept mask m of block c0 + l, `before` the kept tokens of the blocks below it and
/// `total` the chunk's kept tokens: every kept token of the chunk goes to gather[pos + j] (j its rank in token
/// order) with its score (from its key) to row_scores[pos + j]. Lane l takes kept tokens l, l + 32, ...: it finds
/// the block of its token by a binary search over the lanes' inclusive counts and the token by one over the mask's
/// bits, and issues the keys' loads of two tokens before it writes either, so that the loads of the whole chunk
/// overlap (one lane per block, loading whichever of its 32 tokens were kept, took a dependent load per 8 blocks)
/// and the writes are contiguous.
__device__ __forceinline__ void write_kept_tokens(const std::uint32_t* __restrict__ gcol, std::int64_t c0,
                                                  std::uint32_t m, std::int32_t before, std::int32_t total,
                                                  std::int64_t pos, std::int32_t* __restrict__ gather,
                                                  float* __restrict__ row_scores) {
  const int lane = threadIdx.x & 31;
  const std::int32_t incl = before + __popc(m);
  for (std::int32_t j0 = 0; j0 < total; j0 += 64) {  // uniform trip count
    std::int32_t t[2];  // tokens (T < 2^31: gather holds them as int32)
    std::uint32_t key[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const std::int32_t j = j0 + 32 * u + lane;
      // The block: the number of lanes whose inclusive count is <= j (counts ascend with the lane).
      int blk = 0;
#pragma unroll
      for (int s = 16; s > 0; s >>= 1)
        if (__shfl_sync(kFull, incl, blk + s - 1) <= j) blk += s;
      const std::uint32_t mb = __shfl_sync(kFull, m, blk);
      const std::int32_t within = j - __shfl_sync(kFull, before, blk);
      t[u] = j < total ? static_cast<std::int32_t>((c0 + blk) * 32 + nth_set_bit(mb, within)) : -1;
      key[u] = t[u] >= 0 ? gcol[t[u]] : 0u;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (t[u] >= 0) {
        const std::int64_t g = pos + j0 + 32 * u + lane;
        gather[g] = t[u];
        row_scores[g] = __uint_as_float(key[u] & ~kChosen);  // the TC score of a chosen pair, p of an added one
      }
    }
  }
}

/// Shared memory of whole_column_select.
template <int Threads>
struct WholeColumnShared {
  using Scan = cub::BlockScan<std::int32_t, Threads>;
  typename Scan::TempStorage scan_tmp;
  std::int32_t hist[kSelectBins];
  std::int32_t warp_count[Threads / 32];
  std::uint32_t digit_s;
  std::int32_t need_s, target_warp_s, target_rank_s;
  std::int64_t cut_s;
};

/// The select over expert e's whole column by one CTA, for the experts whose threshold the bounded select cannot
/// bound (too many candidates: many equal keys, such as repeated tokens): the r-th largest key of the column by a
/// 3-pass radix select (12, 12 and 8 bits; a shared histogram with one atomic per distinct digit of a warp); when
/// keys tie at the threshold and only some of the ties are kept, the token where the kept ties stop (the cut) by one
/// ordered pass. Then the kept tokens, ascending, go to gather[g0 ...] (per-warp chunks, ballots), with each block's
/// kept mask and first grouped row and kept counts, as the bounded select writes them. Needs 0 < r < T, r != f.
/// This ran as a kernel of its own after the bounded select, over clusters of CTAs where experts were few, and the
/// launch cost every call 2.6-3.6 us (ncu, H200) for the experts it was almost never given.
template <int Threads>
__device__ void whole_column_select(const std::uint32_t* __restrict__ gcol, std::int64_t T_, std::int64_t r,
                                    std::int64_t g0, int e, std::uint32_t* __restrict__ thresholds,
                                    std::int32_t* __restrict__ gather, float* __restrict__ row_scores,
                                    std::uint32_t* __restrict__ bounds, std::int64_t n_blocks,
                                    std::int32_t* __restrict__ block_kept, std::int32_t* __restrict__ group_kept,
                                    WholeColumnShared<Threads>& sh) {
  constexpr int kWarps = Threads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Per-warp contiguous chunks of the column (multiples of 32) for the ordered passes.
  const std::int64_t chunk = ((T_ + kWarps - 1) / kWarps + 31) / 32 * 32;
  const std::int64_t w_begin = min(T_, warp * chunk), w_end = min(T_, (warp + 1) * chunk);
  std::int32_t need = static_cast<std::int32_t>(r), ties = 0;
  const std::uint32_t thr = radix_select<Threads, typename WholeColumnShared<Threads>::Scan>(
      [&](std::int64_t i) { return gcol[i]; }, T_, need, ties, sh.hist, sh.scan_tmp, sh.digit_s, sh.need_s);
  std::int64_t cut = T_;  // need == ties: every key equal to the threshold is kept
  if (need != ties) {
    // Keep the first `need` ties in token order: the token of tie number `need` (0-based) is the cut.
    std::int32_t c = 0;
    for (std::int64_t base = w_begin; base < w_end; base += 32) {
      const std::int64_t i = base + lane;
      c += __popc(__ballot_sync(kFull, i < w_end && gcol[i] == thr));
    }
    if (lane == 0) sh.warp_count[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
      std::int32_t before = 0;
      for (int w = 0; w < kWarps; ++w) {
        if (need < before + sh.warp_count[w]) {
          sh.target_warp_s = w, sh.target_rank_s = need - before;
          break;
        }
        before += sh.warp_count[w];
      }
    }
    __syncthreads();
    if (warp == sh.target_warp_s) {
      const std::int64_t i = warp_nth_match(w_begin, w_end, sh.target_rank_s,
                                            [&](std::int64_t j) { return gcol[j] == thr; }, lane);
      if (lane == 0 && i >= 0) sh.cut_s = i;
    }
    __syncthreads();
    cut = sh.cut_s;
  }
  if (threadIdx.x == 0) {
    thresholds[2 * e] = thr;
    thresholds[2 * e + 1] = static_cast<std::uint32_t>(cut);
  }
  // The kept tokens in ascending order -> gather[g0 ...], their scores -> row_scores. (warp_count's last readers
  // passed a barrier since.)
  std::int32_t c = 0;
  for (std::int64_t base = w_begin; base < w_end; base += 32) {
    const std::int64_t i = base + lane;
    c += __popc(__ballot_sync(kFull, i < w_end && kept(gcol[i], thr, static_cast<std::uint32_t>(cut), i)));
  }
  if (lane == 0) sh.warp_count[warp] = c;
  __syncthreads();
  std::int64_t pos = g0;
  for (int w = 0; w < warp; ++w) pos += sh.warp_count[w];
  const unsigned below = (1u << lane) - 1u;
  // Each trip is one block of 32 tokens (chunks start at multiples of 32): its kept mask goes to word 3 of the
  // block's bounds and the grouped row of its first kept token to word 0, for the emit pass.
  std::uint32_t* block_words = bounds + 4 * static_cast<std::int64_t>(e) * n_blocks;
  for (std::int64_t base = w_begin; base < w_end; base += 32) {
    const std::int64_t t = base + lane;
    const std::uint32_t key = t < w_end ? gcol[t] : 0u;
    const bool k = t < w_end && kept(key, thr, static_cast<std::uint32_t>(cut), t);
    const unsigned b = __ballot_sync(kFull, k);
    if (lane == 0) {
      const std::int64_t blk = base / 32;
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
// Where a warp's candidates pass its staging (many equal keys: repeated tokens), the expert is flagged and
// the CTA selects it over the whole column (whole_column_select).
constexpr int kBoundedCandidates = 64;  // per warp of a CTA of 512 or 1024 threads; twice that at 256 (below)
constexpr int kBoundedReadBlocks = 4;   // candidate blocks whose keys a warp loads before it stages any
constexpr int kBoundPasses = 3;         // short_radix_select's passes for step 1's bound (below)

template <int Threads>
struct BoundedSelectShared {
  static constexpr int kWarps = Threads / 32;
  // Candidates a warp stages. A CTA of 256 threads gives each warp the chunk of the column two warps of 512 threads
  // share, and the staging of both: with 64, random logits sent experts to the whole-column select (E = 512, T = 600,
  // K = 100, rounding up: 144 of 512 experts).
  static constexpr int kCandidates = Threads < 512 ? kBoundedCandidates * 512 / Threads : kBoundedCandidates;
  // The blocks' bounds that step 1 selects from (where they fit), then the candidates in token order (step 3 on).
  static constexpr int kBoundCache = 2 * kWarps * kBoundedCandidates;
  union {
    struct {
      std::uint32_t staged_key[kWarps][kCandidates];
      std::int32_t staged_token[kWarps][kCandidates];
      union {
        std::uint32_t bound[kBoundCache];
        struct {
          std::uint32_t key[kWarps * kCandidates];
          std::int32_t token[kWarps * kCandidates];
        } cand;
      };
    } bounded;
    WholeColumnShared<Threads> whole;  // only once the expert is flagged, after the last use of `bounded`
  };
  std::int32_t hist[2 * 256];  // short_radix_select's
  std::int32_t warp_cand[kWarps], warp_kept[kWarps];
  std::int32_t warp_rows[kWarps], warp_tiles[kWarps];
  std::uint32_t digit_s;
  std::int32_t need_s, ties_s;
  std::int64_t cut_s;
};

/// The bounded select's CTA size for E experts on a GPU of `sms` SMs: the largest of 1024, 512 and 256 threads at
/// which the E CTAs fit one wave (1024 / Threads CTAs an SM), 256 past that. The kernel is a chain of dependent
/// loads and barriers per CTA, bound by each warp's walk over its chunk of the column: more warps, shorter chunks,
/// where the wave allows. At E = 512 on 132 SMs, 512 threads ran two waves (31 us, ncu, H200).
constexpr int bounded_select_threads(std::int64_t E, std::int64_t sms) {
  return E <= sms ? 1024 : E <= 2 * sms ? 512 : 256;
}
/// Four CTAs of 256 threads an SM need at most 64 registers a thread. The 512 and 1024 variants fit their two and
/// one CTAs unasked (50 and 64 registers): 0 leaves them the compiler's choice (an explicit minimum, 1 or 2, gave the
/// 512 variant 56-57 registers).
template <int Threads>
constexpr int kBoundedSelectMinBlocks = Threads == 256 ? 4 : 0;

template <int Threads>
__global__ void __launch_bounds__(Threads, kBoundedSelectMinBlocks<Threads>)
    tr_select_bounded_kernel(const std::uint32_t* __restrict__ keys_by_expert, std::int64_t T_,
                             const std::int32_t* __restrict__ tc_count, std::int64_t M, RoundingRule rule,
                             std::int32_t* __restrict__ expert_counts, std::int32_t* __restrict__ expert_offsets,
                             std::int32_t* __restrict__ expert_tiles, std::uint32_t* __restrict__ bounds,
                             std::int64_t n_blocks, std::uint32_t* __restrict__ thresholds,
                             std::int32_t* __restrict__ gather, float* __restrict__ row_scores,
                             std::int32_t* __restrict__ full_select, std::int32_t* __restrict__ block_kept,
                             std::int32_t* __restrict__ group_kept) {
  using Shared = BoundedSelectShared<Threads>;
  constexpr int kWarps = Shared::kWarps;
  __shared__ Shared sh;
  auto& staged_key = sh.bounded.staged_key;
  auto& staged_token = sh.bounded.staged_token;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  const int e = static_cast<int>(blockIdx.x);
  const std::uint32_t* gcol = keys_by_expert + static_cast<std::int64_t>(e) * T_;
  wait_for_prior_grid();  // the keys kernel's keys, bounds and token-choice counts
  allow_dependent_launch();
  // The expert's rows r_e (its count rounded) and where they start: each CTA sums the rounded counts and GEMM tiles
  // of the experts before its own (integer sums in a fixed order), so no kernel waits for a scan of them, and writes
  // its own expert's entries of the offsets, the tiles and the counts. That is up to E loads a CTA, E^2 / 2 over the
  // grid (at E = 4096 and 256 threads, 16 a thread), against the keys kernel's T E keys.
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
    if (lane == 0) sh.warp_rows[warp] = rows_before, sh.warp_tiles[warp] = tiles_before;
    __syncthreads();
    rows_before = tiles_before = 0;
    for (int w = 0; w < kWarps; ++w) rows_before += sh.warp_rows[w], tiles_before += sh.warp_tiles[w];
    g0 = rows_before;
    if (threadIdx.x == 0) {
      if (e == 0) expert_offsets[0] = 0, expert_tiles[0] = 0;
      expert_offsets[e + 1] = rows_before + static_cast<std::int32_t>(r);
      expert_tiles[e + 1] = tiles_before + static_cast<std::int32_t>((r + kGemmTileM - 1) / kGemmTileM);
      if (expert_counts) expert_counts[e] = static_cast<std::int32_t>(r);
    }
  }
  if (r == 0) {  // nothing kept (f = 0 counts as "exactly the choices")
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
  //    The bounds are read from memory once, into shared memory where they fit (T <= 64 Threads), not once a pass.
  std::uint32_t bound = drop ? 0xffffffffu : 0u;
  const std::int64_t need_b = drop ? k + 1 : k;
  if (!trivial && need_b <= n_blocks) {
    const std::uint32_t* b = bounds + 4 * static_cast<std::int64_t>(e) * n_blocks + (drop ? 1 : 0);
    const bool cached = n_blocks <= Shared::kBoundCache;  // uniform
    if (cached) {
      for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n_blocks; i += Threads)
        sh.bounded.bound[i] = drop ? ~b[4 * i] : b[4 * i];
      __syncthreads();
    }
    // Three of the four passes: the k-th largest bound with its low 8 bits cleared, a bound at most the exact one, so
    // the candidates below are a superset of the exact bound's (every key that can hold the threshold is among them),
    // larger by the keys within 2^-15 of it (relative), which are almost never there. The fourth pass cost as much as
    // each other, two barriers and warp 0's scan (the select 0.5-1.0 us faster without it, ncu, H200, session 83).
    std::int32_t need = static_cast<std::int32_t>(need_b), ties = 0;
    const std::uint32_t v = short_radix_select<kBoundPasses>(
        [&](std::int32_t i) { return cached ? sh.bounded.bound[i] : (drop ? ~b[4 * i] : b[4 * i]); },
        static_cast<std::int32_t>(n_blocks), need, ties, sh.hist, sh.digit_s, sh.need_s, sh.ties_s);
    bound = drop ? ~v : v;
  }
  // 2. Each warp over its blocks' bounds: its chosen keys counted from the blocks' choice masks, and only the blocks
  //    whose bound reaches past the expert's bound read (kBoundedReadBlocks at a time, their loads overlapping),
  //    their candidates staged in token order.
  const uint4* block_bounds = reinterpret_cast<const uint4*>(bounds) + static_cast<std::int64_t>(e) * n_blocks;
  // An empty chunk (w_begin == w_end == T_ past the last warp with tokens) has no blocks, even with T_ % 32 != 0.
  const std::int64_t blk_begin = w_begin / 32, blk_end = w_end > w_begin ? (w_end + 31) / 32 : blk_begin;
  std::int32_t n_chosen = 0, n_cand = 0;
  for (std::int64_t c0 = blk_begin; c0 < blk_end; c0 += 32) {  // uniform trip count
    const std::int64_t blk = c0 + lane;
    const uint4 bd = blk < blk_end ? block_bounds[blk] : make_uint4(0u, ~0u, 0u, 0u);
    n_chosen += __popc(bd.z);
    const bool reaches = !trivial && blk < blk_end && (drop ? bd.y <= bound : bd.x >= bound);
    for (unsigned todo = __ballot_sync(kFull, reaches); todo != 0u;) {  // uniform, in block order
      std::int32_t i[kBoundedReadBlocks];  // tokens (T < 2^31: gather holds them as int32)
      std::uint32_t key[kBoundedReadBlocks];
#pragma unroll
      for (int u = 0; u < kBoundedReadBlocks; ++u) {
        i[u] = todo != 0u ? static_cast<std::int32_t>((c0 + __ffs(todo) - 1) * 32 + lane) : -1;
        todo &= todo - 1u;
        if (i[u] >= w_end) i[u] = -1;
        key[u] = i[u] >= 0 ? gcol[i[u]] : 0u;
      }
#pragma unroll
      for (int u = 0; u < kBoundedReadBlocks; ++u) {
        const bool chosen = (key[u] & kChosen) != 0u;
        const bool cand = i[u] >= 0 && (drop ? chosen && key[u] <= bound : !chosen && key[u] >= bound);
        const unsigned c = __ballot_sync(kFull, cand);
        const std::int32_t slot = n_cand + __popc(c & below);
        if (cand && slot < Shared::kCandidates) staged_key[warp][slot] = key[u], staged_token[warp][slot] = i[u];
        n_cand += __popc(c);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) n_chosen += __shfl_xor_sync(kFull, n_chosen, o);
  if (lane == 0) sh.warp_cand[warp] = n_cand;
  __syncthreads();
  std::int32_t cand_before = 0, n_cands = 0;
  bool overflow = false;
  for (int w = 0; w < kWarps; ++w) {
    overflow = overflow || sh.warp_cand[w] > Shared::kCandidates;
    if (w < warp) cand_before += sh.warp_cand[w];
    n_cands += sh.warp_cand[w];
  }
  if (overflow) {  // uniform: the whole column. Every thread is past its last use of sh.bounded (the barrier above).
    if (threadIdx.x == 0) full_select[e] = 1;
    whole_column_select<Threads>(gcol, T_, r, g0, e, thresholds, gather, row_scores, bounds, n_blocks, block_kept,
                                 group_kept, sh.whole);
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
    auto& cand = sh.bounded.cand;
    for (int j = lane; j < n_cand; j += 32)
      cand.key[cand_before + j] = staged_key[warp][j], cand.token[cand_before + j] = staged_token[warp][j];
    __syncthreads();
    // Added tokens: the k-th largest unchosen key. Dropped: the (k + 1)-th smallest chosen key, the candidates being
    // the n_cands smallest chosen keys.
    std::int32_t need = static_cast<std::int32_t>(drop ? n_cands - k : k), ties = 0;
    thr = short_radix_select([&](std::int32_t i) { return cand.key[i]; }, n_cands, need, ties, sh.hist, sh.digit_s,
                             sh.need_s, sh.ties_s);
    if (need == ties) {
      cut = T_;  // every key equal to the threshold is kept
    } else {
      // The token of tie number `need` (0-based) in token order: the first `need` ties are kept.
      if (warp == 0) {
        const std::int32_t i = warp_nth_match<std::int32_t>(
            0, n_cands, need, [&](std::int32_t j) { return cand.key[j] == thr; }, lane);
        if (lane == 0 && i >= 0) sh.cut_s = cand.token[i];
      }
      __syncthreads();
      cut = sh.cut_s;
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
    sh.warp_kept[warp] = r >= T_ ? static_cast<std::int32_t>(w_end - w_begin)
                                 : (drop ? n_chosen - n_cand : n_chosen) + (trivial ? 0 : kept_c);
  __syncthreads();
  // 5. The kept tokens in ascending order -> gather[g0 ...], their scores -> row_scores; per block, its kept mask
  //    (word 3 of its bounds) and its first kept token's grouped row (word 0, read in steps 1-2 only). A block's
  //    kept tokens are its chosen ones (every token when r >= T_) with the kept candidates added and the others
  //    removed: outside the candidates only the kept tokens' keys are read (for their scores). 32 blocks at a time,
  //    lane i holding block c0 + i's mask.
  std::int64_t pos = g0;
  for (int w = 0; w < warp; ++w) pos += sh.warp_kept[w];
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
    const std::int32_t total = __shfl_sync(kFull, incl, 31);
    write_kept_tokens(gcol, c0, m, before, total, pos, gather, row_scores);
    pos += total;
  }
}

// ---- pass 3: pair order ---------------------------------------------------------------------------------------------

// The kept pairs come from the select's kept masks (word 3 of each expert's block bounds: bit i of expert e's mask
// of block B is token 32 B + i), so no (token, expert) key is read: a warp's tokens lie in one block of 32 and share
// its masks. PerLane > 0 (E <= 32 PerLane): the CTA stages every expert's first kept row and kept mask of its two
// blocks in shared memory, one load a thread, and each lane reads the masks of its experts from there. (Each warp
// loaded them itself before: 16 warps a block each issuing E loads of 32 lines apiece, which bound the kernel by its
// L1 wavefronts where E = 256: 38 us on 30B (256,256,16), ncu, H200.) PerLane = 0: from memory, 32 experts at a time,
// twice. A kept pair's grouped row is the block's first kept row (word 0 of the same 16 bytes, written by the select)
// plus the kept tokens before it in the block's mask; its score is in row_scores at that row.
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
  constexpr int kTokensPerWarp = kEmitTokensPerWarp<PerLane>, kCtaTokens = kEmitTokens<PerLane>;
  static_assert(PerLane <= 32, "a token's kept experts of a lane are the bits of one word");
  static_assert(32 % kTokensPerWarp == 0 && kCtaTokens % 32 == 0, "a warp's tokens lie in one block of 32");
  static_assert(kCtaTokens <= 32 * 32, "a CTA's blocks of 32 tokens lie in one group of 32 blocks");
  constexpr int kCtaBlocks = kCtaTokens / 32;       // blocks of 32 tokens a CTA
  constexpr int kStagedExperts = kRegs ? 32 * PerLane : 1;
  __shared__ std::int32_t offset_s[kEmitWarps];
  __shared__ std::int64_t before_s[kEmitWarps];
  __shared__ std::int64_t prefix_s;
  __shared__ uint2 words_s[kCtaBlocks][kStagedExperts];  // PerLane > 0: (first kept row, kept mask) of (block, e)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  wait_for_prior_grid();  // the select's kept masks, rows and kept counts
  const std::int64_t b = blockIdx.x;
  const std::int64_t t0 = b * kCtaTokens + warp * kTokensPerWarp;  // this warp's first token
  // The CTA's first pair: the kept pairs of the 32-token blocks before its own, as the select counted them, in
  // whole groups of 32 blocks, then the blocks of its own group before it. Loaded first, summed after the masks'
  // loads are issued; integer sums in a fixed order.
  std::int64_t before = 0;
  {
    const std::int64_t first_blk = b * (kCtaTokens / 32), groups = first_blk / 32;
    for (std::int64_t i = threadIdx.x; i < groups; i += blockDim.x) before += group_kept[i];
    if (static_cast<std::int64_t>(threadIdx.x) < first_blk - 32 * groups)
      before += block_kept[32 * groups + threadIdx.x];
  }
  const std::int64_t blk = t0 / 32;
  const int cta_blk = static_cast<int>(blk - b * kCtaBlocks);
  const uint4* block_words = reinterpret_cast<const uint4*>(bounds);
  auto kept_mask = [&](int e) { return bounds[4 * (static_cast<std::int64_t>(e) * n_blocks + blk) + 3]; };
  std::uint32_t masks[kRegs ? PerLane : 1];  // register variant: slot s is expert 32 s + lane
  if constexpr (kRegs) {
    for (int i = static_cast<int>(threadIdx.x); i < kCtaBlocks * E; i += static_cast<int>(blockDim.x)) {
      const int cb = i / E, e = i - cb * E;
      const std::int64_t bk = b * kCtaBlocks + cb;
      uint2 v = make_uint2(0u, 0u);
      if (bk < n_blocks) {
        const uint4 w = block_words[static_cast<std::int64_t>(e) * n_blocks + bk];
        v = make_uint2(w.x, w.w);
      }
      words_s[cb][e] = v;
    }
    __syncthreads();
#pragma unroll
    for (int sl = 0; sl < PerLane; ++sl) {
      const int e = 32 * sl + lane;
      masks[sl] = t0 < T_ && e < E ? words_s[cta_blk][e].y : 0u;
    }
  }
  // Kept pairs of each of the warp's tokens (0 past T), every lane holding all of them; the register variant also
  // keeps, per token, bit s set where the pair with expert 32 s + lane is kept (the masks themselves die here).
  std::int32_t n[kTokensPerWarp];
  std::uint32_t kept_bits[kTokensPerWarp];
#pragma unroll
  for (int j = 0; j < kTokensPerWarp; ++j) {
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
  for (int j = 0; j < kTokensPerWarp; ++j) warp_total += n[j];
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
  // The kept pair with expert e of the warp's token t -> slot p in pair order, its score, its grouped row g both ways.
  auto emit = [&](int e, std::int64_t t, std::int64_t p) {
    const int bit = static_cast<int>(t & 31);
    uint2 w;  // (the block's first kept row, its kept mask)
    if constexpr (kRegs) {
      w = words_s[cta_blk][e];
    } else {
      const uint4 w4 = block_words[static_cast<std::int64_t>(e) * n_blocks + blk];
      w = make_uint2(w4.x, w4.w);
    }
    const std::int32_t g = static_cast<std::int32_t>(w.x + __popc(w.y & ((1u << bit) - 1u)));
    scores[p] = row_scores[g];
    inverse[p] = g;
    scatter[g] = static_cast<std::int32_t>(p);
  };
  if constexpr (kRegs) {
    // Lane i emits the warp's kept pairs i, i + 32, ... (its tokens' pairs are consecutive slots): the pair's token,
    // slot and expert from the ballots of the kept bits, so each pair's loads and stores are issued once, by one lane.
    // (A lane per expert, as the PerLane = 0 variant below does, ran the emit's code once per slot holding any kept
    // pair, for every token: 2 x 8 times a warp where E = 256, K = 16.)
    std::int32_t total = 0;
#pragma unroll
    for (int j = 0; j < kTokensPerWarp; ++j) {
      if (lane == 0 && t0 + j < T_) token_offsets[t0 + j] = static_cast<std::int32_t>(q + total);
      total += n[j];
    }
    for (std::int32_t i0 = 0; i0 < total; i0 += 32) {  // uniform trip count
      const std::int32_t i = i0 + lane;
      std::int32_t acc = 0, within = 0;
      std::uint32_t hit = 0u;  // the ballot of the slot holding pair i
      int token = 0, slot = 0;
#pragma unroll
      for (int j = 0; j < kTokensPerWarp; ++j) {
#pragma unroll
        for (int sl = 0; sl < PerLane; ++sl) {
          const std::uint32_t bal = __ballot_sync(kFull, (kept_bits[j] >> sl) & 1u);
          const std::int32_t c = __popc(bal);
          if (i >= acc && i < acc + c) hit = bal, within = i - acc, token = j, slot = sl;
          acc += c;
        }
      }
      if (i < total) emit(32 * slot + nth_set_bit(hit, within), t0 + token, q + i);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kTokensPerWarp; ++j) {
      const std::int64_t t = t0 + j;
      if (t >= T_) break;  // warp-uniform
      if (lane == 0) token_offsets[t] = static_cast<std::int32_t>(q);
      const int bit = static_cast<int>(t & 31);
      for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        const bool k = e < E && (kept_mask(e) >> bit) & 1u;
        const unsigned bal = __ballot_sync(kFull, k);
        if (k) emit(e, t, q + __popc(bal & below));
        q += __popc(bal);
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
  wait_for_prior_grid();  // the emit's token offsets and pair rows, the select's bounds before it
  const uint4* block_bounds = reinterpret_cast<const uint4*>(bounds);
  plan_chunk_and_pair_rows(
      expert_offsets, token_offsets, 0, T_, E, inverse, chunks, pairs_per_chunk, plan, pair_rows,
      [&](const std::int32_t* offsets, int e, std::int64_t t0, std::int64_t t1, std::int32_t& first) {
        // Expert e's first kept row at or past tok. An expert that keeps no token has no bounds of its own (the
        // select returns before it writes them): its rows are empty everywhere.
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

/// The router backward, one warp per token: dz = upstream + the TC scores' backward at the choices + the full
/// softmax's backward of the padded pairs (dp_i = the pair's gradient; for kTopKOfSoftmax the choices are
/// full-softmax probabilities too). The token's selection comes from the forward's saved statistics, not from
/// selecting again. Per element i of the row, with g_i the pair gradient of expert i (0 where the token has no pair),
/// dot = sum over the full-softmax part of g_i p_i and gs = sum over the choices of g_k s_k:
///   a choice of a renormalised variant:  dz_i = up_i + s_i (g_i - gs) + p_i (0 - dot)
///   every other element:                 dz_i = up_i + p_i (g_i - dot)
/// Both implementations below (pair gradients in registers, or in a shared-memory window) write these expressions in
/// this order, summing each lane's slots in slot order and then over the warp by a fixed butterfly: deterministic.
__device__ __forceinline__ float tr_logit_grad(float up, float p, float g, float dot, bool tc, float s, float gs) {
  const float direct = tc ? s * (g - gs) : 0.0f;  // dz_k = s_k (g_k - sum_j g_j s_j)
  return up + direct + p * ((tc ? 0.0f : g) - dot);  // a choice's g is not part of the full softmax
}

/// Rows of up to 4 keys a lane (E <= 128), with the pair gradients in registers: slot j of lane l holds expert
/// 32 j + l's. Each of the token's few pairs (K and the rounding's padding) is broadcast to the warp and taken by the
/// lane whose expert's grouped rows [offsets[e], offsets[e + 1]) hold the pair's row, so no pair searches the offsets
/// for its expert (a chain of dependent loads: ncu put a quarter of this kernel's stall samples there on
/// 1.4B (256,128,8)). The loads that do not depend on one another (the pair range, the row and its statistics, the
/// lanes' expert ranges, the upstream gradient) are issued first; every probability and TC score is computed once
/// and kept for the write. kFullSoftmax: ScoreVariant::kTopKOfSoftmax (no TC scores, no choice tests).
/// The generic loop over windows of experts that the wide rows use (tr_backward_token_windowed) ran 792 instructions
/// a token here, with its slots spilled to the stack (ncu, H200, 1.4B (256,128,8)).
/// Occupancy was measured per width: 1 key a lane at five CTAs an SM (48 registers; 21.5 us against 31.5 on 1.4B
/// (1024,32,2)), 2 and 4 at four.
template <class T, int PerLane, bool kFullSoftmax>
__device__ __forceinline__ void tr_backward_token_in_registers(
    ScoreVariant variant, const T* __restrict__ z, std::int64_t T_, int E,
    const TokenSelectionStats* __restrict__ selection, const float* __restrict__ ds,
    const std::int32_t* __restrict__ inverse, const std::int32_t* __restrict__ offsets,
    const std::int32_t* __restrict__ token_offsets, const T* __restrict__ up, std::int64_t ld_up,
    T* __restrict__ dlogits) {
  static_assert(PerLane >= 1 && PerLane <= 4, "rows of up to 4 keys a lane");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kBwdWarps + warp;
  if (t >= T_) return;  // warp-uniform; no block-wide synchronisation below
  const std::int64_t q0 = token_offsets[t];
  const int n = static_cast<int>(token_offsets[t + 1] - q0);  // a token has at most one pair per expert: n <= E
  std::int32_t lo[PerLane], hi[PerLane];  // slot j's expert's grouped rows; an empty range past E
  float u[PerLane];                       // the upstream gradient of slot j's element
  const T* up_row = up ? up + t * ld_up : nullptr;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int e = j * 32 + lane;
    lo[j] = e < E ? offsets[e] : 0;
    hi[j] = e < E ? offsets[e + 1] : 0;
    u[j] = up_row && e < E ? to_float(up_row[e]) : 0.0f;
  }
  const TokenSelectionStats stats = selection[t];  // issued before the row's keys are made from its loads
  RowSelection<T, PerLane, /*KeepExp=*/true> row(z + t * E, E, lane);
  row.restore(stats);
  float dp[PerLane];
#pragma unroll
  for (int j = 0; j < PerLane; ++j) dp[j] = 0.0f;
  const std::int32_t* pair_rows = inverse + q0;
  const float* pair_grads = ds + q0;
  for (int base = 0; base < n; base += 32) {
    const int q = base + lane;
    const std::int32_t g = q < n ? pair_rows[q] : -1;  // -1: no pair, in no expert's range
    const float d = q < n ? pair_grads[q] : 0.0f;
    const int m = min(32, n - base);
    for (int s = 0; s < m; ++s) {
      const std::int32_t g_s = __shfl_sync(kFull, g, s);
      const float d_s = __shfl_sync(kFull, d, s);
#pragma unroll
      for (int j = 0; j < PerLane; ++j)
        if (g_s >= lo[j] && g_s < hi[j]) dp[j] = d_s;  // a token has at most one pair per expert
    }
  }
  // dot = sum_i dp_i p_i over the full-softmax part, gs = sum_k g_k s_k over the choices.
  float p[PerLane], s[PerLane];
  bool tc[PerLane];
  float dot = 0.0f, gs = 0.0f;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    p[j] = 0.0f, s[j] = 0.0f, tc[j] = false;
    if (j * 32 + lane >= E) continue;
    p[j] = row.prob(j);
    if constexpr (!kFullSoftmax) tc[j] = row.chosen(j);
    if (tc[j]) {
      s[j] = row.tc_score(variant, j);
      gs += dp[j] * s[j];
    } else {
      dot += dp[j] * p[j];
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    dot += __shfl_xor_sync(kFull, dot, o);
    if constexpr (!kFullSoftmax) gs += __shfl_xor_sync(kFull, gs, o);
  }
  T* out = dlogits + t * E;
#pragma unroll
  for (int j = 0; j < PerLane; ++j) {
    const int i = j * 32 + lane;
    if (i < E) out[i] = from_float<T>(tr_logit_grad(u[j], p[j], dp[j], dot, tc[j], s[j], gs));
  }
}

/// Rows of 8 or 16 keys a lane or read from memory: the pair gradients in a shared-memory window of kBwdWindow
/// experts, each pair's expert found by binary search. With 8 keys a lane the registers' version needed 115 registers
/// (two CTAs an SM) or spilled, and ran 45-56 us against 40.5 (H100, ncu, (16384,4096,1024,256,4)).
template <class T, int PerLane>
__device__ __forceinline__ void tr_backward_token_windowed(ScoreVariant variant, const T* __restrict__ z,
                                                           std::int64_t T_, int E,
                                                           const TokenSelectionStats* __restrict__ selection,
                                                           const float* __restrict__ ds,
                                                           const std::int32_t* __restrict__ inverse,
                                                           const std::int32_t* __restrict__ offsets,
                                                           const std::int32_t* __restrict__ token_offsets,
                                                           const T* __restrict__ up, std::int64_t ld_up,
                                                           T* __restrict__ dlogits) {
  __shared__ float dp_s[kBwdWarps][kBwdWindow];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kBwdWarps + warp;
  if (t >= T_) return;  // warp-uniform; no block-wide synchronisation below
  RowSelection<T, PerLane, /*KeepExp=*/true> row(z + t * E, E, lane);
  row.restore(selection[t]);
  const std::int64_t q0 = token_offsets[t], q1 = token_offsets[t + 1];
  float* dp = dp_s[warp];
  // The token's pair gradients of experts [w0, w0 + kBwdWindow) (zero where the token has no pair).
  auto place = [&](int w0) {
    for (int i = lane; i < kBwdWindow; i += 32) dp[i] = 0.0f;
    __syncwarp();
    for (std::int64_t q = q0 + lane; q < q1; q += 32) {
      const std::int32_t g = inverse[q];
      if (g < 0) continue;
      const int e = expert_of_row(offsets, E, g);
      if (e >= w0 && e < w0 + kBwdWindow) dp[e - w0] = ds[q];  // a token has at most one pair per expert
    }
    __syncwarp();
  };
  const bool full_softmax = variant == ScoreVariant::kTopKOfSoftmax;
  float dot = 0.0f, gs = 0.0f;
  for (int w0 = 0; w0 < E; w0 += kBwdWindow) {
    place(w0);
    row.for_each(w0 / 32, (w0 + kBwdWindow) / 32, [&](int j) {
      const float g = dp[j * 32 + lane - w0], p = row.prob(j);
      if (full_softmax || !row.chosen(j)) dot += g * p;
      else gs += g * row.tc_score(variant, j);
    });
  }
  for (int o = 16; o > 0; o >>= 1) {
    dot += __shfl_xor_sync(kFull, dot, o);
    gs += __shfl_xor_sync(kFull, gs, o);
  }
  T* out = dlogits + t * E;
  const T* u = up ? up + t * ld_up : nullptr;
  for (int w0 = 0; w0 < E; w0 += kBwdWindow) {
    if (E > kBwdWindow) place(w0);  // one window: the gradients are still there
    row.for_each(w0 / 32, (w0 + kBwdWindow) / 32, [&](int j) {
      const int i = j * 32 + lane;
      const bool tc = !full_softmax && row.chosen(j);
      out[i] = from_float<T>(tr_logit_grad(u ? to_float(u[i]) : 0.0f, row.prob(j), dp[i - w0], dot, tc,
                                           tc ? row.tc_score(variant, j) : 0.0f, gs));
    });
  }
}

/// The router backward where the pair gradients sit in registers (1, 2 or 4 keys a lane), at the occupancy
/// measured best for each width (tr_backward_token_in_registers).
template <class T, int PerLane, bool kFullSoftmax>
__global__ void __launch_bounds__(32 * kBwdWarps, PerLane == 1 ? 5 : 4)
    tr_backward_kernel(ScoreVariant variant, const T* __restrict__ z, std::int64_t T_, int E,
                       const TokenSelectionStats* __restrict__ selection, const float* __restrict__ ds,
                       const std::int32_t* __restrict__ inverse, const std::int32_t* __restrict__ offsets,
                       const std::int32_t* __restrict__ token_offsets, const T* __restrict__ up, std::int64_t ld_up,
                       T* __restrict__ dlogits) {
  static_assert(kBwdGradientsInRegisters<PerLane>, "wider rows use tr_backward_wide_kernel");
  tr_backward_token_in_registers<T, PerLane, kFullSoftmax>(variant, z, T_, E, selection, ds, inverse, offsets,
                                                          token_offsets, up, ld_up, dlogits);
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
  tr_backward_token_windowed<T, PerLane>(variant, z, T_, E, selection, ds, inverse, offsets, token_offsets, up,
                                         ld_up, dlogits);
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

/// The device's SMs (the bounded select's block size depends on them), cached per device by cuda_sm_count.
int sm_count() {
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  const int n = cuda_sm_count(dev);
  if (n <= 0) throw RuntimeError("machmoe: could not read the SM count of CUDA device " + std::to_string(dev));
  return n;
}

/// Opts `kernel` in to `bytes` of dynamic shared memory on the current device (a per-device function attribute), once
/// per kernel and device; nothing to do up to the 48 KiB every kernel may take.
template <class Kernel>
void allow_shared_bytes(Kernel* kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  const std::lock_guard<std::mutex> lock(mu);
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), dev};
  if (done.count(key) != 0) return;
  MACHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.insert(key);
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
  // Counters region (TokenRoundingCounters): kept pairs per block of 32 tokens and per group of 32 blocks, f_e, the
  // flags of the experts the bounded select selected over their whole column.
  const TokenRoundingCounters words = TokenRoundingCounters::of(a.T, a.E);
  if (a.counters_bytes < static_cast<std::size_t>(words.words) * 4)  // a layout bug, not a caller's
    throw RuntimeError("machmoe: token rounding's counters region holds " + std::to_string(a.counters_bytes) +
                       " bytes, needs " + std::to_string(words.words * 4));
  auto* counter_words = static_cast<std::int32_t*>(a.counters);
  std::int32_t* block_kept = counter_words + words.block_kept;
  std::int32_t* group_kept = counter_words + words.group_kept;
  std::int32_t* tc_count = counter_words + words.tc_count;
  std::int32_t* full_select = counter_words + words.full_select;
  MACHMOE_CUDA_CHECK(cudaMemsetAsync(a.counters, 0, a.counters_bytes, stream));
  auto aligned16 = [](const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; };
  if (a.dt == DType::kBF16 && a.E <= kKeyLaneMaxExperts && a.E % 8 == 0 && a.ld_logits % 8 == 0 &&
      aligned16(a.logits) && aligned16(a.logits_copy) && a.K <= 8) {
    const auto* z = static_cast<const __nv_bfloat16*>(a.logits);
    auto* copy = static_cast<__nv_bfloat16*>(a.logits_copy);
    auto launch = [&](auto kmax_c) {
      constexpr int kKMax = decltype(kmax_c)::value;
      tr_keys_lane_kernel<kKMax><<<ceil_div(a.T, kKeyTokens), kKeyTokens * kKeyLanes, 0, stream>>>(
          z, a.ld_logits, a.T, E, K, a.variant, a.keys_by_expert, a.bounds, a.selection, copy, tc_count);
    };
    if (K <= 2) launch(std::integral_constant<int, 2>{});
    else if (K <= 4) launch(std::integral_constant<int, 4>{});
    else launch(std::integral_constant<int, 8>{});
  } else dispatch_data_type(a.dt, [&](auto tag) {
    using Tp = decltype(tag);
    const auto* z = static_cast<const Tp*>(a.logits);
    by_row_width(a.E, [&](auto per_lane) {
      constexpr int kPerLane = decltype(per_lane)::value;
      auto* kernel = tr_keys_kernel<Tp, kPerLane>;
      allow_shared_bytes(kernel, key_tile_bytes<kPerLane>());
      kernel<<<ceil_div(a.T, kKeyTokens), 32 * kKeyWarps, key_tile_bytes<kPerLane>(), stream>>>(
          z, a.ld_logits, a.T, E, K, a.variant, a.keys, a.keys_by_expert, a.bounds, a.selection,
          static_cast<Tp*>(a.logits_copy), tc_count);
    });
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_keys");
  const std::int32_t* counts = tc_count;
  // One CTA per expert, as large as one wave of them allows (bounded_select_threads).
  auto launch_bounded = [&](auto threads) {
    launch_dependent(tr_select_bounded_kernel<decltype(threads)::value>, dim3(static_cast<unsigned>(E)),
                     dim3(threads.value), 0, stream, a.keys_by_expert, a.T, counts, a.tile_m, a.rule, a.expert_counts,
                     a.expert_offsets, a.expert_tiles, a.bounds, ceil_div(a.T, kKeyTokens), a.thresholds, a.gather,
                     a.row_scores, full_select, block_kept, group_kept);
  };
  switch (bounded_select_threads(E, sm_count())) {
    case 1024: launch_bounded(std::integral_constant<int, 1024>{}); break;
    case 512: launch_bounded(std::integral_constant<int, 512>{}); break;
    default: launch_bounded(std::integral_constant<int, 256>{}); break;
  }
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_select_bounded");
  by_row_width(a.E, [&](auto per_lane) {
    constexpr int kPerLane = decltype(per_lane)::value;
    const std::int64_t emit_blocks = ceil_div(a.T, kEmitTokens<kPerLane>);
    launch_dependent(tr_emit_kernel<kPerLane>, dim3(static_cast<unsigned>(emit_blocks)),
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
      if constexpr (!kBwdGradientsInRegisters<kPerLane>)
        launch(tr_backward_wide_kernel<Tp, kPerLane>);
      else if (variant == ScoreVariant::kTopKOfSoftmax)
        launch(tr_backward_kernel<Tp, kPerLane, /*kFullSoftmax=*/true>);
      else
        launch(tr_backward_kernel<Tp, kPerLane, /*kFullSoftmax=*/false>);
    });
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_backward");
}

}  // namespace machmoe::gpu
