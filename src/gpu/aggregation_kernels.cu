// Aggregation and reduction kernels: per-token gather-sum (no atomics, no scatter), the dS reduction with the
// b2 term, and per-expert column sums (db1, db2). fp32 accumulation in a fixed order everywhere.
#include <cstdint>

#include "gpu/cuda_check.hpp"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

/// v clamped to [0, bound].
__device__ __forceinline__ std::int64_t clamp_index(std::int64_t v, std::int64_t bound) {
  return v < 0 ? 0 : (v > bound ? bound : v);
}

/// VEC consecutive elements of a row, as one load (16 bytes when VEC > 1).
template <class T, int VEC>
struct RowSlice {
  alignas(16) T v[VEC];
};

template <class T, int VEC>
__device__ __forceinline__ RowSlice<T, VEC> load_slice(const T* __restrict__ src) {
  RowSlice<T, VEC> s;
  if constexpr (VEC > 1) *reinterpret_cast<uint4*>(s.v) = *reinterpret_cast<const uint4*>(src);
  else s.v[0] = src[0];
  return s;
}

/// acc += w * slice, element by element (fp32).
template <class T, int VEC>
__device__ __forceinline__ void add_scaled(float (&acc)[VEC], const RowSlice<T, VEC>& s, float w) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] += w * to_float(s.v[v]);
}

/// 16 bytes from global to shared memory without passing through registers (L2 only: the rows are read once).
__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem) {
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

/// Pairs whose rows a thread has in flight at once. A pair's index, then its row, are two dependent loads; one pair
/// at a time kept a single 16-byte load in flight per thread, too few to cover the memory's latency (0.73-0.89 of
/// copy bandwidth on the main rows, H200). A batch's indices are loaded, then all of its rows are copied into shared
/// memory (the thread's own slots: no barrier), and then added in pair order, so the sums are bitwise those of one
/// pair at a time. Held in registers instead, a batch of 4 rows took the kernel to 72 registers (118 with the
/// router's rows) and halved its bandwidth (fewer threads an SM). Measured on an H200 (docs/BENCHMARKS.md, session
/// 66): 4 pairs gave 0.89-1.01 of copy bandwidth forward and 0.80-0.88 backward (with the router's rows); 8 the same
/// forward and less backward (its shared memory allows fewer blocks an SM), 16 less in both.
constexpr int kGatherPairBatch = 4;

/// Shared memory of a block: a batch of 16-byte slices per thread, twice with the router's rows.
inline std::size_t gather_sum_smem_bytes(int threads, bool with_router) {
  return static_cast<std::size_t>(kGatherPairBatch) * (with_router ? 2 : 1) * static_cast<std::size_t>(threads) * 16;
}

/// out[t] = the weighted sum of token t's rows (fixed pair order, fp32), each pair's router term (kRouter:
/// router_pairs[p].dz * router_w[router_pairs[p].expert]) added right after its row. VEC > 1: 16-byte slices staged
/// as above; VEC == 1 (rows not 16-byte aligned): one element at a time from registers.
template <class T, int VEC, bool kRouter>
__device__ __forceinline__ void gather_sum_token(const T* __restrict__ rows, std::int64_t width,
                                                 const float* __restrict__ weights,
                                                 const T* __restrict__ router_w, std::int64_t ld_router,
                                                 const RouterPairTerm* __restrict__ router_pairs,
                                                 const std::int32_t* __restrict__ inverse,
                                                 const std::int32_t* __restrict__ token_offsets, std::int64_t K,
                                                 T* __restrict__ out, std::int64_t ld_out, std::int64_t t,
                                                 std::int64_t row_bound, std::int64_t pair_bound, uint4* staged) {
  constexpr int B = kGatherPairBatch;
  // The bounds keep caller-supplied indices (combine_rows) inside the buffers; the layer's own are in range.
  const std::int64_t p_begin = clamp_index(token_offsets ? token_offsets[t] : t * K, pair_bound);
  const std::int64_t p_end = clamp_index(token_offsets ? token_offsets[t + 1] : (t + 1) * K, pair_bound);
  uint4* row_slot = staged + threadIdx.x;  // batch slot j at row_slot[j * blockDim.x]
  uint4* router_slot = staged + B * blockDim.x + threadIdx.x;  // kRouter: the router rows after the batch's rows
  for (std::int64_t c0 = static_cast<std::int64_t>(threadIdx.x) * VEC; c0 < width;
       c0 += static_cast<std::int64_t>(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    for (std::int64_t p0 = p_begin; p0 < p_end; p0 += B) {
      const std::int64_t left = p_end - p0;  // the batch's pairs at or past it belong to the next token
      std::int32_t g[B];
      float w[B];
      RouterPairTerm r[B];
#pragma unroll
      for (int j = 0; j < B; ++j) {
        g[j] = j < left ? inverse[p0 + j] : -1;
        if (g[j] >= row_bound) g[j] = -1;  // reads nothing, and adds nothing below
        w[j] = j < left && weights ? weights[p0 + j] : 1.0f;
        if (kRouter && j < left) r[j] = router_pairs[p0 + j];
      }
      if constexpr (VEC > 1) {
#pragma unroll
        for (int j = 0; j < B; ++j) {
          if (g[j] < 0) continue;
          copy_async_16(row_slot + j * blockDim.x, rows + static_cast<std::int64_t>(g[j]) * width + c0);
          if constexpr (kRouter)
            copy_async_16(router_slot + j * blockDim.x,
                          router_w + static_cast<std::int64_t>(r[j].expert) * ld_router + c0);
        }
        wait_async_copies();
      }
#pragma unroll
      for (int j = 0; j < B; ++j) {
        if (g[j] < 0) continue;
        RowSlice<T, VEC> row;
        if constexpr (VEC > 1) *reinterpret_cast<uint4*>(row.v) = row_slot[j * blockDim.x];
        else row = load_slice<T, VEC>(rows + static_cast<std::int64_t>(g[j]) * width + c0);
        add_scaled<T, VEC>(acc, row, w[j]);
        if constexpr (kRouter) {
          RowSlice<T, VEC> router_row;
          if constexpr (VEC > 1) *reinterpret_cast<uint4*>(router_row.v) = router_slot[j * blockDim.x];
          else router_row = load_slice<T, VEC>(router_w + static_cast<std::int64_t>(r[j].expert) * ld_router + c0);
          add_scaled<T, VEC>(acc, router_row, r[j].dz);
        }
      }
    }
    T* dst = out + t * ld_out + c0;
    if constexpr (VEC > 1) {
      alignas(16) T vals[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) vals[v] = from_float<T>(acc[v]);
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);
    } else {
      dst[0] = from_float<T>(acc[0]);
    }
  }
}

/// One block per token (a token range: blocks stride over it); each thread owns VEC consecutive columns per chunk
/// (16-byte loads when VEC > 1). Dynamic shared memory: gather_sum_smem_bytes when VEC > 1.
template <class T, int VEC, bool kRouter>
__global__ void gather_sum_kernel(const T* __restrict__ rows, std::int64_t width, const float* __restrict__ weights,
                                  const T* __restrict__ router_w, std::int64_t ld_router,
                                  const RouterPairTerm* __restrict__ router_pairs,
                                  const std::int32_t* __restrict__ inverse,
                                  const std::int32_t* __restrict__ token_offsets, std::int64_t K,
                                  T* __restrict__ out, std::int64_t ld_out,
                                  const std::int32_t* __restrict__ token_range, std::int64_t row_bound,
                                  std::int64_t pair_bound) {
  extern __shared__ uint4 staged[];
  const std::int64_t t_end = token_range ? token_range[1] : static_cast<std::int64_t>(gridDim.x);
  for (std::int64_t t = (token_range ? token_range[0] : 0) + blockIdx.x; t < t_end; t += gridDim.x)
    gather_sum_token<T, VEC, kRouter>(rows, width, weights, router_w, ld_router, router_pairs, inverse, token_offsets,
                                      K, out, ld_out, t, row_bound, pair_bound, staged);
}

/// Without b2: one thread per pair, its partials summed in order (float4 loads when a row of partials is a whole
/// number of them). The warp-per-pair kernel below left 28 of 32 lanes idle at n = 256 (4 partials per pair) and
/// was latency-bound (0.057 ms for 327680 pairs on an H200).
template <int kVec>
__global__ void ds_reduce_rows_kernel(const float* __restrict__ partial, std::int64_t n_tiles,
                                      const std::int32_t* __restrict__ inverse, std::int64_t P,
                                      float* __restrict__ ds) {
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= P) return;
  float s = 0.0f;
  if (inverse[p] >= 0) {
    const float* row = partial + p * n_tiles;
    if constexpr (kVec == 4) {
      for (std::int64_t i = 0; i < n_tiles; i += 4) {
        const float4 v = *reinterpret_cast<const float4*>(row + i);
        s += v.x;
        s += v.y;
        s += v.z;
        s += v.w;
      }
    } else {
      for (std::int64_t i = 0; i < n_tiles; ++i) s += row[i];
    }
  }
  ds[p] = s;
}

/// With b2 (the <dO, b2> term is a d-long dot product): one warp per pair.
template <class T>
__global__ void ds_reduce_kernel(const float* __restrict__ partial, std::int64_t n_tiles,
                                 const std::int32_t* __restrict__ inverse, const std::int32_t* __restrict__ gather,
                                 const std::int32_t* __restrict__ offsets, int E, std::int64_t P,
                                 const T* __restrict__ grad_out, std::int64_t ld_go, const T* __restrict__ b2,
                                 std::int64_t ld_b2, std::int64_t d, float* __restrict__ ds) {
  const int lane = threadIdx.x & 31;
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (p >= P) return;
  const std::int32_t g = inverse[p];
  if (g < 0) {
    if (lane == 0) ds[p] = 0.0f;
    return;
  }
  float s = 0.0f;
  for (std::int64_t i = lane; i < n_tiles; i += 32) s += partial[static_cast<std::int64_t>(p) * n_tiles + i];
  if (b2) {
    const int e = expert_of_row(offsets, E, g);
    const T* go = grad_out + static_cast<std::int64_t>(gather[g]) * ld_go;
    const T* b = b2 + static_cast<std::int64_t>(e) * ld_b2;
    float dot = 0.0f;
    for (std::int64_t k = lane; k < d; k += 32) dot += to_float(go[k]) * to_float(b[k]);
    s += dot;  // per-lane partials of both terms, then one fixed butterfly
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) ds[p] = s;
}

/// O: the gradient's element type (T or float). accumulate: out += sum (fp32, rounded once); an expert with no rows
/// then leaves its row of out untouched.
template <class T, class O>
__global__ void segment_column_sum_kernel(const T* __restrict__ m, std::int64_t ld_m,
                                          const std::int32_t* __restrict__ gather, const float* __restrict__ scores,
                                          const std::int32_t* __restrict__ scatter,
                                          const std::int32_t* __restrict__ offsets, std::int64_t cols,
                                          std::int64_t glu_n, O* __restrict__ out, std::int64_t ld_out_expert,
                                          bool accumulate, unsigned col_blocks) {
  const int e = static_cast<int>(blockIdx.x / col_blocks);
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x % col_blocks) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const std::int64_t g_begin = offsets[e], g_end = offsets[e + 1];
  if (accumulate && g_begin == g_end) return;
  float acc = 0.0f;
  for (std::int64_t g = g_begin; g < g_end; ++g) {
    const std::int64_t row = gather ? gather[g] : g;
    const float w = scores ? scores[scatter[g]] : 1.0f;
    acc += w * to_float(m[row * ld_m + c]);
  }
  const std::int64_t oc = glu_n > 0 ? glu_concat_row(c, glu_n) : c;
  O& dst = out[static_cast<std::int64_t>(e) * ld_out_expert + oc];
  dst = from_float<O>(accumulate ? to_float(dst) + acc : acc);
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

/// combine_rows' backward, one block per token. Pairs go in batches of kCombinePairBatch: for each pair every thread
/// adds its columns' grad_out * row products and writes its columns of the row's gradient; the warps' partial dots
/// (a fixed butterfly each) wait in shared memory, and after the batch one thread per pair sums them in warp order.
/// grad_out[t] is re-read per pair: it stays in L1 between the token's pairs.
constexpr int kCombineMaxThreads = 256;
constexpr int kCombinePairBatch = 32;

template <class T, int VEC>
__global__ void __launch_bounds__(kCombineMaxThreads)
    combine_rows_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ rows, std::int64_t R,
                                 std::int64_t d, const float* __restrict__ scores,
                                 const std::int32_t* __restrict__ row_of_pair,
                                 const std::int32_t* __restrict__ token_offsets, std::int64_t top_k, std::int64_t P,
                                 T* __restrict__ grad_rows, float* __restrict__ grad_scores) {
  __shared__ float partial[kCombinePairBatch][kCombineMaxThreads / 32];
  const std::int64_t t = blockIdx.x;
  const std::int64_t p_begin = clamp_index(token_offsets ? token_offsets[t] : t * top_k, P);
  const std::int64_t p_end = clamp_index(token_offsets ? token_offsets[t + 1] : (t + 1) * top_k, P);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  const T* g = grad_out + t * d;
  for (std::int64_t b0 = p_begin; b0 < p_end; b0 += kCombinePairBatch) {
    const std::int64_t b1 = b0 + kCombinePairBatch < p_end ? b0 + kCombinePairBatch : p_end;
    for (std::int64_t p = b0; p < b1; ++p) {
      const std::int32_t r = row_of_pair[p];  // the same for the whole block: no divergence below
      float dot = 0.0f;
      if (r >= 0 && r < R) {
        const float s = scores[p];
        const T* row = rows + static_cast<std::int64_t>(r) * d;
        T* dst = grad_rows ? grad_rows + static_cast<std::int64_t>(r) * d : nullptr;
        for (std::int64_t c0 = static_cast<std::int64_t>(threadIdx.x) * VEC; c0 < d;
             c0 += static_cast<std::int64_t>(blockDim.x) * VEC) {
          alignas(16) T gv[VEC];
          alignas(16) T out[VEC];
          if constexpr (VEC > 1) *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(g + c0);
          else gv[0] = g[c0];
          if (grad_scores) {
            alignas(16) T rv[VEC];
            if constexpr (VEC > 1) *reinterpret_cast<uint4*>(rv) = *reinterpret_cast<const uint4*>(row + c0);
            else rv[0] = row[c0];
#pragma unroll
            for (int v = 0; v < VEC; ++v) dot += to_float(gv[v]) * to_float(rv[v]);
          }
          if (dst) {
#pragma unroll
            for (int v = 0; v < VEC; ++v) out[v] = from_float<T>(s * to_float(gv[v]));
            if constexpr (VEC > 1) *reinterpret_cast<uint4*>(dst + c0) = *reinterpret_cast<const uint4*>(out);
            else dst[c0] = out[0];
          }
        }
      }
      if (grad_scores) {
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (lane == 0) partial[p - b0][warp] = dot;
      }
    }
    if (grad_scores) {
      __syncthreads();
      if (threadIdx.x < b1 - b0) {
        float sum = 0.0f;
        for (int w = 0; w < warps; ++w) sum += partial[threadIdx.x][w];
        grad_scores[b0 + threadIdx.x] = sum;  // 0 for a pair that reads no row
      }
      __syncthreads();  // the next batch reuses `partial`
    }
  }
}

}  // namespace

void launch_gather_sum(DType dt, const void* rows, std::int64_t width, const float* weights,
                       const GatherRouterTerm& router, const std::int32_t* inverse,
                       const std::int32_t* token_offsets, std::int64_t K, std::int64_t T, void* out,
                       std::int64_t ld_out, cudaStream_t stream, const std::int32_t* token_range,
                       std::int64_t range_blocks, std::int64_t row_bound, std::int64_t pair_bound) {
  if (T == 0 || width == 0 || (token_range != nullptr && range_blocks <= 0)) return;
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    constexpr int kVec = 16 / sizeof(Tp);
    const bool with_router = router.pairs != nullptr;
    const bool vec = width % kVec == 0 && ld_out % kVec == 0 && aligned16(rows) && aligned16(out) &&
                     (!with_router || (router.ld % kVec == 0 && aligned16(router.weight)));
    const std::int64_t lanes = vec ? width / kVec : width;
    const int threads = static_cast<int>(std::min<std::int64_t>(256, (lanes + 31) / 32 * 32));
    const auto grid = static_cast<unsigned>(token_range ? std::min(range_blocks, T) : T);
    const std::size_t smem = vec ? gather_sum_smem_bytes(threads, with_router) : 0;
    auto run = [&](auto kernel) {
      if (smem > 48 * 1024)  // above the default limit of dynamic shared memory (a per-kernel attribute; cheap)
        MACHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)));
      kernel<<<grid, threads, smem, stream>>>(static_cast<const Tp*>(rows), width, weights,
                                           static_cast<const Tp*>(router.weight), router.ld, router.pairs, inverse,
                                           token_offsets, K, static_cast<Tp*>(out), ld_out, token_range, row_bound,
                                           pair_bound);
    };
    if (vec) with_router ? run(gather_sum_kernel<Tp, kVec, true>) : run(gather_sum_kernel<Tp, kVec, false>);
    else with_router ? run(gather_sum_kernel<Tp, 1, true>) : run(gather_sum_kernel<Tp, 1, false>);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("gather_sum");
}

void launch_combine_rows_backward(DType dt, const void* grad_out, const void* rows, std::int64_t R, std::int64_t d,
                                  const float* scores, const std::int32_t* row_of_pair,
                                  const std::int32_t* token_offsets, std::int64_t top_k, std::int64_t T,
                                  std::int64_t P, void* grad_rows, float* grad_scores, cudaStream_t stream) {
  if (grad_scores != nullptr && token_offsets != nullptr && P > 0)  // the padding pairs after the last token's
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(grad_scores, 0, static_cast<std::size_t>(P) * sizeof(float), stream));
  if (T == 0 || (grad_rows == nullptr && grad_scores == nullptr)) return;
  if (d == 0) {  // no columns: every dot is 0
    if (grad_scores != nullptr && token_offsets == nullptr && P > 0)
      MACHMOE_CUDA_CHECK(cudaMemsetAsync(grad_scores, 0, static_cast<std::size_t>(P) * sizeof(float), stream));
    return;
  }
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    constexpr int kVec = 16 / sizeof(Tp);
    const bool vec = d % kVec == 0 && aligned16(grad_out) && aligned16(rows) && aligned16(grad_rows);
    const std::int64_t lanes = vec ? d / kVec : d;
    const int threads = static_cast<int>(std::min<std::int64_t>(kCombineMaxThreads, (lanes + 31) / 32 * 32));
    const auto grid = static_cast<unsigned>(T);
    const auto* go = static_cast<const Tp*>(grad_out);
    const auto* rw = static_cast<const Tp*>(rows);
    auto* gr = static_cast<Tp*>(grad_rows);
    if (vec)
      combine_rows_backward_kernel<Tp, kVec><<<grid, threads, 0, stream>>>(go, rw, R, d, scores, row_of_pair,
                                                                          token_offsets, top_k, P, gr, grad_scores);
    else
      combine_rows_backward_kernel<Tp, 1><<<grid, threads, 0, stream>>>(go, rw, R, d, scores, row_of_pair,
                                                                       token_offsets, top_k, P, gr, grad_scores);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("combine_rows_backward");
}

void launch_ds_reduce(DType dt, const float* partial, std::int64_t n_tiles, const std::int32_t* inverse,
                      const std::int32_t* gather, const std::int32_t* offsets, std::int64_t E, std::int64_t P,
                      const void* grad_out, std::int64_t ld_go, const void* b2, std::int64_t ld_b2, std::int64_t d,
                      float* ds, cudaStream_t stream) {
  if (P == 0) return;
  if (b2 == nullptr) {
    const unsigned grid = ceil_div(P, 256);
    if (n_tiles % 4 == 0 && aligned16(partial))
      ds_reduce_rows_kernel<4><<<grid, 256, 0, stream>>>(partial, n_tiles, inverse, P, ds);
    else
      ds_reduce_rows_kernel<1><<<grid, 256, 0, stream>>>(partial, n_tiles, inverse, P, ds);
    MACHMOE_CUDA_CHECK_LAUNCH("ds_reduce");
    return;
  }
  dispatch_data_type(dt, [&](auto tag) {
    using Tp = decltype(tag);
    ds_reduce_kernel<Tp><<<ceil_div(P, 8), 256, 0, stream>>>(partial, n_tiles, inverse, gather, offsets,
                                                              static_cast<int>(E), P, static_cast<const Tp*>(grad_out),
                                                              ld_go, static_cast<const Tp*>(b2), ld_b2, d, ds);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("ds_reduce");
}

void launch_segment_column_sum(DType dt, const void* m, std::int64_t ld_m, const std::int32_t* gather,
                               const float* scores, const std::int32_t* scatter, const std::int32_t* offsets,
                               std::int64_t E, std::int64_t cols, std::int64_t glu_n, void* out,
                               std::int64_t ld_out_expert, DType out_dt, bool accumulate, cudaStream_t stream) {
  if (E == 0 || cols == 0) return;
  const unsigned col_blocks = ceil_div(cols, 256);
  dispatch_data_and_grad_type(dt, out_dt, [&](auto tag, auto out_tag) {
    using Tp = decltype(tag);
    using Op = decltype(out_tag);
    segment_column_sum_kernel<Tp, Op><<<col_blocks * static_cast<unsigned>(E), 256, 0, stream>>>(
        static_cast<const Tp*>(m), ld_m, gather, scores, scatter, offsets, cols, glu_n, static_cast<Op*>(out),
        ld_out_expert, accumulate, col_blocks);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("segment_column_sum");
}

}  // namespace machmoe::gpu
