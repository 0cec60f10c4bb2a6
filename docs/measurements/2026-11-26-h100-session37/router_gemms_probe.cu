// Router GEMMs alone: forward logits = x W^T, backward dx += dlogits W, dW = dlogits^T x, with cuBLAS as the layer
// calls it (4 MiB workspace) and variants. Times: CUDA events over 50 back-to-back reps after 10 warm-ups.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#define CK(x) do { auto e = (x); if (e != 0) { printf("err %d line %d\n", (int)e, __LINE__); exit(1); } } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ s; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f));
  }
}
__global__ void reduce_partials(const float* part, int S, int n, __nv_bfloat16* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
  float a = 0; for (int s = 0; s < S; ++s) a += part[(size_t)s * n + i]; out[i] = __float2bfloat16(a);
}
template <class F> float timeit(F f, cudaStream_t st) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 10; ++i) f();
  cudaEventRecord(a, st); for (int i = 0; i < 50; ++i) f(); cudaEventRecord(b, st); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b); return ms / 50 * 1000.f;  // us
}
int main() {
  struct C { const char* name; int T, d, E; };
  std::vector<C> cs = {{"1.4B-256", 40960, 768, 128}, {"1.4B-512", 40960, 768, 64}, {"1.4B-1024", 40960, 768, 32},
                       {"7B-256", 24576, 1536, 128}, {"7B-1024", 24576, 1536, 32}, {"30B-256", 32768, 4096, 256},
                       {"120B-2048", 32768, 4096, 64}};
  cublasHandle_t h; CK(cublasCreate(&h)); cudaStream_t st; cudaStreamCreate(&st); CK(cublasSetStream(h, st));
  void* ws4; cudaMalloc(&ws4, 4 << 20); void* ws64; cudaMalloc(&ws64, 64 << 20);
  const float one = 1, zero = 0;
  for (auto c : cs) {
    size_t T = c.T, d = c.d, E = c.E;
    __nv_bfloat16 *x, *w, *lg, *dl, *dx, *dw; float* part;
    cudaMalloc(&x, T * d * 2); cudaMalloc(&w, E * d * 2); cudaMalloc(&lg, T * E * 2); cudaMalloc(&dl, T * E * 2);
    cudaMalloc(&dx, T * d * 2); cudaMalloc(&dw, E * d * 2); cudaMalloc(&part, 64 * E * d * 4);
    fill<<<1024, 256, 0, st>>>(x, T * d, 1); fill<<<1024, 256, 0, st>>>(w, E * d, 2);
    fill<<<1024, 256, 0, st>>>(dl, T * E, 3); fill<<<1024, 256, 0, st>>>(dx, T * d, 4);
    auto fwd = [&] { CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, E, T, d, &one, w, CUDA_R_16BF, d, x, CUDA_R_16BF, d,
                                      &zero, lg, CUDA_R_16BF, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)); };
    auto bdx = [&] { CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, d, T, E, &one, w, CUDA_R_16BF, d, dl, CUDA_R_16BF, E,
                                      &one, dx, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)); };
    auto bdw = [&] { CK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, d, E, T, &one, x, CUDA_R_16BF, d, dl, CUDA_R_16BF, E,
                                      &zero, dw, CUDA_R_16BF, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)); };
    CK(cublasSetWorkspace(h, ws4, 4 << 20));
    float tf = timeit(fwd, st), tx = timeit(bdx, st), tw = timeit(bdw, st);
    CK(cublasSetWorkspace(h, ws64, 64 << 20));
    float tw64 = timeit(bdw, st), tf64 = timeit(fwd, st);
    printf("%-10s T=%d d=%d E=%d | fwd logits %.1f us (64MiB ws %.1f; x read floor %.1f us @3TB/s) | bwd dx+= %.1f us"
           " (floor %.1f) | dW %.1f us, 64MiB ws %.1f (floor %.1f)\n", c.name, c.T, c.d, c.E, tf, tf64,
           T * d * 2 / 3e6, tx, 2.0 * T * d * 2 / 3e6, tw, tw64, T * d * 2 / 3e6);
    // dW by S slices of T (strided-batched, fp32 partials) and a fixed-order sum.
    for (int S : {8, 16, 32, 64}) {
      if (T % S) continue;
      long long Ts = T / S;
      auto split = [&] {
        CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, d, E, Ts, &one, x, CUDA_R_16BF, d, Ts * d, dl,
                                      CUDA_R_16BF, E, Ts * E, &zero, part, CUDA_R_32F, d, (long long)d * E, S,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        reduce_partials<<<(d * E + 255) / 256, 256, 0, st>>>(part, S, d * E, dw);
      };
      CK(cublasSetWorkspace(h, ws4, 4 << 20));
      printf("    dW split S=%d: %.1f us\n", S, timeit(split, st));
    }
    // the two backward GEMMs back to back (as the layer runs them)
    CK(cublasSetWorkspace(h, ws4, 4 << 20));
    printf("    bwd both: %.1f us\n", timeit([&] { bdx(); bdw(); }, st));
    cudaFree(x); cudaFree(w); cudaFree(lg); cudaFree(dl); cudaFree(dx); cudaFree(dw); cudaFree(part);
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
