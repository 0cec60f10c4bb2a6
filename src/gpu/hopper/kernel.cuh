// The persistent, warp-specialised Hopper kernel, assembled from three pieces (docs/SPEC.md §6.1):
//   Mainloop   fills a shared-memory ring (producer warpgroup) and drains it with WGMMA (consumers);
//   Epilogue   turns a consumer's fp32 accumulator tile into the outputs;
//   Scheduler  hands out the persistent tile sequence of each CTA (or cluster).
// Each piece has its own Params; the kernel's are KernelParams<...> (params.hpp). Included only by the
// one-configuration translation units in src/gpu/hopper/instantiations/.
//
// CTA = 3 warpgroups. Warpgroup 0 is the producer; warpgroups 1 and 2 are consumers. Ping-pong: they take
// alternate tiles of the CTA's persistent sequence, and while one runs its epilogue the other keeps the tensor
// cores busy; a consumer starts a tile's mainloop only after the other one has seen the last stage of the previous
// tile arrive, which keeps the two on a single in-order ring of stages. Cooperative: both share every tile.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <type_traits>

#include "gpu/cuda_check.hpp"
#include "gpu/hopper/async_primitives.cuh"
#include "gpu/hopper/params.hpp"
#include "gpu/hopper/tile_config.hpp"
#include "machmoe/device.hpp"
#include "machmoe/error.hpp"

namespace machmoe::gpu::hopper {

/// An epilogue with hooks declares `State` (per-thread state carried across a consumer warpgroup's tiles) and
/// provides init(Storage&) (thread 0, once per CTA: its shared-memory barriers), tile_start(...) (before a tile's
/// mainloop: loads it can issue early), first_mma_issued(...) (once the tile's first WGMMAs are in flight: loads
/// that depend on tile_start's, whose latency the rest of the mainloop hides) and apply(..., State&, ...). The
/// others have none of these.
template <class E, class = void>
struct EpilogueHooks {
  static constexpr bool kHooks = false;
  struct State {};
};
template <class E>
struct EpilogueHooks<E, std::void_t<typename E::State>> {
  static constexpr bool kHooks = true;
  using State = typename E::State;
};

/// An epilogue variant that stages into the tile's last ring stage declares kBorrowStage: the mainloop then holds
/// that stage (consume's hold_last), the epilogue gets 16 KiB of it per consumer warpgroup (Mainloop::borrowable),
/// and the stage is released once the epilogue's stores have read it, after the next tile's first WGMMAs are issued.
template <class V, class = void>
struct BorrowsStage : std::false_type {};
template <class V>
struct BorrowsStage<V, std::void_t<decltype(V::kBorrowStage)>> : std::bool_constant<V::kBorrowStage> {};

template <class Tile, class Mainloop_, class Epilogue_, class Scheduler_>
struct PersistentKernel {
  using TileConfig = Tile;
  using Traits = TileTraits<Tile>;
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;
  using Params = KernelParams<typename Mainloop::Params, typename Epilogue::Params, typename Scheduler::Params>;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kClusterM = Tile::kClusterM;

  struct SharedStorage {
    typename Mainloop::Tiles tiles;  // first: 1024-byte aligned at the start of dynamic shared memory
    typename Epilogue::Storage epilogue[Traits::kConsumerWarpgroups];
    typename Mainloop::Barriers barriers;
    std::uint64_t tile_done[Traits::kConsumerWarpgroups];  // ping-pong: "consumer w has seen its tile's last stage"
  };
  // The dynamic shared memory window starts 1024-byte aligned (checked at kernel entry), so no slack is added.
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA on sm_90");

  // Registers: the producer needs few (more when it gathers: row offsets), the consumers hold a 128 x kTileN
  // (ping-pong) or 64 x kTileN (cooperative) fp32 accumulator: 128 registers per thread either way.
  // setmaxnreg moves registers between warpgroups within what the launch allocated (168 x 384 = 64512): the
  // split must satisfy 128 x (producer + 2 x consumer) <= 64512, or the consumers' increase waits forever.
  static constexpr int kProducerRegs = Mainloop::kProducerRegs;
  static constexpr int kConsumerRegs = Mainloop::kGatherA ? 224 : 232;
  static_assert(128 * (kProducerRegs + 2 * kConsumerRegs) <= 168 * kThreads, "register split");

  /// One consumer warpgroup's persistent loop. Ping-pong: tiles consumer, consumer + 2, ... of this CTA's
  /// sequence, whole. Cooperative: every tile, rows [64 consumer, 64 consumer + 64).
  template <class Variant>
  __device__ __forceinline__ static void consumer_loop(const Params& p, SharedStorage& s, int consumer,
                                                       int wg_thread) {
    const typename Mainloop::Storage ring{s.tiles, s.barriers};
    Scheduler sched(p.scheduler);
    typename EpilogueHooks<Epilogue>::State epilogue_state{};
    typename Mainloop::TiledMma mma;
    auto acc = cute::partition_fragment_C(mma, cute::Shape<cute::Int<Tile::kTileM>, cute::Int<Tile::kTileN>>{});
    constexpr int kStep = Traits::kCooperative ? 1 : Traits::kConsumerWarpgroups;
    const int mma_thread = Traits::kCooperative ? consumer * 128 + wg_thread : wg_thread;
    const int row_base = Traits::kCooperative ? consumer * 64 : 0;
    int held = -1;  // a borrowing epilogue's stage of the previous tile, not yet released
    for (int i = Traits::kCooperative ? 0 : consumer;; i += kStep) {  // i: position in this CTA's tile sequence
      const auto c = sched.get(i);  // the scheduler's coordinate type (varlen-M: TileCoord)
      if (!c.valid()) break;
      if constexpr (!Traits::kCooperative) {
        if (i > 0) {  // wait until the previous tile's consumer has seen all of that tile's stages
          const int other = 1 - consumer, other_tile = (i - 1) / Traits::kConsumerWarpgroups;
          mbar_wait(&s.tile_done[other], static_cast<std::uint32_t>(other_tile) & 1u, WaitSite::kPingPongTileDone, i);
        }
      }
      // The mainloop places tile i of the sequence on the ring (fixed K: i k-blocks per tile; varlen-K: the k-blocks
      // of the tiles before it, which the scheduler's coordinate carries).
      // Every thread of the warpgroup arrives (tile_done counts 128): the other consumer then cannot pass this
      // tile's hand-over, run its next tile and complete its own tile_done again while a warp of this warpgroup
      // still waits on that barrier's previous phase. With one arrival (thread 0 alone) two such completions flip
      // the phase parity back under a lagging warp, which then waits for a phase that needs this warpgroup's next
      // arrival: a deadlock, seen with tiles of 0 or 1 k-blocks back to back (the weight gradients' short experts).
      if constexpr (EpilogueHooks<Epilogue>::kHooks)
        Epilogue::tile_start(p.epilogue, s.epilogue[consumer], epilogue_state, c, row_base, wg_thread,
                             epilogue_barrier(consumer));
      if constexpr (BorrowsStage<Variant>::value) {
        // Both warpgroups of the cooperative tile share the held stage; this path calls neither first_mma_issued
        // nor the hooks' apply.
        static_assert(Traits::kCooperative && !EpilogueHooks<Epilogue>::kHooks,
                      "a borrowed stage: the cooperative tile, an epilogue without hooks");
        const int now_held = Mainloop::consume(
            p.mainloop, ring, acc, c, i, mma_thread,
            [&] {  // the previous tile's borrowed stage, free once its stores have read it
              if (held >= 0) {
                bulk_wait_group_read0();  // every thread: one without bulk groups passes at once
                if (wg_thread == 0) mbar_arrive(&s.barriers.empty[held]);
              }
              held = -1;
            },
            [] {}, /*hold_last=*/true);
        Epilogue::template apply<Variant>(p.epilogue, s.epilogue[consumer], acc, c, row_base, wg_thread,
                                          epilogue_barrier(consumer),
                                          now_held >= 0 ? Mainloop::borrowable(ring, now_held, consumer) : 0u);
        held = now_held;
        continue;
      }
      Mainloop::consume(
          p.mainloop, ring, acc, c, i, mma_thread,
          [&] {
            if constexpr (EpilogueHooks<Epilogue>::kHooks) Epilogue::first_mma_issued(p.epilogue, epilogue_state);
          },
          [&] {
            if constexpr (!Traits::kCooperative) mbar_arrive(&s.tile_done[consumer]);
          });
      if constexpr (EpilogueHooks<Epilogue>::kHooks)
        Epilogue::template apply<Variant>(p.epilogue, s.epilogue[consumer], epilogue_state, acc, c, row_base,
                                          wg_thread, epilogue_barrier(consumer));
      else
        Epilogue::template apply<Variant>(p.epilogue, s.epilogue[consumer], acc, c, row_base, wg_thread,
                                          epilogue_barrier(consumer));
    }
    if constexpr (BorrowsStage<Variant>::value)
      if (held >= 0 && wg_thread == 0) {  // released for symmetry: the producer has no tile left to put there
        bulk_wait_group_read0();
        mbar_arrive(&s.barriers.empty[held]);
      }
    // This warpgroup's last TMA stores have landed (issued by thread 0, or by each warp's lane 0 in the dH epilogue;
    // a thread without bulk groups passes at once).
    if (wg_thread % 32 == 0) bulk_wait_group0();
  }

  __device__ __forceinline__ static void run(const Params& p, unsigned char* smem_raw) {
    if ((smem_u32(smem_raw) & 1023u) != 0) __trap();  // the swizzled tiles need 1024-byte alignment
    auto& s = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int warpgroup = threadIdx.x / 128, wg_thread = threadIdx.x % 128;

    if (threadIdx.x == 0) {
      Mainloop::init_barriers(s.barriers);
      for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) mbar_init(&s.tile_done[w], 128);
      if constexpr (EpilogueHooks<Epilogue>::kHooks)
        for (int w = 0; w < Traits::kConsumerWarpgroups; ++w) Epilogue::init(s.epilogue[w]);
      mbar_init_fence();
      Mainloop::prefetch_descriptors(p.mainloop);
    }
    // With a cluster, the peer's barriers must be initialised before any multicast or remote arrival reaches them.
    if constexpr (kClusterM > 1)
      cute::cluster_sync();
    else
      __syncthreads();

    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      // Without a gather only one thread issues the TMA loads; the other producer warps have nothing to do.
      if (Mainloop::kGatherA || wg_thread < 32)
        Mainloop::template produce<Scheduler>(p.mainloop, p.scheduler,
                                              typename Mainloop::Storage{s.tiles, s.barriers}, wg_thread);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
      // The epilogue variant is chosen once, outside the persistent loop (uniform branch); every variant is inlined.
      const int consumer = warpgroup - 1;
      // always_inline: a variant left as a call put a 1 KiB stack frame into one configuration (geglu, 128 x 256).
      Epilogue::with_variant(p.epilogue, [&](auto variant) __attribute__((always_inline)) {
        consumer_loop<decltype(variant)>(p, s, consumer, wg_thread);
      });
    }
    // A CTA leaves only when its peer can no longer arrive on its barriers (the consumers' remote releases).
    if constexpr (kClusterM > 1) cute::cluster_sync();
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) persistent_kernel(const __grid_constant__ typename Kernel::Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Kernel::run(p, smem_raw);
}

/// Devices whose launch set-up is cached (others repeat it on every launch).
inline constexpr int kMaxDevices = 64;

/// Enqueues the kernel on a persistent grid: one CTA per SM, or as many clusters as can be resident at once (SMs
/// pair within a GPC; 66 on an H200), so the static schedule has no tail wave. Tiles beyond the work are never
/// visited. `usable_sms`: the SMs the grid may take (the device's less the SM margin, include/machmoe/sm_margin.hpp);
/// the grid is cut to that many CTAs, whole clusters, one cluster at least.
template <class Kernel>
void launch_kernel(const typename Kernel::Params& p, int usable_sms, cudaStream_t stream) {
  auto* kernel = &persistent_kernel<Kernel>;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(Kernel::kThreads);
  cfg.dynamicSmemBytes = Kernel::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = Kernel::kClusterM, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr, cfg.numAttrs = Kernel::kClusterM > 1 ? 1 : 0;
  // Once per device: the shared-memory opt-in (a per-device function attribute) and the resident clusters.
  static std::atomic<int> resident[kMaxDevices];  // 0: not set up yet; else resident clusters (CTAs without)
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  int clusters = dev < kMaxDevices ? resident[dev].load(std::memory_order_relaxed) : 0;
  if (clusters == 0) {
    MACHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes));
    // The whole device's SMs (cached per device): what is resident does not depend on the margin of the first call.
    const int sm_count = cuda_sm_count(dev);
    if (sm_count <= 0) throw RuntimeError("machmoe: could not read the SM count of CUDA device " + std::to_string(dev));
    clusters = sm_count;
    if constexpr (Kernel::kClusterM > 1) {
      cfg.gridDim = dim3((sm_count / Kernel::kClusterM) * Kernel::kClusterM);
      MACHMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    }
    clusters = clusters > 0 ? clusters : 1;
    if (dev < kMaxDevices) resident[dev].store(clusters, std::memory_order_relaxed);
  }
  const int usable_clusters = usable_sms / Kernel::kClusterM;
  if (usable_clusters < clusters) clusters = usable_clusters > 0 ? usable_clusters : 1;
  cfg.gridDim = dim3(static_cast<unsigned>(clusters) * Kernel::kClusterM);
  MACHMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  MACHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace machmoe::gpu::hopper
