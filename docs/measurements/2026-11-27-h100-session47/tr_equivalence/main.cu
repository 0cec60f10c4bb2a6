// One-off (not a repo test): token rounding forward and backward of main (the base source) against the working tree,
// bitwise, every output, on random logits with exact ties, E 8..600, K 1..E, every rule and score variant.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include "machmoe/memory.hpp"
#include "machmoe/problem.hpp"
#define DECL(N)                                                                                                      \
  extern "C" void N##_fwd(int, long, long, long, long, long, int, int, const void*, long, void*, void*, void*, void*, \
                          unsigned long, void*, void*, void*, void*, void*, void*, void*, void*, void*, void*);             \
  extern "C" void N##_bwd(int, int, const void*, long, long, long, const float*, const int*, const int*, const int*, \
                          void*);
DECL(tr_old)
DECL(tr_new)
using namespace machmoe;
template <class T> std::vector<T> get(const void* p, size_t n) { std::vector<T> v(n); cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost); return v; }
int main() {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  long cases = 0, bad = 0;
  struct C { long T, E, K, M; };
  const C shapes[] = {{1, 8, 8, 8},     {300, 8, 1, 16},   {777, 8, 2, 16},    {4096, 128, 8, 128}, {3000, 128, 128, 64},
                      {2000, 512, 1, 8}, {1500, 512, 16, 32}, {700, 600, 6, 16}, {8192, 64, 4, 128}, {12289, 16, 2, 128},
                      {40960, 128, 8, 128}, {16384, 256, 4, 128}, {40960, 32, 2, 128}, {65536, 8, 2, 128}, {20000, 256, 16, 128},
                      {5000, 64, 2, 128}, {100, 8, 2, 128}, {30000, 16, 2, 128}, {9000, 300, 5, 64}};
  for (const C& c : shapes)
    for (int rule = 0; rule < 3; ++rule)
      for (int sv = 0; sv < 3; ++sv)
        for (int dti = 0; dti < 2; ++dti)
          for (int ties = 0; ties < 2; ++ties) {
            if ((c.T * c.E > 4000000) && (sv != 0 || ties)) continue;  // big shapes: one variant
            const RoundingRule rules[] = {RoundingRule::kNearest, RoundingRule::kUp, RoundingRule::kDown};
            const ScoreVariant svs[] = {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm};
            MoEProblem p;
            p.T = c.T, p.E = c.E, p.K = c.K, p.d = 1, p.n = 1, p.routing = RoutingMode::kTokenRounding;
            p.rounding = rules[rule], p.tile_m = c.M, p.score = svs[sv];
            const DType dt = dti ? DType::kFP32 : DType::kBF16;
            const long P = p.max_pairs();
            const ForwardWorkspaceLayout wl = forward_workspace_layout(p, dt);
            std::vector<float> z(size_t(c.T) * c.E);
            const long rep = ties ? 3 : 0;
            for (long t = 0; t < c.T; ++t)
              for (long e = 0; e < c.E; ++e)
                z[t * c.E + e] = rep && t >= rep ? z[(t % rep) * c.E + e] : (ties ? std::round(nd(rng) * 4) / 4 : nd(rng));
            const size_t eb = dti ? 4 : 2;
            std::vector<unsigned char> host(z.size() * eb);
            for (size_t i = 0; i < z.size(); ++i) {
              if (dti) std::memcpy(&host[i * 4], &z[i], 4);
              else { __nv_bfloat16 b = __float2bfloat16(z[i]); std::memcpy(&host[i * 2], &b, 2); }
            }
            void* dz; cudaMalloc(&dz, host.size()); cudaMemcpy(dz, host.data(), host.size(), cudaMemcpyHostToDevice);
            struct Out { void *ws, *counts, *offsets, *tiles, *scatter, *inverse, *gather, *tok, *scores, *ds, *dl, *keys; } o[2];
            std::vector<float> dsh(P);
            for (float& v : dsh) v = nd(rng);
            for (int s = 0; s < 2; ++s) {
              cudaMalloc(&o[s].ws, wl.total_bytes); cudaMemset(o[s].ws, 0xab, wl.total_bytes);
              cudaMalloc(&o[s].counts, c.E * 4); cudaMalloc(&o[s].offsets, (c.E + 1) * 4); cudaMalloc(&o[s].tiles, (c.E + 1) * 4);
              cudaMalloc(&o[s].scatter, P * 4); cudaMalloc(&o[s].inverse, P * 4); cudaMalloc(&o[s].gather, P * 4);
              cudaMalloc(&o[s].tok, (c.T + 1) * 4); cudaMalloc(&o[s].scores, P * 4); cudaMalloc(&o[s].ds, P * 4);
              cudaMalloc(&o[s].dl, c.T * c.E * eb);
              cudaMalloc(&o[s].keys, c.T * c.E * 4); cudaMemset(o[s].keys, 0xab, c.T * c.E * 4);  // token-major keys
              for (void* q : {o[s].scatter, o[s].gather}) cudaMemset(q, 0, P * 4);
              cudaMemcpy(o[s].ds, dsh.data(), P * 4, cudaMemcpyHostToDevice);
              char* w = static_cast<char*>(o[s].ws);
              auto f = s ? tr_new_fwd : tr_old_fwd;
              f(int(dt), c.T, c.E, c.K, c.M, P, int(svs[sv]), int(rules[rule]), dz, c.E, o[s].keys,
                w + wl.tr_keys_by_expert.offset, w + wl.tr_thresholds.offset, w + wl.tr_counters.offset, wl.tr_counters.bytes,
                o[s].counts, o[s].offsets, o[s].tiles, o[s].scatter, o[s].inverse, o[s].gather, o[s].tok, o[s].scores,
                w + wl.tr_bounds.offset, w + wl.tr_row_scores.offset);
              auto b = s ? tr_new_bwd : tr_old_bwd;
              b(int(dt), int(svs[sv]), dz, c.T, c.E, c.K, static_cast<float*>(o[s].ds), static_cast<int*>(o[s].inverse),
                static_cast<int*>(o[s].offsets), static_cast<int*>(o[s].tok), o[s].dl);
            }
            if (cudaDeviceSynchronize() != cudaSuccess) { std::printf("CUDA error %s\n", cudaGetErrorString(cudaGetLastError())); return 2; }
            ++cases;
            std::string what;
            auto cmp = [&](const char* name, void* a, void* b2, size_t bytes) {
              std::vector<unsigned char> x = get<unsigned char>(a, bytes), y = get<unsigned char>(b2, bytes);
              if (x != y) what += std::string(" ") + name;
            };
            cmp("counts", o[0].counts, o[1].counts, c.E * 4); cmp("offsets", o[0].offsets, o[1].offsets, (c.E + 1) * 4);
            cmp("tiles", o[0].tiles, o[1].tiles, (c.E + 1) * 4); cmp("scatter", o[0].scatter, o[1].scatter, P * 4);
            cmp("inverse", o[0].inverse, o[1].inverse, P * 4); cmp("gather", o[0].gather, o[1].gather, P * 4);
            cmp("token_offsets", o[0].tok, o[1].tok, (c.T + 1) * 4); cmp("scores", o[0].scores, o[1].scores, P * 4);
            cmp("dlogits", o[0].dl, o[1].dl, c.T * c.E * eb);
            char* w0 = static_cast<char*>(o[0].ws); char* w1 = static_cast<char*>(o[1].ws);
            cmp("thresholds", w0 + wl.tr_thresholds.offset, w1 + wl.tr_thresholds.offset, wl.tr_thresholds.bytes);
            if (c.E > kTokenRoundingRegisterExperts) cmp("keys", o[0].keys, o[1].keys, size_t(c.T) * c.E * 4);  // else the new side keeps none
            cmp("keys_by_expert", w0 + wl.tr_keys_by_expert.offset, w1 + wl.tr_keys_by_expert.offset, wl.tr_keys_by_expert.bytes);
            if (!what.empty()) {
              ++bad;
              std::printf("DIFF T=%ld E=%ld K=%ld M=%ld rule=%d sv=%d dt=%d ties=%d:%s\n", c.T, c.E, c.K, c.M, rule, sv, dti, ties, what.c_str());
            }
            for (int s = 0; s < 2; ++s)
              for (void* q : {o[s].ws, o[s].counts, o[s].offsets, o[s].tiles, o[s].scatter, o[s].inverse, o[s].gather, o[s].tok, o[s].scores, o[s].ds, o[s].dl, o[s].keys}) cudaFree(q);
            cudaFree(dz);
          }
  std::printf("tr_equiv: %ld cases, %ld differ\n", cases, bad);
  return bad ? 1 : 0;
}
