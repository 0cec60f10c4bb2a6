// The few Hopper synchronisation and copy primitives the grouped GEMM uses, as thin inline-PTX wrappers:
// transaction mbarriers, named barriers, 16-byte cp.async with zero fill, and TMA tile loads.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cstdio>

namespace machmoe::gpu::hopper {

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(std::uint64_t* bar, std::uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

/// Makes the barrier initialisations visible to the async proxy (TMA) before any thread uses them.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

/// Where a thread waits on an mbarrier (printed by the hang trap below).
enum class WaitSite : int {
  kUnknown = 0,
  kProducerEmpty = 1,     // producer: a ring stage released by the consumers
  kConsumerFull = 2,      // consumer: a ring stage filled (TMA bytes and/or cp.async arrivals)
  kPingPongTileDone = 3,  // ping-pong consumer: the other consumer has seen its tile's last stage
};

#if defined(MACHMOE_DEVICE_HANG_TRAP)
#ifndef MACHMOE_HANG_TRAP_NS
#define MACHMOE_HANG_TRAP_NS 10000000000ull  // 10 s
#endif
__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool mbar_try_wait(std::uint64_t* bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
#endif

/// Blocks until the phase of the given parity has completed. With MACHMOE_DEVICE_HANG_TRAP (a diagnostic build:
/// cmake -DMACHMOE_DEVICE_HANG_TRAP=ON), a wait still pending after MACHMOE_HANG_TRAP_NS prints the CTA, thread,
/// wait site, the barrier's shared-memory address (its offset in the kernel's SharedStorage: ring tiles, epilogue
/// staging, full[kStages], empty[kStages], tile_done[2]), the parity and the caller's ring iteration / tile index,
/// then traps: a deadlock becomes a launch failure that says where it stuck, instead of a process that never returns.
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, std::uint32_t parity,
                                          WaitSite site = WaitSite::kUnknown, long long where = -1) {
#if defined(MACHMOE_DEVICE_HANG_TRAP)
  if (mbar_try_wait(bar, parity)) return;
  const std::uint64_t t0 = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - t0 > MACHMOE_HANG_TRAP_NS) {
      printf("machmoe hang trap: block %d thread %d (warpgroup %d) site %d waits mbarrier at shared 0x%x parity %u "
             "(ring iteration / tile %lld) for over %llu ns\n",
             static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), static_cast<int>(threadIdx.x / 128),
             static_cast<int>(site), smem_u32(bar), parity, where,
             static_cast<unsigned long long>(MACHMOE_HANG_TRAP_NS));
      __trap();
    }
  }
#else
  (void)site, (void)where;
  const std::uint32_t addr = smem_u32(bar);
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
#endif
}

/// One arrival on `bar` once all of this thread's earlier cp.async copies have landed (counted in the barrier's
/// expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// ---- named barriers (id 0 is __syncthreads) --------------------------------------------------------------------

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- copies --------------------------------------------------------------------------------------------------

/// 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes zeros (rows past a segment).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, std::uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

/// The same with the source read or not by a predicate (PTX's ignore-src: not read, the 16 bytes zero-filled), so a
/// row's validity is one predicate shared by all its copies rather than a byte count computed for each.
__device__ __forceinline__ void cp_async_16_if(std::uint32_t dst, const void* src, bool read) {
  asm volatile(
      "{\n"
      ".reg .pred ignore;\n"
      "setp.eq.u32 ignore, %2, 0;\n"
      "cp.async.cg.shared.global [%0], [%1], 16, ignore;\n"
      "}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<std::uint32_t>(read))
      : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

/// One 32-bit store to shared memory at a 32-bit shared address (for memory reached through an address rather than a
/// pointer of the shared window: the weight gradients' borrowed ring stage).
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

/// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, std::uint64_t* bar, void* dst, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(const CUtensorMap* map, std::uint64_t* bar, void* dst, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, std::uint64_t* bar, void* dst, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/// TMA tile store from shared memory (bulk-group completion); the source must be fenced to the async proxy first.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
/// The same into a 3D tensor (the weight gradients: columns, rows of one expert, expert), clipped at each extent; the
/// source as a 32-bit shared address or as a pointer.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, std::uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  tma_store_3d(map, smem_u32(src), c0, c1, c2);
}
/// And into a 4D tensor (the weight gradients with the concatenated GLU row map: columns, row in the gate or up
/// half, half, expert).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, std::uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                             int c3) {
  tma_store_4d(map, smem_u32(src), c0, c1, c2, c3);
}

/// Element offset of (row, col), col < 64, in a 64-column bf16 box of TMA's 128-byte swizzle
/// (CU_TENSOR_MAP_SWIZZLE_128B): 16-byte chunk col / 8 of row `row` sits at chunk (col / 8) ^ (row % 8). The
/// epilogues stage their TMA stores in this layout (its 8-row period also makes a 32-row box's rows start in phase).
__device__ __forceinline__ int tma_swizzle128_bf16_offset(int row, int col) {
  return row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
/// Waits until this thread's committed bulk stores have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_group_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
/// Waits until this thread's committed bulk stores are complete (written to global memory).
__device__ __forceinline__ void bulk_wait_group0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/// TMA tile load delivered to the same shared-memory offset (data and complete_tx on the same barrier offset) in
/// every CTA of the cluster named by cta_mask.
__device__ __forceinline__ void tma_load_3d_multicast(const CUtensorMap* map, std::uint64_t* bar, void* dst, int c0,
                                                      int c1, int c2, std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5}], [%2], %6;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

/// The 4D TMA tile load, multicast to the CTAs of `cta_mask` (same shared-memory offset and barrier in each).
__device__ __forceinline__ void tma_load_4d_multicast(const CUtensorMap* map, std::uint64_t* bar, void* dst, int c0,
                                                      int c1, int c2, int c3, std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5, %6}], [%2], %7;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "h"(cta_mask)
      : "memory");
}

/// One arrival on the barrier at the same offset in CTA `cta_rank` of the cluster. Release at CTA scope (the
/// default) is all a consumer's "stage read" signal needs: the WGMMAs that read the stage have completed (wait_group)
/// before it. A .release.cluster arrival adds a cluster-scope fence to every k-block; it made the 2-CTA kernel 1.6x
/// slower than the cluster-free one (docs/BENCHMARK_HISTORY.md).
__device__ __forceinline__ void mbar_arrive_cluster(std::uint64_t* bar, std::uint32_t cta_rank) {
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(cta_rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

}  // namespace machmoe::gpu::hopper
