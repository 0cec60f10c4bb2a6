// Token rounding on the device, without a sort and without host synchronisation (docs/SPEC.md §5, docs/ROUTING.md).
//
// S'[t, e] = token-choice score if t chose e, else softmax(z_t)[e] - 1 (so every choosing token ranks first).
// Per expert, one block selects the r_e best tokens by (S' desc, token asc) with a radix select over the fp32
// keys, then a warp per token emits its kept pairs in expert order. The backward recomputes the token's choices
// from the kept logits. Keys are fp32 on the GPU (the CPU reference ranks in its own precision).
#include <cub/block/block_scan.cuh>

#include "gpu/cuda_check.hpp"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kWarps = 4;

__device__ __forceinline__ std::uint32_t orderable(float f) {
  const std::uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // larger float -> larger unsigned
}

__device__ __forceinline__ std::int64_t rounded_count(std::int64_t f, std::int64_t T, std::int64_t M,
                                                      RoundingRule rule) {
  const std::int64_t down = (f / M) * M;
  const std::int64_t up = min(((f + M - 1) / M) * M, T);
  if (rule == RoundingRule::kDown) return down;
  if (rule == RoundingRule::kUp) return up;
  return (up - f < f - down) ? up : down;
}

template <class T>
__global__ void token_stats_kernel(const T* __restrict__ z, std::int64_t ld, std::int64_t T_, int E,
                                   float* __restrict__ stats) {
  const int lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  const T* row = z + t * ld;
  const float m = warp_row_max(row, E, lane);
  const float s = warp_row_sumexp(row, E, m, lane);
  if (lane == 0) stats[2 * t] = m, stats[2 * t + 1] = s;
}

__global__ void tc_count_kernel(const std::int32_t* __restrict__ tc_expert, std::int64_t n,
                                std::int32_t* __restrict__ count) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(&count[tc_expert[i]], 1);
}

template <class T>
__device__ __forceinline__ float s_prime(const T* __restrict__ z, std::int64_t ld, const float* __restrict__ stats,
                                         const std::int32_t* __restrict__ tc_expert,
                                         const float* __restrict__ tc_score, int K, std::int64_t t, int e) {
  for (int k = 0; k < K; ++k)
    if (tc_expert[t * K + k] == e) return tc_score[t * K + k];
  return expf(to_float(z[t * ld + e]) - stats[2 * t]) / stats[2 * t + 1] - 1.0f;
}

/// One block per expert: keep the r_e best tokens by (S' desc, token asc).
template <class T>
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const T* __restrict__ z, std::int64_t ld, const float* __restrict__ stats,
                  const std::int32_t* __restrict__ tc_expert, const float* __restrict__ tc_score,
                  const std::int32_t* __restrict__ count, std::int64_t T_, int E, int K, std::int64_t M,
                  RoundingRule rule, std::uint8_t* __restrict__ keep) {
  using BlockScan = cub::BlockScan<std::int32_t, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_tmp;
  __shared__ std::int32_t hist[256];
  __shared__ std::uint32_t prefix_s;
  __shared__ std::int64_t need_s;
  const int e = blockIdx.x;
  const std::int64_t r = rounded_count(count[e], T_, M, rule);
  // Radix select, 8 bits at a time from the top: find the key of the r-th best token and how many ties of it
  // to keep (need).
  std::uint32_t prefix = 0;
  std::int64_t need = r;
  if (r > 0 && r < T_) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
      __syncthreads();
      const std::uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
      for (std::int64_t t = threadIdx.x; t < T_; t += blockDim.x) {
        const std::uint32_t key = orderable(s_prime(z, ld, stats, tc_expert, tc_score, K, t, e));
        if ((key & high_mask) == (prefix & high_mask)) atomicAdd(&hist[(key >> shift) & 0xFF], 1);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        std::int64_t remaining = need;
        int digit = 255;
        for (; digit > 0; --digit) {  // from the largest digit down
          if (hist[digit] >= remaining) break;
          remaining -= hist[digit];
        }
        prefix_s = prefix | (static_cast<std::uint32_t>(digit) << shift);
        need_s = remaining;
      }
      __syncthreads();
      prefix = prefix_s, need = need_s;
      __syncthreads();
    }
  }
  // Ordered pass over tokens: keep keys above the threshold, and the first `need` tokens equal to it.
  std::int32_t ties_before = 0;
  for (std::int64_t base = 0; base < T_; base += blockDim.x) {
    const std::int64_t t = base + threadIdx.x;
    std::uint32_t key = 0;
    if (t < T_) key = orderable(s_prime(z, ld, stats, tc_expert, tc_score, K, t, e));
    const std::int32_t tie = (t < T_ && r > 0 && r < T_ && key == prefix) ? 1 : 0;
    std::int32_t rank, total;
    BlockScan(scan_tmp).ExclusiveSum(tie, rank, total);
    if (t < T_) {
      bool kept;
      if (r <= 0) kept = false;
      else if (r >= T_) kept = true;
      else kept = key > prefix || (tie && ties_before + rank < need);
      keep[t * E + e] = kept ? 1 : 0;
    }
    ties_before += total;
    __syncthreads();
  }
}

__global__ void token_count_kernel(const std::uint8_t* __restrict__ keep, std::int64_t T_, int E,
                                   std::int32_t* __restrict__ token_count) {
  const int lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  int c = 0;
  for (int e = lane; e < E; e += 32) c += keep[t * E + e];
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (lane == 0) token_count[t + 1] = c;
}

__global__ void inclusive_scan_kernel(std::int32_t* __restrict__ v, std::int64_t n) {  // v[1..n] in place, v[0]=0
  using BlockScan = cub::BlockScan<std::int32_t, 1024>;
  __shared__ typename BlockScan::TempStorage tmp;
  __shared__ std::int32_t carry;
  if (threadIdx.x == 0) carry = 0, v[0] = 0;
  __syncthreads();
  for (std::int64_t base = 1; base <= n; base += 1024) {
    const std::int64_t i = base + threadIdx.x;
    const std::int32_t x = i <= n ? v[i] : 0;
    std::int32_t incl, total;
    BlockScan(tmp).InclusiveSum(x, incl, total);
    if (i <= n) v[i] = carry + incl;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
}

template <class T>
__global__ void emit_kernel(const T* __restrict__ z, std::int64_t ld, const float* __restrict__ stats,
                            const std::int32_t* __restrict__ tc_expert, const float* __restrict__ tc_score,
                            const std::uint8_t* __restrict__ keep, const std::int32_t* __restrict__ token_count,
                            std::int64_t T_, int E, int K, std::int32_t* __restrict__ pair_token,
                            std::int32_t* __restrict__ pair_expert, float* __restrict__ pair_score) {
  const int lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  std::int64_t pos = token_count[t];
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const bool k = e < E && keep[t * E + e];
    const unsigned ballot = __ballot_sync(0xffffffffu, k);
    if (k) {
      const std::int64_t q = pos + __popc(ballot & ((1u << lane) - 1u));
      float s = -1.0f;
      for (int j = 0; j < K; ++j)
        if (tc_expert[t * K + j] == e) s = tc_score[t * K + j];
      if (s < 0.0f) s = expf(to_float(z[t * ld + e]) - stats[2 * t]) / stats[2 * t + 1];
      pair_token[q] = static_cast<std::int32_t>(t);
      pair_expert[q] = e;
      pair_score[q] = s;
    }
    pos += __popc(ballot);
  }
}

__global__ void tail_kernel(const std::int32_t* __restrict__ token_count, std::int64_t T_, std::int64_t P_max,
                            std::int32_t* __restrict__ pair_token, std::int32_t* __restrict__ pair_expert,
                            float* __restrict__ pair_score) {
  const std::int64_t q = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= P_max || q < token_count[T_]) return;
  pair_token[q] = static_cast<std::int32_t>(T_);  // past every token: outside all token ranges
  pair_expert[q] = -1;                            // skipped by every kernel
  pair_score[q] = 0.0f;
}

/// One warp per token.
template <class T>
__global__ void tr_backward_kernel(ScoreVariant variant, const T* __restrict__ z, std::int64_t T_, int E, int K,
                                   const float* __restrict__ ds, const std::int32_t* __restrict__ inverse,
                                   const std::int32_t* __restrict__ offsets,
                                   const std::int32_t* __restrict__ token_offsets, const T* __restrict__ up,
                                   std::int64_t ld_up, T* __restrict__ dlogits) {
  __shared__ int tc_e[kWarps][kTokenRoundingMaxK];
  __shared__ float tc_s[kWarps][kTokenRoundingMaxK], tc_g[kWarps][kTokenRoundingMaxK];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= T_) return;
  const T* row = z + t * E;
  const float m = warp_row_max(row, E, lane);
  const float sum = warp_row_sumexp(row, E, m, lane);
  // The token's choices, by the same selection function as the forward's top-K kernel.
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int r = 0; r < K; ++r) {
    warp_next_selection(row, E, lane, prev_v, prev_i);
    if (lane == 0) tc_e[warp][r] = prev_i, tc_g[warp][r] = 0.0f, tc_s[warp][r] = prev_v;
  }
  __syncwarp();
  if (lane == 0) {  // token-choice scores of the variant
    if (variant != ScoreVariant::kTopKOfSoftmax) {  // renormalised == softmax over the selection
      float mk = -INFINITY, sk = 0.0f;
      for (int k = 0; k < K; ++k) mk = fmaxf(mk, tc_s[warp][k]);
      for (int k = 0; k < K; ++k) sk += (tc_s[warp][k] = expf(tc_s[warp][k] - mk));
      for (int k = 0; k < K; ++k) tc_s[warp][k] /= sk;
    } else {
      for (int k = 0; k < K; ++k) tc_s[warp][k] = expf(tc_s[warp][k] - m) / sum;
    }
  }
  __syncwarp();
  // Gradients of the routed pairs: chosen ones to tc_g, padded ones kept for the softmax backward.
  const std::int64_t q0 = token_offsets[t], q1 = token_offsets[t + 1];
  float dot = 0.0f;  // sum_j dp_j p_j over the dense softmax part
  if (lane == 0) {
    for (std::int64_t q = q0; q < q1; ++q) {
      const std::int32_t g = inverse[q];
      if (g < 0) continue;
      const int e = expert_of_row(offsets, E, g);
      bool chosen = false;
      for (int k = 0; k < K; ++k)
        if (tc_e[warp][k] == e) tc_g[warp][k] += ds[q], chosen = true;
      if (!chosen) dot += ds[q] * expf(to_float(row[e]) - m) / sum;
    }
    if (variant == ScoreVariant::kTopKOfSoftmax)
      for (int k = 0; k < K; ++k) dot += tc_g[warp][k] * tc_s[warp][k];
  }
  dot = __shfl_sync(0xffffffffu, dot, 0);
  __syncwarp();
  float gs = 0.0f;
  for (int k = 0; k < K; ++k) gs += tc_g[warp][k] * tc_s[warp][k];
  // dz_i = p_i (dp_i - dot) [+ s_k (g_k - sum g s) at the choices for the softmax-over-top-K-like variants], where
  // dp_i collects the padded pairs of expert i (and the choices for kTopKOfSoftmax). One write per element.
  for (int i = lane; i < E; i += 32) {
    const float p = expf(to_float(row[i]) - m) / sum;
    float dp = 0.0f, direct = 0.0f;
    bool chosen = false;
    for (int k = 0; k < K; ++k)
      if (tc_e[warp][k] == i) {
        chosen = true;
        if (variant == ScoreVariant::kTopKOfSoftmax) dp += tc_g[warp][k];
        else direct += tc_s[warp][k] * (tc_g[warp][k] - gs);
      }
    if (!chosen)
      for (std::int64_t q = q0; q < q1; ++q) {
        const std::int32_t g = inverse[q];
        if (g >= 0 && expert_of_row(offsets, E, g) == i) dp += ds[q];
      }
    dlogits[t * E + i] = from_float<T>((up ? to_float(up[t * ld_up + i]) : 0.0f) + direct + p * (dp - dot));
  }
}

}  // namespace

void launch_token_rounding(const TokenRoundingArgs& a, cudaStream_t stream) {
  const int E = static_cast<int>(a.E), K = static_cast<int>(a.K);
  dispatch_data_type(a.dt, [&](auto tag) {
    using Tp = decltype(tag);
    const Tp* z = static_cast<const Tp*>(a.logits);
    launch_topk_scores(a.dt, a.logits, a.ld_logits, a.T, a.E, a.K, a.variant, a.tc_score, a.tc_expert, stream);
    token_stats_kernel<Tp><<<ceil_div(a.T, kWarps), 32 * kWarps, 0, stream>>>(z, a.ld_logits, a.T, E, a.token_stats);
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(a.expert_count, 0, sizeof(std::int32_t) * a.E, stream));
    tc_count_kernel<<<ceil_div(a.T * a.K, 256), 256, 0, stream>>>(a.tc_expert, a.T * a.K, a.expert_count);
    select_kernel<Tp><<<E, kSelectThreads, 0, stream>>>(z, a.ld_logits, a.token_stats, a.tc_expert, a.tc_score,
                                                        a.expert_count, a.T, E, K, a.tile_m, a.rule, a.keep);
    token_count_kernel<<<ceil_div(a.T, kWarps), 32 * kWarps, 0, stream>>>(a.keep, a.T, E, a.token_count);
    inclusive_scan_kernel<<<1, 1024, 0, stream>>>(a.token_count, a.T);
    emit_kernel<Tp><<<ceil_div(a.T, kWarps), 32 * kWarps, 0, stream>>>(z, a.ld_logits, a.token_stats, a.tc_expert,
                                                                      a.tc_score, a.keep, a.token_count, a.T, E, K,
                                                                      a.pair_token, a.pair_expert, a.pair_score);
    if (a.P_max > 0)
      tail_kernel<<<ceil_div(a.P_max, 256), 256, 0, stream>>>(a.token_count, a.T, a.P_max, a.pair_token,
                                                              a.pair_expert, a.pair_score);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding");
}

void launch_token_rounding_backward(DType dt, ScoreVariant variant, const void* logits, std::int64_t T,
                                    std::int64_t E, std::int64_t K, const float* ds, const std::int32_t* inverse,
                                    const std::int32_t* offsets, const std::int32_t* token_offsets,
                                    const void* grad_logits, std::int64_t ld_grad, void* dlogits,
                                    cudaStream_t stream) {
  if (T == 0) return;
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    tr_backward_kernel<Tp><<<ceil_div(T, kWarps), 32 * kWarps, 0, stream>>>(
        variant, static_cast<const Tp*>(logits), T, static_cast<int>(E), static_cast<int>(K), ds, inverse, offsets,
        token_offsets, static_cast<const Tp*>(grad_logits), ld_grad, static_cast<Tp*>(dlogits));
  });
  MACHMOE_CUDA_CHECK_LAUNCH("token_rounding_backward");
}

}  // namespace machmoe::gpu
