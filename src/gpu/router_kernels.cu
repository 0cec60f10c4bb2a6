// Router kernels: fused top-K + scores (one warp per token, or two lanes per token for the common bf16 rows) and the
// router backward. Deterministic: every reduction is a fixed-order per-lane loop followed by a fixed butterfly, and
// the two-lane kernel's merges are fixed networks over distinct keys.
#include <cstdint>

#include "gpu/cuda_check.hpp"
#include "gpu/dependent_launch.cuh"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPerLane = 16;  // rows of up to 512 experts are selected from registers

// Selection by repeated warp arg-max over a row held in registers as rank keys: lane l keeps elements l, l + 32,
// ... (the order in which warp_row_max / warp_row_sumexp visit them, so the softmax sums are the backward's). Round
// r takes the largest key below the previous selection's (for rows of up to 256, each lane's keys sorted once and the
// round's candidates their first keys): no element is marked, and the selections are exactly those of
// warp_next_selection. The keys are RankKey<T>'s (device_math.cuh): 32 bits for bf16 rows, one redux
// instruction per warp maximum; 64 bits otherwise, two (value word, then index word among the lanes holding that
// value). Rows longer than 32 * kMaxPerLane take the kernel below.
//
// The kernel is bound by instruction issue (ncu, H100: 0.8 warp instructions issued per scheduler cycle, stalls on
// "not selected" and the math pipe), so a round does only the selection: lane r keeps selection r (K <= 32), and the
// exponentials, the selection's sum (still added in selection order, so the scores are bitwise those of before and
// of token rounding's RowSelection) and the stores come once after the rounds, one lane per selection.
template <class T, int PerLane>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, PerLane <= 4 ? 16 : 1)
    topk_scores_registers_kernel(const T* __restrict__ logits, std::int64_t ld, std::int64_t T_, int E, int K,
                                 ScoreVariant variant, float* __restrict__ scores, std::int32_t* __restrict__ experts) {
  const int lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T_) return;
  const T* z = logits + t * ld;
  using Key = RankKey<T>;  // rows here have at most 32 * kMaxPerLane elements
  using KeyType = typename Key::Type;
  static_assert(32 * kMaxPerLane <= Key::kMaxRow, "row longer than the rank key holds");
  KeyType key[PerLane];
  float value[PerLane];  // the row's elements, for the full softmax (0 past the row; key 0: below every element)
  load_row_slots<T, PerLane>(z, E, lane, 0.0f, value, key);
  // Up to 8 keys a lane (rows of up to 256 experts): sorted once, so a round's candidate is the lane's first key and
  // the winning lane (keys are distinct: each holds its index) moves its next one up: PerLane selects a round instead
  // of a pass over every key below the previous selection. Longer rows keep that pass (sorting 16 costs more than
  // it saves at the K they take). The selections and their order are the same either way.
  constexpr bool kSorted = PerLane <= 8;
  if constexpr (kSorted) sort_keys_descending<PerLane>(key);
  KeyType prev = ~KeyType{0};
  KeyType mine = 0;  // K <= 32: selection `lane` (lanes at or past K keep 0)
  float first = 0.0f;
  float* s = scores + t * K;
  std::int32_t* x = experts + t * K;
  for (int r = 0; r < K; ++r) {
    if constexpr (kSorted) {
      prev = Key::warp_max(key[0]);
      if (key[0] == prev) {
#pragma unroll
        for (int j = 0; j + 1 < PerLane; ++j) key[j] = key[j + 1];
        key[PerLane - 1] = 0;  // below every element: this lane has nothing left
      }
    } else {
      KeyType best = 0;
#pragma unroll
      for (int j = 0; j < PerLane; ++j) best = (key[j] < prev && key[j] > best) ? key[j] : best;
      prev = Key::warp_max(best);
    }
    if (r == 0) first = Key::value(prev);  // selections descend: the first is the maximum (NaN only when all are)
    if (K <= 32) {
      mine = r == lane ? prev : mine;
    } else if ((r & 31) == lane) {  // K > 32: written now, the raw logit read back below by the lane that wrote it
      x[r] = static_cast<std::int32_t>(Key::index(prev));
      s[r] = Key::value(prev);
    }
  }
  const float v = K <= 32 ? Key::value(mine) : 0.0f;  // selection `lane`'s logit (K <= 32)
  float m = first, total = 0.0f;
  if (variant == ScoreVariant::kTopKOfSoftmax) {
    // The full softmax's maximum is the first selection (keys rank NaN lowest; fmaxf over the row gives the same
    // value, and an all-NaN row gives NaN scores either way); its sum in warp_row_sumexp's order.
#pragma unroll
    for (int j = 0; j < PerLane; ++j)
      if (j * 32 + lane < E) total += expf(value[j] - m);
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  } else if (K <= 32) {
    // Softmax over the selection: exp(v_r - first) summed in selection order, r = 0, 1, ...
    const float mine_exp = lane < K ? expf(v - first) : 0.0f;
    for (int r = 0; r < K; ++r) total += __shfl_sync(0xffffffffu, mine_exp, r);
  } else {
    __syncwarp();  // the lanes' raw logits in s, written in the rounds
    for (int r = 0; r < K; ++r) total += expf(s[r] - first);
  }
  // Renormalised (softmax over the selection, router.cpp) or the selection's full-softmax probabilities.
  if (K <= 32) {
    if (lane < K) {
      x[lane] = static_cast<std::int32_t>(Key::index(mine));
      s[lane] = expf(v - m) / total;
    }
  } else {
    __syncwarp();  // every lane has read every s[r] for its total (softmax over the selection) before any is rewritten
    for (int r = lane; r < K; r += 32) s[r] = expf(s[r] - m) / total;
  }
}

// Two lanes per token, for the rows most models route: bf16 logits, at most kLaneMaxExperts experts (whole 16-byte
// groups), K <= KMax <= 8, a score over the selection (kSoftmaxOverTopK, kTopKOfSoftmaxRenorm). The kernel above
// spends a warp on a token: K rounds of a warp-wide maximum over the row's 32 lanes, plus the per-lane sort (14.1 M
// instructions at (40960, 128, 8), ncu, H200). Here each lane takes every other 16-byte group of its token's row, all
// of them loaded at once, and keeps its best KMax rank keys sorted in registers: each group's eight keys come from the
// raw bits (RankKey<bf16>::make_bits), are sorted by a network and merged into the list (merge_group_into_best; no
// branches); the two lanes' lists then merge the same way through shuffles. One lane a token, walking the whole row,
// ran 3.2x fewer instructions but only 5-20 % fewer cycles at E = 128: a token's work was a chain of loads and merges
// on too few warps (ncu, H200, session 79). The keys are the same RankKey<bf16> keys, so the list ends as the first K
// selections in selection order (keys are distinct), and the scores come out of the same expressions in the same order
// (the selection's sum added from selection 0 up): bitwise the kernel above's outputs
// (tests/gpu/test_gpu_token_rounding.cpp, Bf16KeysSelectAsTheFp32KeysDo, holds the two kernels to each other's
// outputs through the fp32 rows, which take the kernel above).
constexpr int kLaneMaxExperts = 128;  // past it the per-lane walk over the row outgrows the warp's rounds
constexpr int kLaneThreads = 128;
constexpr int kLanesPerToken = 2;
constexpr int kLaneGroups = kLaneMaxExperts / 8 / kLanesPerToken;  // 16-byte groups a lane loads, at most

// With the metadata's tile histograms (TopKTileHistograms, launch_topk_scores): a block's tokens make whole
// histogram tiles, at most two (kLaneThreads / 2 tokens of K = 8 pairs: 512 pairs), and more tokens a block where K is
// 1 or 2 (kMetadataTile / K).
constexpr int kLaneMaxTilesPerBlock = 2;
constexpr int lane_threads_with_histograms(std::int64_t K) {
  return static_cast<int>(kLanesPerToken * (kLaneThreads / kLanesPerToken >= kMetadataTile / K
                                                ? kLaneThreads / kLanesPerToken
                                                : kMetadataTile / K));
}

template <int KMax, int Threads, bool kHistograms>
__global__ void __launch_bounds__(Threads)
    topk_scores_lane_kernel(const __nv_bfloat16* __restrict__ logits, std::int64_t ld, std::int64_t T_, int E, int K,
                            float* __restrict__ scores, std::int32_t* __restrict__ experts,
                            TopKTileHistograms histograms) {
  using Key = RankKey<__nv_bfloat16>;
  constexpr int kTokens = Threads / kLanesPerToken;
  const std::int64_t pair = (static_cast<std::int64_t>(blockIdx.x) * Threads + threadIdx.x) / kLanesPerToken;
  const int half = static_cast<int>(threadIdx.x % kLanesPerToken);
  // This block's tiles of the metadata's histograms, counted in shared memory (integer atomics: exact).
  __shared__ std::int32_t tile_counts[kHistograms ? kLaneMaxTilesPerBlock * kLaneMaxExperts : 1];
  if constexpr (kHistograms) {
    for (int i = threadIdx.x; i < kLaneMaxTilesPerBlock * E; i += Threads) tile_counts[i] = 0;
    __syncthreads();
  }
  // Lanes past the last token run on the last one's row and store nothing: both lanes of a token stay for the
  // shuffles, and so does every lane of the warp.
  const bool live = pair < T_;
  const std::int64_t t = live ? pair : T_ - 1;
  const uint4* row = reinterpret_cast<const uint4*>(logits + t * ld);
  const int groups = E / 8;  // this lane's: half, half + 2, ...
  uint4 v[kLaneGroups];
#pragma unroll
  for (int u = 0; u < kLaneGroups; ++u)
    if (half + kLanesPerToken * u < groups) v[u] = __ldg(row + half + kLanesPerToken * u);
  std::uint32_t best[KMax];  // descending; 0 ranks below every element of a row
#pragma unroll
  for (int j = 0; j < KMax; ++j) best[j] = 0u;
#pragma unroll
  for (int u = 0; u < kLaneGroups; ++u) {
    const int g = half + kLanesPerToken * u;
    if (g >= groups) break;
    std::uint32_t group[8];
    bf16_group_keys(v[u], g, group);
    merge_group_into_best<KMax>(best, group);
  }
  // The two lanes' lists: each takes the other's reversed (ascending) and merges it in; both end with the token's.
  std::uint32_t other[KMax];
#pragma unroll
  for (int i = 0; i < KMax; ++i) other[i] = __shfl_xor_sync(0xffffffffu, best[KMax - 1 - i], 1);
  merge_ascending_into_best<KMax>(best, other);
  if (live && half == 0) {
    // As the kernel above after its rounds: selection r's logit v_r, first = v_0 (the maximum), the selection's sum
    // of exp(v_r - first) from r = 0 up, then each score exp(v_r - first) / sum.
    const float first = Key::value(best[0]);
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < KMax; ++r)
      if (r < K) total += expf(Key::value(best[r]) - first);
    float* s = scores + t * K;
    std::int32_t* x = experts + t * K;
    // The block's first pair starts a histogram tile (kTokens * K is a multiple of kMetadataTile).
    const std::int64_t first_pair = static_cast<std::int64_t>(blockIdx.x) * kTokens * K;
#pragma unroll
    for (int r = 0; r < KMax; ++r)
      if (r < K) {
        const auto e = static_cast<std::int32_t>(Key::index(best[r]));
        x[r] = e;
        s[r] = expf(Key::value(best[r]) - first) / total;
        if constexpr (kHistograms)
          atomicAdd(&tile_counts[static_cast<int>((t * K + r - first_pair) / kMetadataTile) * E + e], 1);
      }
  }
  if constexpr (kHistograms) {
    // Every count of the block's tiles, zeros included (nothing zero-fills the histograms first), in the layout of
    // the metadata's tile kernel: hist[e * n_tiles + tile]. Tiles past the last pair are not written.
    __syncthreads();
    const std::int64_t tile0 = static_cast<std::int64_t>(blockIdx.x) * kTokens * K / kMetadataTile;
    const int tiles = static_cast<int>(static_cast<std::int64_t>(kTokens) * K / kMetadataTile);
    for (int i = threadIdx.x; i < tiles * E; i += Threads) {
      const std::int64_t tile = tile0 + i / E;
      if (tile < histograms.n_tiles) histograms.hist[static_cast<std::int64_t>(i % E) * histograms.n_tiles + tile] =
          tile_counts[i];
    }
    // The tile scan's counter of finished blocks, after the histograms (launch_routing_metadata zeroes it otherwise).
    if (blockIdx.x == 0 && threadIdx.x == 0)
      reinterpret_cast<unsigned*>(histograms.hist)[static_cast<std::int64_t>(E) * histograms.n_tiles] = 0u;
  }
  allow_dependent_launch();  // the metadata's tile scan may be scheduled (it waits for this grid's writes)
}

// The same selection for any E, reading the row from L1/L2 in each of the K rounds.
template <class T>
__global__ void topk_scores_kernel(const T* __restrict__ logits, std::int64_t ld, std::int64_t T_, int E, int K,
                                   ScoreVariant variant, float* __restrict__ scores, std::int32_t* __restrict__ experts) {
  const int lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T_) return;
  const T* z = logits + t * ld;
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int r = 0; r < K; ++r) {
    warp_next_selection(z, E, lane, prev_v, prev_i);
    if (lane == 0) {
      experts[t * K + r] = prev_i;
      scores[t * K + r] = prev_v;  // the raw logit for now; turned into a score below
    }
  }
  __syncwarp();
  if (variant != ScoreVariant::kTopKOfSoftmax) {  // renormalised == softmax over the selection (router.cpp)
    if (lane == 0) {
      float m = -INFINITY;
      for (int r = 0; r < K; ++r) m = fmaxf(m, scores[t * K + r]);
      float sum = 0.0f;
      for (int r = 0; r < K; ++r) sum += (scores[t * K + r] = expf(scores[t * K + r] - m));
      for (int r = 0; r < K; ++r) scores[t * K + r] /= sum;
    }
    return;
  }
  const float m = warp_row_max(z, E, lane);
  const float total = warp_row_sumexp(z, E, m, lane);
  if (lane == 0)
    for (int r = 0; r < K; ++r) scores[t * K + r] = expf(scores[t * K + r] - m) / total;
}

// One warp per token. The K selected experts are recovered from the grouped row of each pair (no expert ids are
// kept): e = segment of expert_offsets holding inverse[p]. The lanes share the selections (lane k takes selections
// k, k + 32, ...): a selection's row, expert search and score are independent of the others', and one lane doing
// them in turn (two chains of K dependent loads and binary searches per token) made this kernel latency-bound
// (0.088 ms on 1.4B (256,128,8), H200). Sums over the selections are a fixed butterfly: deterministic.
//
// The token's row of dlogits is written in two passes: every element as if no expert were selected (the upstream
// gradient, plus -p_i gs for kTopKOfSoftmax), then each selection's element again, by the lane that holds the
// selection, with its term. __syncwarp orders the warp's global writes, so the second write is the one that stays
// (experts are distinct within a token). Before, every element searched the token's selections for itself: E K / 32
// compare steps a lane, from shared memory, the bulk of the kernel's instructions.
template <class T>
__global__ void router_backward_kernel(ScoreVariant variant, const float* __restrict__ scores,
                                       const float* __restrict__ ds, const std::int32_t* __restrict__ inverse,
                                       const std::int32_t* __restrict__ offsets, const T* __restrict__ logits,
                                       std::int64_t T_, int E, int K, const T* __restrict__ grad_logits,
                                       std::int64_t ld_grad, T* __restrict__ dlogits,
                                       RouterPairTerm* __restrict__ pair_terms) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= T_) return;
  const float* s = scores + t * K;
  const float* g = ds + t * K;
  const std::int32_t* rows = inverse + t * K;
  T* out = dlogits + t * E;
  const T* up = grad_logits ? grad_logits + t * ld_grad : nullptr;
  const bool full_softmax = variant == ScoreVariant::kTopKOfSoftmax;

  float m = 0.0f, total = 1.0f;
  const T* z = logits ? logits + t * E : nullptr;
  if (full_softmax) {
    m = warp_row_max(z, E, lane);
    total = warp_row_sumexp(z, E, m, lane);
  }
  // gs = sum_k g_k s_k, or sum_k g_k p_k for kTopKOfSoftmax (dropped selections, row < 0, add nothing).
  float gs = 0.0f;
  for (int k = lane; k < K; k += 32) {
    const std::int32_t row = rows[k];
    if (row < 0) continue;
    const float pk = full_softmax ? expf(to_float(z[expert_of_row(offsets, E, row)]) - m) / total : s[k];
    gs += g[k] * pk;
  }
  for (int o = 16; o > 0; o >>= 1) gs += __shfl_xor_sync(0xffffffffu, gs, o);

  // Every element as if unselected: dz_i = p_i (0 - gs) for kTopKOfSoftmax, 0 for the others.
  for (int i = lane; i < E; i += 32) {
    const float prior = up ? to_float(up[i]) : 0.0f;
    out[i] = from_float<T>(full_softmax ? prior + expf(to_float(z[i]) - m) / total * (0.0f - gs) : prior);
  }
  __syncwarp();
  // The selections: dz = p_e (g_k - gs) for kTopKOfSoftmax (dp_e = g_k), s_k (g_k - gs) for the others.
  for (int k = lane; k < K; k += 32) {
    const std::int32_t row = rows[k];
    if (row < 0) {
      if (pair_terms) pair_terms[t * K + k] = {0.0f, 0};
      continue;
    }
    const int e = expert_of_row(offsets, E, row);
    const float prior = up ? to_float(up[e]) : 0.0f;
    if (full_softmax) {
      out[e] = from_float<T>(prior + expf(to_float(z[e]) - m) / total * (g[k] - gs));
    } else {
      const float dz = s[k] * (g[k] - gs);
      out[e] = from_float<T>(prior + dz);
      if (pair_terms) pair_terms[t * K + k] = {dz, e};
    }
  }
}

}  // namespace

bool launch_topk_scores(DType dt, const void* logits, std::int64_t ld, std::int64_t T, std::int64_t E,
                        std::int64_t K, ScoreVariant variant, float* scores, std::int32_t* experts,
                        cudaStream_t stream, TopKTileHistograms histograms) {
  if (T == 0) return false;
  if (dt == DType::kBF16 && E <= kLaneMaxExperts && E % 8 == 0 && ld % 8 == 0 &&
      (reinterpret_cast<std::uintptr_t>(logits) & 15u) == 0 && K <= 8 && variant != ScoreVariant::kTopKOfSoftmax) {
    const auto* z = static_cast<const __nv_bfloat16*>(logits);
    const int e = static_cast<int>(E), k = static_cast<int>(K);
    // The histograms too where a block's tokens make whole tiles: K divides kMetadataTile (K = 1, 2, 4, 8).
    if (histograms.hist != nullptr && kMetadataTile % K == 0) {
      const int threads = lane_threads_with_histograms(K);
      const unsigned grid = ceil_div(T * kLanesPerToken, threads);
      auto run = [&](auto kernel) {
        kernel<<<grid, static_cast<unsigned>(threads), 0, stream>>>(z, ld, T, e, k, scores, experts, histograms);
      };
      static_assert(lane_threads_with_histograms(1) == 512 && lane_threads_with_histograms(2) == 256 &&
                        lane_threads_with_histograms(4) == kLaneThreads &&
                        lane_threads_with_histograms(8) == kLaneThreads,
                    "the block sizes instantiated below");
      if (K == 1) run(topk_scores_lane_kernel<2, 512, true>);
      else if (K == 2) run(topk_scores_lane_kernel<2, 256, true>);
      else if (K == 4) run(topk_scores_lane_kernel<4, kLaneThreads, true>);
      else run(topk_scores_lane_kernel<8, kLaneThreads, true>);
      MACHMOE_CUDA_CHECK_LAUNCH("topk_scores_lane (with the tile histograms)");
      return true;
    }
    const unsigned grid = ceil_div(T * kLanesPerToken, kLaneThreads);
    auto run = [&](auto kernel) {
      kernel<<<grid, kLaneThreads, 0, stream>>>(z, ld, T, e, k, scores, experts, TopKTileHistograms{});
    };
    if (K <= 2) run(topk_scores_lane_kernel<2, kLaneThreads, false>);
    else if (K <= 4) run(topk_scores_lane_kernel<4, kLaneThreads, false>);
    else run(topk_scores_lane_kernel<8, kLaneThreads, false>);
    MACHMOE_CUDA_CHECK_LAUNCH("topk_scores_lane");
    return false;
  }
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    const unsigned grid = ceil_div(T, kWarpsPerBlock);
    const auto* z = static_cast<const Tp*>(logits);
    const int e = static_cast<int>(E), k = static_cast<int>(K);
    auto run = [&](auto kernel) {
      kernel<<<grid, 32 * kWarpsPerBlock, 0, stream>>>(z, ld, T, e, k, variant, scores, experts);
    };
    if (E <= 32) run(topk_scores_registers_kernel<Tp, 1>);
    else if (E <= 64) run(topk_scores_registers_kernel<Tp, 2>);
    else if (E <= 128) run(topk_scores_registers_kernel<Tp, 4>);
    else if (E <= 256) run(topk_scores_registers_kernel<Tp, 8>);
    else if (E <= 32 * kMaxPerLane) run(topk_scores_registers_kernel<Tp, kMaxPerLane>);
    else run(topk_scores_kernel<Tp>);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("topk_scores");
  return false;
}

void launch_router_backward(DType dt, ScoreVariant variant, const float* scores, const float* ds,
                            const std::int32_t* inverse, const std::int32_t* offsets, const void* logits,
                            std::int64_t T, std::int64_t E, std::int64_t K, const void* grad_logits,
                            std::int64_t ld_grad, void* dlogits, RouterPairTerm* pair_terms, cudaStream_t stream) {
  if (T == 0) return;
  if (pair_terms != nullptr && variant == ScoreVariant::kTopKOfSoftmax)
    throw RuntimeError("machmoe: the router backward's pair terms need a score variant whose logit gradient lives "
                       "at the selections (not topk_softmax)");
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    router_backward_kernel<Tp><<<ceil_div(T, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        variant, scores, ds, inverse, offsets, static_cast<const Tp*>(logits), T, static_cast<int>(E),
        static_cast<int>(K), static_cast<const Tp*>(grad_logits), ld_grad, static_cast<Tp*>(dlogits), pair_terms);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("router_backward");
}

}  // namespace machmoe::gpu
