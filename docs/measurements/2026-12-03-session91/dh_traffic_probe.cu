// The dH kernel's memory traffic alone, without its GEMM or its math: how fast can any kernel move the bytes the dH
// kernel moves, in the order it moves them? (Session 91; docs/BENCHMARKS.md.)
//
// The dH kernel's tiles, as its scheduler orders them (tile_scheduler.cuh: experts in order, an expert's 128-row
// M-tiles in order, the N-tiles of an M-tile one after the other; CTA b takes tiles b, b + grid, ...). Per tile of 128
// grouped rows and 128 columns of dA' (SwiGLU: 256 columns of H):
//   gather: the 128 rows' dO rows (d bf16 each) by the routing index, as the mainloop does (every N-tile reads them);
//   H: read the tile's 128 x 256 H, write it back in place (dH over H, as in the default cache mode);
//   A': write 128 x 128.
// Loads are 16 bytes a thread; a loaded value feeds an XOR that is stored once a thread, so nothing is optimised away.
// Routing: K distinct experts a token, uniform (fixed seed), an expert's rows in token order, as the layer's
// metadata builds them. Sides: "all" (gather + H + A'), "gather" (the gathered dO only), "stream" (H and A' only).
// Each side: untimed calls for 300 ms, then calls each waited for until 300 ms have passed; median, as machmoe-bench.
//
// nvcc -O3 -arch=sm_90a -std=c++17 dh_traffic_probe.cu -o dh_traffic_probe
// ./dh_traffic_probe T d n E K [ctas_per_sm]
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__);      \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kTileM = 128, kTileN = 128, kThreads = 256;

struct Problem {
  const uint4* dO;           // T x d bf16
  uint4* H;                  // P x 2n bf16 (dH written over it)
  uint4* A;                  // P x n bf16
  const int32_t* token;      // grouped row -> token
  const int32_t* offsets;    // E + 1
  const int32_t* tile_base;  // E + 1: the first tile of each expert
  int E, d, n, n_tiles, total_tiles;
  unsigned* sink;
};

template <bool kGather, bool kStream>
__global__ void __launch_bounds__(kThreads) traffic(Problem p) {
  unsigned x = 0;
  const int d16 = p.d / 8, h16 = 2 * p.n / 8, a16 = p.n / 8;  // 16-byte chunks of a row
  int e = 0;
  for (int tile = blockIdx.x; tile < p.total_tiles; tile += gridDim.x) {
    while (p.tile_base[e + 1] <= tile) ++e;  // tiles are taken in increasing order
    const int local = tile - p.tile_base[e];
    const int m_tile = local / p.n_tiles, n_tile = local % p.n_tiles;
    const int64_t row0 = p.offsets[e] + static_cast<int64_t>(m_tile) * kTileM;
    const int rows = static_cast<int>(min(static_cast<int64_t>(kTileM), p.offsets[e + 1] - row0));
    if (kGather) {
      const int chunks = rows * d16;
#pragma unroll 8
      for (int i = threadIdx.x; i < chunks; i += kThreads) {
        const int r = i / d16, c = i % d16;
        const uint4 v = p.dO[static_cast<int64_t>(p.token[row0 + r]) * d16 + c];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
    if (kStream) {
      const int hc = 2 * kTileN / 8, ac = kTileN / 8;  // the tile's chunks of H and A' a row
      const int h_chunks = rows * hc;
#pragma unroll 8
      for (int i = threadIdx.x; i < h_chunks; i += kThreads) {
        const int r = i / hc, c = i % hc;
        uint4* q = p.H + (row0 + r) * h16 + n_tile * hc + c;
        uint4 v = *q;
        x ^= v.x;
        v.x ^= 0x9e3779b9u;
        *q = v;
      }
      const int a_chunks = rows * ac;
#pragma unroll 8
      for (int i = threadIdx.x; i < a_chunks; i += kThreads) {
        const int r = i / ac, c = i % ac;
        p.A[(row0 + r) * a16 + n_tile * ac + c] = make_uint4(x, r, c, tile);
      }
    }
  }
  if (x == 0x12345678u) p.sink[blockIdx.x] = x;  // practically never: keeps the loads
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::printf("usage: %s T d n E K [ctas_per_sm]\n", argv[0]);
    return 2;
  }
  const int T = std::atoi(argv[1]), d = std::atoi(argv[2]), n = std::atoi(argv[3]), E = std::atoi(argv[4]),
            K = std::atoi(argv[5]);
  const int ctas_per_sm = argc > 6 ? std::atoi(argv[6]) : 2;
  if (d % 8 || n % kTileN || K > E) {
    std::printf("d must be a multiple of 8, n of %d, K <= E\n", kTileN);
    return 2;
  }
  // Routing: K distinct experts a token, uniform; grouped rows by expert, tokens ascending inside an expert.
  std::mt19937 rng(1234);
  std::vector<std::vector<int32_t>> rows_of(E);
  std::vector<int> experts(E);
  for (int e = 0; e < E; ++e) experts[e] = e;
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) std::swap(experts[k], experts[k + rng() % (E - k)]);
    for (int k = 0; k < K; ++k) rows_of[experts[k]].push_back(t);
  }
  std::vector<int32_t> token, offsets(E + 1, 0), tile_base(E + 1, 0);
  const int n_tiles = n / kTileN;
  for (int e = 0; e < E; ++e) {
    token.insert(token.end(), rows_of[e].begin(), rows_of[e].end());
    offsets[e + 1] = static_cast<int32_t>(token.size());
    tile_base[e + 1] = tile_base[e] + static_cast<int>((rows_of[e].size() + kTileM - 1) / kTileM) * n_tiles;
  }
  const int64_t P = static_cast<int64_t>(token.size());
  Problem p{};
  p.E = E, p.d = d, p.n = n, p.n_tiles = n_tiles, p.total_tiles = tile_base[E];
  uint4 *dO, *H, *A;
  int32_t *tok, *off, *tb;
  unsigned* sink;
  CK(cudaMalloc(&dO, static_cast<size_t>(T) * d * 2));
  CK(cudaMalloc(&H, static_cast<size_t>(P) * 2 * n * 2));
  CK(cudaMalloc(&A, static_cast<size_t>(P) * n * 2));
  CK(cudaMalloc(&tok, P * 4));
  CK(cudaMalloc(&off, (E + 1) * 4));
  CK(cudaMalloc(&tb, (E + 1) * 4));
  CK(cudaMalloc(&sink, 4096 * 4));
  CK(cudaMemset(dO, 1, static_cast<size_t>(T) * d * 2));
  CK(cudaMemset(H, 2, static_cast<size_t>(P) * 2 * n * 2));
  CK(cudaMemcpy(tok, token.data(), P * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(off, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(tb, tile_base.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  p.dO = dO, p.H = H, p.A = A, p.token = tok, p.offsets = off, p.tile_base = tb, p.sink = sink;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = sms * ctas_per_sm;

  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto time_side = [&](auto kernel) {
    using clock = std::chrono::steady_clock;
    auto t0 = clock::now();
    while (std::chrono::duration<double, std::milli>(clock::now() - t0).count() < 300) {
      kernel<<<grid, kThreads>>>(p);
      CK(cudaDeviceSynchronize());
    }
    std::vector<float> ms;
    t0 = clock::now();
    while (ms.size() < 10 || std::chrono::duration<double, std::milli>(clock::now() - t0).count() < 300) {
      CK(cudaEventRecord(a));
      kernel<<<grid, kThreads>>>(p);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  // Bytes as the kernel asks for them: every N-tile gathers its M-tile's dO rows.
  const double gather_bytes = static_cast<double>(P) * d * 2 * n_tiles;
  const double h_bytes = static_cast<double>(P) * 2 * n * 2 * 2;  // H read and dH written
  const double a_bytes = static_cast<double>(P) * n * 2;
  const double floor_bytes = static_cast<double>(T) * d * 2 + h_bytes + a_bytes;  // dO once, H, dH, A'
  const float t_all = time_side(traffic<true, true>);
  const float t_gather = time_side(traffic<true, false>);
  const float t_stream = time_side(traffic<false, true>);
  std::printf("T=%d d=%d n=%d E=%d K=%d: P=%lld, %d tiles, grid %d x %d threads\n", T, d, n, E, K,
              static_cast<long long>(P), p.total_tiles, grid, kThreads);
  std::printf("  all     %.4f ms  (dO once + H + dH + A' = %.1f MB: %.0f GB/s of those bytes)\n", t_all,
              floor_bytes / 1e6, floor_bytes / (t_all * 1e6));
  std::printf("  gather  %.4f ms  (%.1f MB asked for, %.0f GB/s; dO itself %.1f MB)\n", t_gather, gather_bytes / 1e6,
              gather_bytes / (t_gather * 1e6), static_cast<double>(T) * d * 2 / 1e6);
  std::printf("  stream  %.4f ms  (H + dH + A' = %.1f MB, %.0f GB/s)\n", t_stream, (h_bytes + a_bytes) / 1e6,
              (h_bytes + a_bytes) / (t_stream * 1e6));
  return 0;
}
