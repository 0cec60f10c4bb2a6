// The varlen-M mainloop of the Hopper kernels: a multi-stage shared-memory ring filled by one producer warpgroup
// and drained by WGMMA in the consumer warpgroups, over the tiles the scheduler hands out.
//
// Producer: B (weights) tiles arrive by TMA, issued by one thread; A rows are either gathered with 16-byte
// cp.async by all 128 producer threads (the up-projection: rows of X picked by the routing, never materialised)
// or loaded by TMA (the down-projection: the contiguous activation buffer). A stage's "full" barrier counts the
// TMA transaction bytes plus, when gathering, one cp.async arrival per producer thread.
// Consumer: one warpgroup computes a whole 128 x kTileN tile with two 64-row WGMMA atoms, keeping one batch in
// flight and releasing each stage behind it.
//
// Template parameters: the tile configuration (tile_config.hpp), how A arrives (gathered rows or a contiguous
// TMA tile), the majorness of B and the element type. Edge predication along N and K slots in where the TMA boxes
// and the cp.async sizes are formed (produce), never deeper: the tensor maps carry the true N and K (TMA zero-fills
// what lies past them), and the gather zero-fills the 16-byte chunks at k >= K (K is a multiple of 8, so a chunk is
// wholly inside or wholly past the row). An edge tile's padded columns thus hold exact zeros of B (the concatenated
// layout's map has n rows a half, so its gate and up boxes are zero-filled past n alike).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "gpu/hopper/async_primitives.cuh"
#include "gpu/hopper/params.hpp"
#include "gpu/hopper/stage_ring.cuh"
#include "gpu/hopper/tile_config.hpp"
#include "gpu/hopper/tile_scheduler.cuh"

namespace machmoe::gpu::hopper {

/// How the A operand reaches shared memory.
enum class OperandA : int {
  kGathered,    // rows picked by an index, 16-byte cp.async by the 128 producer threads (never materialised)
  kContiguous,  // a contiguous row block, one TMA load
};
/// Which index of an operand is contiguous in memory: K-major (the reduction index) or MN-major.
enum class Major : int { kK, kMN };

template <class Tile, OperandA kOperandA, Major kMajorB = Major::kK, class Element_ = cutlass::bfloat16_t>
struct MainloopVarlenM {
  using Params = MainloopVarlenMParams;
  using Element = Element_;
  using Traits = TileTraits<Tile>;
  static constexpr int kTileM = Tile::kTileM, kTileN = Tile::kTileN, kTileK = Tile::kTileK;
  static constexpr int kStages = Tile::kStages;
  static constexpr bool kGatherA = kOperandA == OperandA::kGathered;
  static constexpr bool kMajorBK = kMajorB == Major::kK;
  // MN-major B is read in place from weights stored (K, N) row-major per expert (the backward's W1 for dX~, W2 for
  // dH): a 4D tensor map (N, half, j, E) with k = 2 j + half, so the concatenated GLU layout is read interleaved
  // without a copy (params.hpp). In a cluster of 2 along M, each CTA loads every other 64-column box of the tile and
  // multicasts it to both.
  static_assert(sizeof(Element) == 2, "16-bit operands (bf16)");
  // Registers of the producer warpgroup: more when it gathers (row offsets of its 8 rows).
  static constexpr int kProducerRegs = kGatherA ? 56 : 40;

  // 128-byte-swizzled K-major tiles: the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and WGMMA reads.
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>,
                                                               cute::Int<kStages>>{}));
  // K-major B: the same layout as A. MN-major B: 64 (N) x 8 (K) swizzle atoms ordered K first, so one 64-column
  // block holds all 64 k of the stage contiguously (8 KiB), which is exactly what one TMA box writes.
  using SmemLayoutBK = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                    cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>,
                                                                cute::Int<kStages>>{}));
  using SmemLayoutBMN = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                     cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>,
                                                                 cute::Int<kStages>>{},
                                                     cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutB = std::conditional_t<kMajorBK, SmemLayoutBK, SmemLayoutBMN>;
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kTileN>, cute::Int<kTileK>>,
                                                      cute::GMMA::Major::K,
                                                      kMajorBK ? cute::GMMA::Major::K : cute::GMMA::Major::MN>());
  using TiledMma = ConsumerTiledMma<Tile, MmaAtom>;

  static constexpr int kBytesA = kTileM * kTileK * 2;
  static constexpr int kBytesB = kTileN * kTileK * 2;

  using Tiles = typename StageRing<Tile, Element>::Tiles;
  using Barriers = typename StageRing<Tile, Element>::Barriers;
  using Storage = typename StageRing<Tile, Element>::Storage;

  __device__ __forceinline__ static void init_barriers(Barriers& b) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&b.full[i], kGatherA ? 1 + 128 : 1);
      // One arrival per consuming warpgroup (ping-pong: the tile's owner; cooperative: both) of every CTA of the
      // cluster: a stage is refilled by multicast into all of them.
      mbar_init(&b.empty[i], (Traits::kCooperative ? 2 : 1) * Tile::kClusterM);
    }
  }

  /// The TMA descriptors this mainloop reads (one thread, at kernel entry).
  __device__ __forceinline__ static void prefetch_descriptors(const Params& p) {
    tma_prefetch_descriptor(&p.tma_b);
    if constexpr (!kGatherA) tma_prefetch_descriptor(&p.tma_a);
  }

  // ---- producer ------------------------------------------------------------------------------------------------

  /// Fills the ring for every tile of this CTA, in the order the consumers take them. `ptid` in [0, 128) (with a
  /// contiguous A only the first warp runs this).
  template <class Scheduler>
  __device__ __forceinline__ static void produce(const Params& p, const typename Scheduler::Params& sp, Storage s,
                                                 int ptid) {
    Scheduler sched(sp);
    const int k_tiles = (p.K + kTileK - 1) / kTileK;  // the last block may be partial (zero-filled past K)
    std::uint32_t iter = 0;
    // Gather mapping: 8 threads cover one 128-byte row slice (16 B each), 16 rows per pass, 8 passes.
    const int chunk = ptid & 7, row_in_pass = ptid >> 3;
    const std::uint32_t swizzled_chunk = static_cast<std::uint32_t>((chunk ^ (row_in_pass & 7)) << 4);
    const Element* a_base = static_cast<const Element*>(p.a);
    // Gathered A: the routing indices of this thread's 8 rows are loaded one tile ahead, while the previous tile's
    // k-blocks are issued, so a tile's first copies do not wait for an index load (ncu, dH on 1.4B (256,128,8): the
    // producer warps stalled at every tile start on the sign extension of the index just loaded).
    TileCoord c = sched.get(0);
    std::int32_t gather_rows[8];
    if constexpr (kGatherA) load_gather_rows(p, c, row_in_pass, gather_rows);
    for (int i = 0; c.valid(); ++i) {
      const TileCoord next = sched.get(i + 1);
      const int half_rows = kTileN / 2;
      // Interleaved: the tile's two halves of rows, one after the other, in the 3D map (K, N, E). Concatenated:
      // gate rows j and up rows j of the same j, halves 0 and 1 of the 4D map (K, n, 2, E).
      const int b_row_first = p.b_concatenated ? c.n_tile * half_rows : c.n_tile * kTileN;
      const int b_row_second = p.b_concatenated ? b_row_first : b_row_first + half_rows;
      int a_row0 = 0;  // contiguous A: the tile's first row in A's buffer
      if constexpr (!kGatherA) {
        if (ptid == 0)
          a_row0 = static_cast<int>(c.row0) + (p.a_row_shift != nullptr ? p.a_row_shift[c.expert] : 0);
      }
      std::int64_t src_row[8];  // element offset of each of this thread's rows in A; -1: past the tile's rows
      std::int32_t next_rows[8];
      if constexpr (kGatherA) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          src_row[j] = gather_rows[j] >= 0 ? static_cast<std::int64_t>(gather_rows[j]) * p.lda : -1;
        load_gather_rows(p, next, row_in_pass, next_rows);  // used by the next tile: in flight meanwhile
      }
      for (int kb = 0; kb < k_tiles; ++kb, ++iter) {
        const int stage = iter % kStages;
        const std::uint32_t phase = (iter / kStages) & 1u;
        mbar_wait(&s.bar.empty[stage], phase ^ 1u, WaitSite::kProducerEmpty, iter);
        if (ptid == 0) {
          mbar_arrive_expect_tx(&s.bar.full[stage], kBytesB + (kGatherA ? 0 : kBytesA));
          if constexpr (!kMajorBK && Tile::kClusterM == 2) {  // this CTA's boxes (b = rank mod 2), to both CTAs
#pragma unroll
            for (int b = static_cast<int>(sched.rank()); b < kTileN / 64; b += 2)
              tma_load_4d_multicast(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][b * 64 * kTileK],
                                    c.n_tile * kTileN + 64 * b, 0, kb * (kTileK / 2), c.expert, 0x3);
          } else if constexpr (!kMajorBK) {  // kTileN / 64 boxes of (64 columns) x (32 j) x (gate, up | k, k + 1)
#pragma unroll
            for (int b = 0; b < kTileN / 64; ++b)
              tma_load_4d(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][b * 64 * kTileK], c.n_tile * kTileN + 64 * b, 0,
                          kb * (kTileK / 2), c.expert);
          } else if constexpr (Tile::kClusterM == 2) {  // this CTA's half of the weight tile, to both CTAs
            const int half = static_cast<int>(sched.rank());
            void* dst = &s.t.b[stage][half * half_rows * kTileK];
            if (p.b_concatenated)
              tma_load_4d_multicast(&p.tma_b, &s.bar.full[stage], dst, kb * kTileK, b_row_first, half, c.expert, 0x3);
            else
              tma_load_3d_multicast(&p.tma_b, &s.bar.full[stage], dst, kb * kTileK,
                                    half == 0 ? b_row_first : b_row_second, c.expert, 0x3);
          } else if (p.b_concatenated) {
            tma_load_4d(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][0], kb * kTileK, b_row_first, 0, c.expert);
            tma_load_4d(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][half_rows * kTileK], kb * kTileK, b_row_second,
                        1, c.expert);
          } else {
            tma_load_3d(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][0], kb * kTileK, b_row_first, c.expert);
            tma_load_3d(&p.tma_b, &s.bar.full[stage], &s.t.b[stage][half_rows * kTileK], kb * kTileK,
                        b_row_second, c.expert);
          }
          if constexpr (!kGatherA)
            tma_load_2d(&p.tma_a, &s.bar.full[stage], &s.t.a[stage][0], kb * kTileK, a_row0);
        }
        if constexpr (kGatherA) {
          const std::uint32_t dst0 = smem_u32(&s.t.a[stage][0]) + swizzled_chunk;
          const std::int64_t k_off = static_cast<std::int64_t>(kb) * kTileK + chunk * 8;
          // Chunks at k >= K (the partial last k-block) are zero-filled: reading them would run past the row.
          const bool k_ok = k_off < p.K;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int r = row_in_pass + 16 * j;
            const bool ok = k_ok && src_row[j] >= 0;
            const Element* src = ok ? a_base + src_row[j] + k_off : a_base;
            cp_async_16(dst0 + r * 128, src, ok ? 16u : 0u);
          }
          cp_async_arrive_noinc(&s.bar.full[stage]);
        }
      }
      if constexpr (kGatherA) {
#pragma unroll
        for (int j = 0; j < 8; ++j) gather_rows[j] = next_rows[j];
      }
      c = next;
    }
    if constexpr (kGatherA) cp_async_wait_all();
  }

  /// The source rows (routing indices) of this thread's rows row_in_pass + 16 j of tile c; -1 past its rows (an
  /// invalid tile has none).
  __device__ __forceinline__ static void load_gather_rows(const Params& p, const TileCoord& c, int row_in_pass,
                                                          std::int32_t (&rows)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int r = row_in_pass + 16 * j;
      rows[j] = r < c.rows ? p.gather[c.row0 + r] : -1;
    }
  }

  // ---- consumer ------------------------------------------------------------------------------------------------

  /// Accumulates tile `tile_index` of this CTA's sequence into `acc` (zeroed by the first WGMMA); every tile has
  /// ceil(K / kTileK) k-blocks, so its first one sits at ring position tile_index * ceil(K / kTileK).
  /// `on_first_issue` runs (on every thread) once the first k-block's WGMMAs are issued, `on_last_wait` once this
  /// warpgroup has seen its last stage arrive.
  template <class Accumulator, class OnFirstIssue, class OnLastWait>
  __device__ __forceinline__ static void consume(const Params& p, Storage s, Accumulator& acc, const TileCoord&,
                                                 int tile_index, int mma_thread, OnFirstIssue&& on_first_issue,
                                                 OnLastWait&& on_last_wait) {
    const int k_tiles = (p.K + kTileK - 1) / kTileK;
    std::uint32_t iter = static_cast<std::uint32_t>(tile_index) * static_cast<std::uint32_t>(k_tiles);
    const int wg_thread = mma_thread % 128;
    using namespace cute;
    TiledMma mma;
    Tensor sA = make_tensor(make_smem_ptr(&s.t.a[0][0]), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(&s.t.b[0][0]), SmemLayoutB{});
    auto thr = mma.get_thread_slice(mma_thread);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage) descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    const int last_stage = consume_k_blocks<kStages>(
        mma, tCrA, tCrB, acc, s.bar.full, iter, k_tiles,
        [&](int stage) {
          if (wg_thread < Tile::kClusterM) release(s, stage, wg_thread);
        },
        on_first_issue, on_last_wait);
    if (last_stage >= 0 && wg_thread < Tile::kClusterM) release(s, last_stage, wg_thread);
  }

  /// This warpgroup is done reading `stage`: tell every producer that writes into it. With a cluster, thread r of
  /// the warpgroup signals CTA r (one arrival per thread, issued in parallel).
  __device__ __forceinline__ static void release(Storage s, int stage, int cta_rank) {
    if constexpr (Tile::kClusterM == 1) {
      mbar_arrive(&s.bar.empty[stage]);
    } else {
      mbar_arrive_cluster(&s.bar.empty[stage], static_cast<std::uint32_t>(cta_rank));
    }
  }
};

}  // namespace machmoe::gpu::hopper
