// One-off check of session 44 (not a test of the suite): the new top-K registers kernel against main's, bitwise, on random logits with
// ties and special values, every score variant, E = 8..512, K = 1..E (both dtypes where keys differ).
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"
namespace machmoe { namespace gpu_old {
void launch_topk_scores(DType, const void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, ScoreVariant, float*, std::int32_t*, cudaStream_t);
} namespace gpu_new {
void launch_topk_scores(DType, const void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, ScoreVariant, float*, std::int32_t*, cudaStream_t);
} }
using namespace machmoe;
int main() {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  long cases = 0, bad = 0;
  for (int E : {8, 20, 32, 33, 64, 100, 128, 200, 256, 300, 512})
    for (int K : {1, 2, 4, 7, 8, 16, 32, 33, 40, 64, 512}) {
      if (K > E) continue;
      for (int dti = 0; dti < 2; ++dti)
        for (ScoreVariant sv : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm})
          for (int ties = 0; ties < 2; ++ties) {
            const int T = 777;
            std::vector<float> z(size_t(T) * E);
            for (float& v : z) v = ties ? std::round(nd(rng) * 4) / 4 : nd(rng) * 3;
            for (int t = 0; t < T; t += 5) {
              z[size_t(t) * E + (t / 5) % E] = -0.0f; z[size_t(t) * E + (t / 5 + 1) % E] = 0.0f;
              if (t % 15 == 0) z[size_t(t) * E + (t / 5 + 2) % E] = INFINITY;
              if (t % 25 == 0) z[size_t(t) * E + (t / 5 + 3) % E] = -INFINITY;
              if (t % 35 == 0) z[size_t(t) * E + (t / 5 + 4) % E] = NAN;
            }
            const DType dt = dti ? DType::kFP32 : DType::kBF16;
            const size_t eb = dti ? 4 : 2;
            std::vector<unsigned char> host(z.size() * eb);
            for (size_t i = 0; i < z.size(); ++i) {
              if (dti) std::memcpy(&host[i * 4], &z[i], 4);
              else { __nv_bfloat16 b = __float2bfloat16(z[i]); std::memcpy(&host[i * 2], &b, 2); }
            }
            void* dz; float *s0, *s1; std::int32_t *x0, *x1;
            cudaMalloc(&dz, host.size()); cudaMemcpy(dz, host.data(), host.size(), cudaMemcpyHostToDevice);
            cudaMalloc(&s0, size_t(T) * K * 4); cudaMalloc(&s1, size_t(T) * K * 4);
            cudaMalloc(&x0, size_t(T) * K * 4); cudaMalloc(&x1, size_t(T) * K * 4);
            gpu_old::launch_topk_scores(dt, dz, E, T, E, K, sv, s0, x0, nullptr);
            gpu_new::launch_topk_scores(dt, dz, E, T, E, K, sv, s1, x1, nullptr);
            if (cudaDeviceSynchronize() != cudaSuccess) { std::printf("CUDA error\n"); return 2; }
            std::vector<float> a(size_t(T) * K), b(a.size());
            std::vector<std::int32_t> c(a.size()), d(a.size());
            cudaMemcpy(a.data(), s0, a.size() * 4, cudaMemcpyDeviceToHost); cudaMemcpy(b.data(), s1, a.size() * 4, cudaMemcpyDeviceToHost);
            cudaMemcpy(c.data(), x0, a.size() * 4, cudaMemcpyDeviceToHost); cudaMemcpy(d.data(), x1, a.size() * 4, cudaMemcpyDeviceToHost);
            ++cases;
            if (std::memcmp(a.data(), b.data(), a.size() * 4) || c != d) {
              ++bad;
              size_t i = 0; while (i < a.size() && !std::memcmp(&a[i], &b[i], 4) && c[i] == d[i]) ++i;
              std::printf("DIFF E=%d K=%d dt=%d sv=%d ties=%d at %zu: %a/%d vs %a/%d\n", E, K, dti, int(sv), ties, i, a[i], c[i], b[i], d[i]);
            }
            cudaFree(dz); cudaFree(s0); cudaFree(s1); cudaFree(x0); cudaFree(x1);
          }
    }
  std::printf("topk equivalence: %ld cases, %ld differ\n", cases, bad);
  return bad ? 1 : 0;
}
