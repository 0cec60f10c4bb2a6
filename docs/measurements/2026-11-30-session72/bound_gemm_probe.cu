// One strided-batched bf16 GEMM of the cuBLAS bound, called exactly as benchmarks/gpu_bench.cu's batched_gemm_ms
// calls it (row-major (M x K) * (K x N), batch E, fp32 accumulation), for ncu: 3 warm-up calls, then one more.
// nvcc -O2 -arch=sm_90a bound_gemm_probe.cu -lcublas -o bound_gemm_probe; ./bound_gemm_probe E M N K
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#define CK(x) do { auto e = (x); if (e != 0) { printf("error %d at line %d\n", (int)e, __LINE__); return 1; } } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ s; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 3.4f);
  }
}
int main(int argc, char** argv) {
  if (argc != 5) { printf("usage: %s E M N K\n", argv[0]); return 2; }
  const long long E = atoll(argv[1]), M = atoll(argv[2]), N = atoll(argv[3]), K = atoll(argv[4]);
  __nv_bfloat16 *A, *B, *C;
  CK(cudaMalloc(&A, E * M * K * 2)); CK(cudaMalloc(&B, E * K * N * 2)); CK(cudaMalloc(&C, E * M * N * 2));
  fill<<<1024, 256>>>(A, E * M * K, 1); fill<<<1024, 256>>>(B, E * K * N, 2);
  cublasHandle_t h; CK(cublasCreate(&h));
  const float alpha = 1, beta = 0;
  for (int i = 0; i < 4; ++i)  // row-major C = A B is column-major C^T = B^T A^T: m = N, n = M, k = K
    CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_16BF, N, K * N, A,
                                  CUDA_R_16BF, K, M * K, &beta, C, CUDA_R_16BF, N, M * N, E, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
  CK(cudaDeviceSynchronize());
  printf("E %lld M %lld N %lld K %lld done\n", E, M, N, K);
  return 0;
}
