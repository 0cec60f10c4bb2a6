// The persistent, warp-specialised Hopper grouped GEMM kernel (docs/SPEC.md §2.3, §2.4, §6.1) and its launcher template.
// Included only by the one-configuration translation units in src/gpu/hopper/instantiations/.
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer (mainloop.cuh); warpgroups 1 and 2 are consumers that take
// alternate tiles of the CTA's persistent sequence (ping-pong): while one runs its epilogue (activation math and
// stores) the other keeps the tensor cores busy. A consumer starts a tile's mainloop only after the other one has
// seen the last stage of the previous tile arrive, which keeps the two on a single in-order ring of stages.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include <cuda_runtime.h>

#include <atomic>

#include "gpu/cuda_check.hpp"
#include "gpu/hopper/epilogue.cuh"
#include "gpu/hopper/mainloop.cuh"

namespace machmoe::gpu::hopper {

template <class Config>
struct GroupedGemmKernel {
  using Main = Mainloop<Config>;
  using Epi = Epilogue<Config>;

  struct SharedStorage {
    typename Main::Tiles tiles;  // first: 1024-byte aligned at the start of dynamic shared memory
    typename Epi::Storage epilogue[Config::kConsumerWarpgroups];
    typename Main::Barriers barriers;
    std::uint64_t tile_done[Config::kConsumerWarpgroups];  // ping-pong: "consumer w has seen its tile's last stage"
  };
  // The dynamic shared memory window starts 1024-byte aligned (checked at kernel entry), so no slack is added.
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA on sm_90");

  // Registers: the producer needs few (more when it gathers: row offsets), the consumers hold a 128 x kTileN
  // (ping-pong) or 64 x kTileN (cooperative) fp32 accumulator: 128 registers per thread either way.
  // setmaxnreg moves registers between warpgroups within what the launch allocated (168 x 384 = 64512): the
  // split must satisfy 128 x (producer + 2 x consumer) <= 64512, or the consumers' increase waits forever.
  static constexpr int kProducerRegs = Config::kGatherA ? 56 : 40;
  static constexpr int kConsumerRegs = Config::kGatherA ? 224 : 232;
  static_assert(128 * (kProducerRegs + 2 * kConsumerRegs) <= 168 * Config::kThreads, "register split");
};

/// One consumer warpgroup's persistent loop. Ping-pong: tiles consumer, consumer + 2, ... of this CTA's sequence,
/// whole. Cooperative: every tile, rows [64 consumer, 64 consumer + 64).
template <class Config, bool kConcat, bool kBias, class SharedStorage>
__device__ __forceinline__ void consumer_loop(const GroupedGemmParams& p, SharedStorage& s, int consumer,
                                              int wg_thread) {
  using K = GroupedGemmKernel<Config>;
  const typename K::Main::Storage ring{s.tiles, s.barriers};
  ClusterTiles<Config> sched(p);
  typename K::Main::TiledMma mma;
  auto acc = cute::partition_fragment_C(mma, cute::Shape<cute::Int<Config::kTileM>, cute::Int<Config::kTileN>>{});
  const std::uint32_t k_tiles = static_cast<std::uint32_t>(p.K / Config::kTileK);
  constexpr int kStep = Config::kCooperative ? 1 : Config::kConsumerWarpgroups;
  const int mma_thread = Config::kCooperative ? consumer * 128 + wg_thread : wg_thread;
  const int row_base = Config::kCooperative ? consumer * 64 : 0;
  for (int i = Config::kCooperative ? 0 : consumer;; i += kStep) {  // i: position in this CTA's tile sequence
    const TileCoord c = sched.get(i);
    if (!c.valid()) break;
    if constexpr (!Config::kCooperative) {
      if (i > 0) {  // wait until the previous tile's consumer has seen all of that tile's stages
        const int other = 1 - consumer, other_tile = (i - 1) / Config::kConsumerWarpgroups;
        mbar_wait(&s.tile_done[other], static_cast<std::uint32_t>(other_tile) & 1u);
      }
    }
    K::Main::consume(p, ring, acc, static_cast<std::uint32_t>(i) * k_tiles, mma_thread, [&] {
      if (!Config::kCooperative && wg_thread == 0) mbar_arrive(&s.tile_done[consumer]);
    });
    K::Epi::template apply<kConcat, kBias>(p, s.epilogue[consumer], acc, c, row_base, wg_thread, 1 + consumer);
  }
  if (wg_thread == 0) bulk_wait_group0();  // this warpgroup's last TMA stores have landed
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p) {
  using K = GroupedGemmKernel<Config>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  if ((smem_u32(smem_raw) & 1023u) != 0) __trap();  // the swizzled tiles need 1024-byte alignment
  auto& s = *reinterpret_cast<typename K::SharedStorage*>(smem_raw);
  const int warpgroup = threadIdx.x / 128, wg_thread = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    K::Main::init_barriers(s.barriers);
    for (int w = 0; w < Config::kConsumerWarpgroups; ++w) mbar_init(&s.tile_done[w], 1);
    mbar_init_fence();
    tma_prefetch_descriptor(&p.tma_b);
    if constexpr (!Config::kGatherA) tma_prefetch_descriptor(&p.tma_a);
  }
  // With a cluster, the peer's barriers must be initialised before any multicast or remote arrival reaches them.
  if constexpr (Config::kClusterM > 1)
    cute::cluster_sync();
  else
    __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    // Without a gather only one thread issues the TMA loads; the other producer warps have nothing to do.
    if (Config::kGatherA || wg_thread < 32)
      K::Main::produce(p, typename K::Main::Storage{s.tiles, s.barriers}, wg_thread);
  } else {
    cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
    // The epilogue variant is chosen once, outside the persistent loop (uniform branch); every variant is inlined.
    const int consumer = warpgroup - 1;
    const bool concat = Config::kGlu && p.b_concatenated;
    if (concat && p.bias != nullptr)
      consumer_loop<Config, Config::kGlu, true>(p, s, consumer, wg_thread);
    else if (concat)
      consumer_loop<Config, Config::kGlu, false>(p, s, consumer, wg_thread);
    else if (p.bias != nullptr)
      consumer_loop<Config, false, true>(p, s, consumer, wg_thread);
    else
      consumer_loop<Config, false, false>(p, s, consumer, wg_thread);
  }
  // A CTA leaves only when its peer can no longer arrive on its barriers (the consumers' remote releases).
  if constexpr (Config::kClusterM > 1) cute::cluster_sync();
}

/// Enqueues the kernel with one CTA per SM (a persistent grid; tiles beyond the work are never visited).
/// Devices whose launch set-up is cached (others repeat it on every launch).
inline constexpr int kMaxDevices = 64;

template <class Config>
void launch_grouped_gemm(const GroupedGemmParams& p, int sm_count, cudaStream_t stream) {
  using K = GroupedGemmKernel<Config>;
  auto* kernel = &grouped_gemm_kernel<Config>;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(Config::kThreads);
  cfg.dynamicSmemBytes = K::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = Config::kClusterM, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr, cfg.numAttrs = Config::kClusterM > 1 ? 1 : 0;
  // Once per device: the shared-memory opt-in (a per-device function attribute) and how many clusters can be
  // resident at once (SMs pair within a GPC; 66 on an H200), so the static schedule has no tail wave.
  static std::atomic<int> resident[kMaxDevices];  // 0: not set up yet; else resident clusters (CTAs without)
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  int clusters = dev < kMaxDevices ? resident[dev].load(std::memory_order_relaxed) : 0;
  if (clusters == 0) {
    MACHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes));
    clusters = sm_count;
    if constexpr (Config::kClusterM > 1) {
      cfg.gridDim = dim3((sm_count / Config::kClusterM) * Config::kClusterM);
      MACHMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    }
    clusters = clusters > 0 ? clusters : 1;
    if (dev < kMaxDevices) resident[dev].store(clusters, std::memory_order_relaxed);
  }
  cfg.gridDim = dim3(static_cast<unsigned>(clusters) * Config::kClusterM);
  MACHMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  MACHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace machmoe::gpu::hopper
