// The GPU reference grouped GEMMs: simple shared-memory-tiled SIMT kernels (fp32 accumulation) that support
// everything the fast Hopper kernels will: A rows gathered by an index (varlen-M), per-expert weights through a
// strided/permuted view (both W1 layouts, transposed uses), the fused epilogues (bias, activation storing H and
// A, the dH epilogue producing dH, A' and dS partials), and varlen-K weight gradients with gathered operands.
// Correctness and generality first; they remain the fallback and the large-shape test reference.
#include "gpu/cuda_check.hpp"
#include "gpu/device_math.cuh"
#include "gpu/kernels.hpp"

namespace machmoe::gpu {
namespace {

constexpr int BM = kGemmTileM, BN = 64, BK = 16, THREADS = 256;
static_assert(BN == kDsTileN, "one dS partial per dH-kernel N-tile");

template <class T>
__device__ __forceinline__ T ld(const void* p, std::int64_t i) {
  return static_cast<const T*>(p)[i];
}

/// acc[i][j] += sum_kk As[kk][4 ty + i] * Bs[kk][4 tx + j]: each thread's 4 x 4 outputs over one BK slice.
__device__ __forceinline__ void tile_product(const float (&As)[BK][BM + 4], const float (&Bs)[BK][BN + 4], int tx,
                                             int ty, float (&acc)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < BK; ++kk) {
    float av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
    for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx * 4 + j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

template <class T, Epilogue EPI>
__global__ void __launch_bounds__(THREADS) varlen_m_gemm_kernel(const VarlenMArgs a) {
  __shared__ float As[BK][BM + 4];
  __shared__ float Bs[BK][BN + 4];
  const int E = static_cast<int>(a.E);
  const std::int32_t tile = static_cast<std::int32_t>(blockIdx.x);
  if (tile >= a.expert_tiles[E]) return;  // the grid is sized for the worst case; no host round trip
  const int e = expert_of_row(a.expert_tiles, E, tile);
  const std::int64_t seg_end = a.expert_offsets[e + 1];
  const std::int64_t m0 = a.expert_offsets[e] + static_cast<std::int64_t>(tile - a.expert_tiles[e]) * BM;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.y) * BN;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const ExpertOperand& b = a.b;
  const std::int64_t b_base = static_cast<std::int64_t>(e) * b.expert_stride;
  const bool b_k_contiguous = b.stride_k == 1;

  float acc[4][4] = {};
  for (std::int64_t k0 = 0; k0 < a.K; k0 += BK) {
#pragma unroll
    for (int r = 0; r < (BM * BK) / THREADS; ++r) {
      const int idx = tid + r * THREADS, m = idx / BK, kk = idx % BK;
      const std::int64_t g = m0 + m, k = k0 + kk;
      float v = 0.0f;
      if (g < seg_end && k < a.K) {
        const std::int64_t row = a.a_gather ? a.a_gather[g] : g + (a.a_row_shift ? a.a_row_shift[e] : 0);
        v = to_float(ld<T>(a.a, row * a.lda + k));
      }
      As[kk][m] = v;
    }
#pragma unroll
    for (int r = 0; r < (BN * BK) / THREADS; ++r) {
      const int idx = tid + r * THREADS;
      const int col = b_k_contiguous ? idx / BK : idx % BN;
      const int kk = b_k_contiguous ? idx % BK : idx / BN;
      const std::int64_t c = n0 + col, k = k0 + kk;
      float v = 0.0f;
      if (c < a.N && k < a.K) {
        const std::int64_t oc = b.permute == 1 ? glu_concat_offset(c, b.half_stride(), b.stride_col) : c * b.stride_col;
        const std::int64_t ok = b.permute == 2 ? glu_concat_offset(k, b.half_stride(), b.stride_k) : k * b.stride_k;
        v = to_float(ld<T>(b.ptr, b_base + oc + ok));
      }
      Bs[kk][col] = v;
    }
    __syncthreads();
    tile_product(As, Bs, tx, ty, acc);
    __syncthreads();
  }

  const bool glu = act_is_glu(a.activation);
  const math::ActParams<float> ap{a.act_alpha, a.act_limit};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t g = m0 + ty * 4 + i;
    const bool row_ok = g < seg_end;
    if constexpr (EPI == Epilogue::kStore || EPI == Epilogue::kUpActivation) {
      if (!row_ok) continue;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t c = n0 + tx * 4 + j;
        v[j] = acc[i][j];
        if (a.bias && c < a.N) {
          const std::int64_t bc = b.permute == 1 ? glu_concat_row(c, b.glu_n) : c;
          v[j] += to_float(ld<T>(a.bias, static_cast<std::int64_t>(e) * a.ld_bias + bc));
        }
        if (a.out && c < a.N) static_cast<T*>(a.out)[g * a.ld_out + c] = from_float<T>(v[j]);
      }
      if constexpr (EPI == Epilogue::kUpActivation) {
        if (!a.act_out) continue;
        T* A = static_cast<T*>(a.act_out) + g * a.ld_act;
        if (glu) {
#pragma unroll
          for (int j = 0; j < 4; j += 2) {  // (gate, up) pairs are adjacent columns 2j', 2j'+1
            const std::int64_t c = n0 + tx * 4 + j;
            if (c < a.N) A[c / 2] = from_float<T>(math::glu_forward(a.activation, v[j], v[j + 1], ap));
          }
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const std::int64_t c = n0 + tx * 4 + j;
            if (c < a.N) A[c] = from_float<T>(act_eval(a.activation, v[j]).value);
          }
        }
      }
    } else {  // kActivationGrad: acc = dA' (columns j of A)
      float ds_local = 0.0f;
      std::int64_t p = -1;
      if (row_ok) {
        p = a.scatter[g];
        const float s = a.scores[p];
        const T* H = static_cast<const T*>(a.h_in) + g * a.ld_h;
        T* dH = static_cast<T*>(a.out) + g * a.ld_out;
        T* Ap = static_cast<T*>(a.act_out) + g * a.ld_act;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::int64_t c = n0 + tx * 4 + j;
          if (c >= a.N) continue;
          const float dap = acc[i][j], da = s * dap;
          float act_value;
          if (glu) {
            const math::GluGrad<float> f =
                math::glu_backward(a.activation, to_float(H[2 * c]), to_float(H[2 * c + 1]), da, ap);
            act_value = f.value;
            dH[2 * c] = from_float<T>(f.d_gate);
            dH[2 * c + 1] = from_float<T>(f.d_up);
          } else {
            const ActValue f = act_eval(a.activation, to_float(H[c]));
            act_value = f.value;
            dH[c] = from_float<T>(da * f.derivative);
          }
          Ap[c] = from_float<T>(s * act_value);
          ds_local += dap * act_value;
        }
      }
      // Row sum over the tile's 64 columns: the 16 lanes sharing ty, fixed butterfly (deterministic).
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) ds_local += __shfl_xor_sync(0xffffffffu, ds_local, o);
      if (row_ok && tx == 0) a.ds_partial[p * gridDim.y + blockIdx.y] = ds_local;
    }
  }
}

/// T: the operands' element type; O: the output's (a.out_dt: T or float). out = (a.accumulate ? out : 0) + C, in
/// fp32, rounded once; an expert with no rows writes zeros, or nothing when accumulating.
template <class T, class O>
__global__ void __launch_bounds__(THREADS) varlen_k_gemm_kernel(const VarlenKArgs a, unsigned m_tiles) {
  __shared__ float As[BK][BM + 4];
  __shared__ float Bs[BK][BN + 4];
  const int e = static_cast<int>(blockIdx.x / m_tiles);
  const std::int64_t m0 = static_cast<std::int64_t>(blockIdx.x % m_tiles) * BM;
  const std::int64_t n0 = static_cast<std::int64_t>(blockIdx.y) * BN;
  const std::int64_t seg_begin = a.expert_offsets[e], seg_end = a.expert_offsets[e + 1];
  if (a.accumulate && seg_begin == seg_end) return;  // adds nothing: the buffer stays bitwise as it was
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  float acc[4][4] = {};
  for (std::int64_t g0 = seg_begin; g0 < seg_end; g0 += BK) {
#pragma unroll
    for (int r = 0; r < (BM * BK) / THREADS; ++r) {
      const int idx = tid + r * THREADS, kk = idx / BM, m = idx % BM;
      const std::int64_t g = g0 + kk;
      float v = 0.0f;
      if (g < seg_end && m0 + m < a.M) {
        const std::int64_t row = a.a_gather ? a.a_gather[g] : g;
        v = to_float(ld<T>(a.a, row * a.lda + m0 + m));
      }
      As[kk][m] = v;
    }
#pragma unroll
    for (int r = 0; r < (BN * BK) / THREADS; ++r) {
      const int idx = tid + r * THREADS, kk = idx / BN, n = idx % BN;
      const std::int64_t g = g0 + kk;
      float v = 0.0f;
      if (g < seg_end && n0 + n < a.N) {
        const std::int64_t row = a.b_gather ? a.b_gather[g] : g;
        v = to_float(ld<T>(a.b, row * a.ldb + n0 + n));
      }
      Bs[kk][n] = v;
    }
    __syncthreads();
    tile_product(As, Bs, tx, ty, acc);
    __syncthreads();
  }
  O* out = static_cast<O*>(a.out) + static_cast<std::int64_t>(e) * a.out_expert_stride;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::int64_t m = m0 + ty * 4 + i;
    if (m >= a.M) continue;
    const std::int64_t row_offset =
        a.glu_concat_n > 0 ? glu_concat_offset(m, a.half_stride(), a.ld_out) : m * a.ld_out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t n = n0 + tx * 4 + j;
      if (n >= a.N) continue;
      O& dst = out[row_offset + n];
      dst = from_float<O>(a.accumulate ? to_float(dst) + acc[i][j] : acc[i][j]);
    }
  }
}

}  // namespace

void launch_varlen_m_gemm(const VarlenMArgs& a, cudaStream_t stream) {
  const std::int64_t max_tiles = (a.P_max + BM - 1) / BM + a.E;  // sum_e ceil(f_e / BM) <= ceil(P / BM) + E
  if (a.P_max == 0 || a.N == 0) return;
  const dim3 grid(static_cast<unsigned>(max_tiles), ceil_div(a.N, BN));
  dispatch_data_type(a.dt, [&](auto tag) {
    using Tp = decltype(tag);
    switch (a.epilogue) {
      case Epilogue::kStore: varlen_m_gemm_kernel<Tp, Epilogue::kStore><<<grid, THREADS, 0, stream>>>(a); break;
      case Epilogue::kUpActivation:
        varlen_m_gemm_kernel<Tp, Epilogue::kUpActivation><<<grid, THREADS, 0, stream>>>(a);
        break;
      case Epilogue::kActivationGrad:
        varlen_m_gemm_kernel<Tp, Epilogue::kActivationGrad><<<grid, THREADS, 0, stream>>>(a);
        break;
    }
  });
  MACHMOE_CUDA_CHECK_LAUNCH("varlen_m_gemm");
}

void launch_varlen_k_gemm(const VarlenKArgs& a, cudaStream_t stream) {
  if (a.E == 0 || a.M == 0 || a.N == 0) return;
  const unsigned m_tiles = ceil_div(a.M, BM);
  const dim3 grid(m_tiles * static_cast<unsigned>(a.E), ceil_div(a.N, BN));
  dispatch_data_and_grad_type(a.dt, a.out_dt, [&](auto tag, auto out_tag) {
    varlen_k_gemm_kernel<decltype(tag), decltype(out_tag)><<<grid, THREADS, 0, stream>>>(a, m_tiles);
  });
  MACHMOE_CUDA_CHECK_LAUNCH("varlen_k_gemm");
}

}  // namespace machmoe::gpu
