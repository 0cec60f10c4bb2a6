// The varlen-K mainloop of the Hopper weight-gradient kernels (dW1, dW2; docs/SPEC.md §3.4, §3.6): for a work
// tile (expert e, m-tile, n-tile) the reduction runs over the expert's grouped rows g in [off[e], off[e+1]) in
// k-blocks of 64 rows,
//   C[m, n] += sum_g A[rowA(g), m] * B[rowB(g), n],
// with both operands MN-major in memory (row g holds the m or n index contiguously) and in shared memory
// (GMMA::Major::MN for A and B: the transposed-operand HGMMA reads them in place, no transpose pass).
//
// Producer (128 threads), into the 128-byte-swizzled MN-major layout. The gathered operand (dW2's dO rows, dW1's X
// rows, picked by the routing index) arrives by 16-byte cp.async and reads its row indices one k-block ahead into
// registers, so their latency hides behind the copies of the block before. The contiguous operand (A' or dH, rows g)
// arrives by TMA for every whole k-block of a segment (one thread, (64 columns) x (64 rows) boxes: a quarter to a
// half of the copies the producer issued before, and no per-thread address arithmetic for them), and by cp.async for
// an expert's partial last block. Rows past the segment are zero-filled (no source read: PTX's ignore-src in whole
// tiles, src-size 0 in edge tiles) for BOTH operands: the rows after an expert's segment belong to the next expert,
// and past the last routed row the workspace may hold uninitialised bits (NaN x 0 = NaN), so neither may reach the
// tensor cores; a TMA box could not stop at the segment's end (its row extent is the buffer's, known on the host),
// hence the copies for the partial block.
// A stage's "full" barrier counts one cp.async arrival per producer thread (noinc) and one arrival of producer
// thread 0: for a TMA-fed block an arrive.expect_tx of the box bytes issued before the boxes (as CUTLASS's TMA
// pipelines do), for any other block a plain arrival. (A first version added the bytes with a bare, relaxed
// expect_tx and no arrival of its own; one gpt-oss-shaped dW1 test hung with it, reproducibly, on an H200.)
// Without a tensor map (MainloopVarlenKParams::contiguous_tma false) both operands come by cp.async throughout.
//
// B kept on the ring: with the scheduler's groups of m-tiles (VarlenKSchedulerParams::m_group), a CTA's consecutive
// tiles of one (expert, n-tile) need the same B k-blocks. Where an expert's k_tiles divides the ring's stages, tile
// j's k-blocks land on the stages tile j - kStages / k_tiles used, and the producer then loads A alone (produce).
// Short segments (a few k-blocks: many experts, few tokens) are where B's share of the operand traffic through L2
// costs the most; longer ones keep streaming both operands.
//
// Consumers: as in the varlen-M mainloop, one WGMMA batch in flight, each stage released behind it. A tile of an
// expert with no rows has no k-block: the epilogue writes exact zeros for it (or leaves the output, accumulating).
//
// Template parameters: the tile configuration, how A and B arrive (gathered or contiguous), the element type.
// Edge tiles (M or N not a tile multiple, both multiples of 8): the 16-byte chunks at columns past M (A) or N (B)
// get src-size 0 in copy_rows_edge (never read past a row: the next bytes are the next row's), so the padded rows and
// columns of the accumulator are zeros, and the epilogue does not store them.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/bfloat16.h>

#include "gpu/hopper/async_primitives.cuh"
#include "gpu/hopper/params.hpp"
#include "gpu/hopper/stage_ring.cuh"
#include "gpu/hopper/tile_config.hpp"
#include "gpu/hopper/tile_scheduler_varlen_k.cuh"

namespace machmoe::gpu::hopper {

/// How an operand of the varlen-K mainloop reaches shared memory (the gathered one by cp.async, the contiguous one by
/// TMA for whole k-blocks where it has a tensor map, else by cp.async).
enum class OperandK : int {
  kGathered,    // rows picked by an index array (dO for dW2, X for dW1)
  kContiguous,  // grouped rows g themselves (A' for dW2, dH for dW1)
};

template <class Tile, OperandK kOperandA, OperandK kOperandB, class Element_ = cutlass::bfloat16_t>
struct MainloopVarlenK {
  using Params = MainloopVarlenKParams;
  using Element = Element_;
  using Traits = TileTraits<Tile>;
  static constexpr int kTileM = Tile::kTileM, kTileN = Tile::kTileN, kTileK = Tile::kTileK;
  static constexpr int kStages = Tile::kStages;
  static_assert(sizeof(Element) == 2, "16-bit operands (bf16)");
  static_assert(Tile::kClusterM == 1, "varlen-K: no clusters yet");
  static_assert(kTileK == 64, "k-blocks of 64 grouped rows");
  static_assert(kTileM % 64 == 0 && kTileN % 64 == 0, "64-column blocks of 128 bytes");
  // All 128 producer threads copy (PersistentKernel: every producer thread runs produce; the gather register split).
  static constexpr bool kGatherA = true;
  // Registers of the producer: the gathered operand's 4 row indices and the next block's 4 (the split of kernel.cuh:
  // 128 (56 + 2 x 224) = 64512).
  static constexpr int kProducerRegs = 56;

  // MN-major tiles, 128-byte swizzle: atoms of 64 (M or N) x 8 (K) ordered K first, so each 64-column block of a
  // stage holds its 64 k rows contiguously (8 KiB, 128 bytes per row, the 16-byte chunk c of row k at c ^ (k % 8)),
  // the layout a (64, 64) 128B-swizzled TMA box would write, and the one the dX~ kernel's MN-major B uses.
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>,
                                                               cute::Int<kStages>>{},
                                                   cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>,
                                                               cute::Int<kStages>>{},
                                                   cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kTileN>, cute::Int<kTileK>>,
                                                      cute::GMMA::Major::MN, cute::GMMA::Major::MN>());
  using TiledMma = ConsumerTiledMma<Tile, MmaAtom>;

  static constexpr int kBlockBytes = 64 * kTileK * 2;  // one 64-column block of a stage: 8 KiB

  using Tiles = typename StageRing<Tile, Element>::Tiles;
  using Barriers = typename StageRing<Tile, Element>::Barriers;
  using Storage = typename StageRing<Tile, Element>::Storage;

  __device__ __forceinline__ static void init_barriers(Barriers& b) {
    for (int i = 0; i < kStages; ++i) {
      // One cp.async arrival per producer thread, plus one of producer thread 0 for every block: arrive.expect_tx
      // ahead of its TMA loads for a TMA-fed block (the canonical order, so the phase cannot complete before the
      // transaction bytes are expected), a plain arrival otherwise.
      mbar_init(&b.full[i], 128 + 1);
      mbar_init(&b.empty[i], Traits::kCooperative ? 2 : 1);        // one per consuming warpgroup
    }
  }

  /// The contiguous operand's tensor map, when it has one (one thread, at kernel entry).
  __device__ __forceinline__ static void prefetch_descriptors(const Params& p) {
    if (p.contiguous_tma) tma_prefetch_descriptor(&p.tma_contiguous);
  }

  static constexpr bool kContiguousA = kOperandA == OperandK::kContiguous;
  static constexpr bool kContiguousB = kOperandB == OperandK::kContiguous;
  static_assert(kContiguousA != kContiguousB, "exactly one operand contiguous (the TMA-fed one)");
  static constexpr int kContiguousWidth = kContiguousA ? kTileM : kTileN;
  static constexpr std::uint32_t kContiguousBytes = static_cast<std::uint32_t>(kContiguousWidth * kTileK * 2);

  // ---- producer ------------------------------------------------------------------------------------------------
  //
  // Thread mapping of a k-block (64 rows): 8 threads cover the 128 bytes of one row inside one 64-column block
  // (16 B each, one 128-byte line per 8 threads: every warp-wide cp.async reads 4 whole lines), 16 rows per pass,
  // 4 passes; each thread copies the same chunk of every 64-column block of its 4 rows, so it needs 4 row indices
  // per operand and k-block, whatever the tile width.
  //
  // The producer's instructions per k-block bound these kernels: in warp-state samples of dW1 and dW2 on 120B
  // (2048,64,4) the consumers waited for a full stage at 22-24 % of all samples while the producer seldom waited for
  // an empty one, and it spent 192 instructions a warp per k-block on 16 copies. What it does per k-block is kept to
  // the copies themselves: the gathered operand's indices through a per-tile pointer (immediate offsets), the
  // contiguous operand's rows computed only for the blocks it takes by cp.async, the tiles' column offsets folded
  // into per-tile base pointers, a whole-tile row's source one 32 x 32 -> 64-bit multiply-add (copy_rows_whole) and
  // its validity one predicate for all its copies. That took dW1 and dW2 4-6 % fewer cycles under ncu on an H200
  // (docs/BENCHMARKS.md, session 73).

  static constexpr int kRowsPerThread = kTileK / 16;

  /// Copies this thread's chunks of one operand's k-block of an edge tile: kWidth / 64 blocks x 4 rows. `valid`:
  /// the operand's columns from col0 on (M or N minus col0, below kWidth): chunks at or past it are zero-filled (the
  /// extents are multiples of 8, so a chunk is wholly in or out).
  template <int kWidth>
  __device__ __forceinline__ static void copy_rows_edge(std::uint32_t dst_stage, const Element* base,
                                                        std::int64_t ld, std::int64_t col0, int valid,
                                                        const int (&rows)[kRowsPerThread], int row_in_pass,
                                                        std::uint32_t swizzled_chunk, int chunk) {
    bool col_ok[kWidth / 64];
#pragma unroll
    for (int blk = 0; blk < kWidth / 64; ++blk) col_ok[blk] = blk * 64 + chunk * 8 < valid;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int r = row_in_pass + 16 * j;
      const bool row_ok = rows[j] >= 0;
      const Element* src_row = base + (row_ok ? static_cast<std::int64_t>(rows[j]) * ld + col0 + chunk * 8 : 0);
#pragma unroll
      for (int blk = 0; blk < kWidth / 64; ++blk) {
        const bool ok = row_ok && col_ok[blk];
        cp_async_16(dst_stage + blk * kBlockBytes + r * 128 + swizzled_chunk, ok ? src_row + blk * 64 : base,
                    ok ? 16u : 0u);
      }
    }
  }

  /// Copies this thread's chunks of a whole-width k-block from rows `rows` of `col_base` (the operand's base pointer
  /// advanced to the tile's first column and this thread's chunk). Each row's source is one wide multiply-add of its
  /// 32-bit index and a 32-bit byte stride (the dispatcher takes this kernel only for row strides below 2^30
  /// elements); its kWidth / 64 copies sit at constant offsets from it and from its shared-memory slot (immediates).
  /// A row past the segment (-1) gets row 0's address, which exists, and its copies read nothing (ignore-src:
  /// zero-filled).
  template <int kWidth>
  __device__ __forceinline__ static void copy_rows_whole(std::uint32_t dst_stage, const Element* col_base,
                                                         std::int64_t ld, const int (&rows)[kRowsPerThread],
                                                         int row_in_pass, std::uint32_t swizzled_chunk) {
    const char* bytes = reinterpret_cast<const char*>(col_base);
    const int ld_bytes = static_cast<int>(ld) * 2;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const bool row_ok = rows[j] >= 0;
      const char* src = bytes + static_cast<std::int64_t>(max(rows[j], 0)) * ld_bytes;
      const std::uint32_t dst = dst_stage + (row_in_pass + 16 * j) * 128 + swizzled_chunk;
#pragma unroll
      for (int blk = 0; blk < kWidth / 64; ++blk) cp_async_16_if(dst + blk * kBlockBytes, src + blk * 128, row_ok);
    }
  }

  /// One operand's k-block: a whole tile (uniform) by copy_rows_whole, an edge tile by copy_rows_edge.
  template <int kWidth>
  __device__ __forceinline__ static void copy_operand(std::uint32_t dst_stage, const Element* base,
                                                      const Element* col_base, std::int64_t ld, std::int64_t col0,
                                                      int valid, const int (&rows)[kRowsPerThread], int row_in_pass,
                                                      std::uint32_t swizzled_chunk, int chunk) {
    if (valid >= kWidth)
      copy_rows_whole<kWidth>(dst_stage, col_base, ld, rows, row_in_pass, swizzled_chunk);
    else
      copy_rows_edge<kWidth>(dst_stage, base, ld, col0, valid, rows, row_in_pass, swizzled_chunk, chunk);
  }

  /// This thread's rows r = row_in_pass + 16 j of the contiguous operand (rows g of the segment) for the k-block
  /// whose rows from this thread's first on number `left` (-1: past the segment, zero-filled).
  __device__ __forceinline__ static void contiguous_rows(std::int64_t first_row, int left,
                                                         int (&rows)[kRowsPerThread]) {
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) rows[j] = 16 * j < left ? static_cast<int>(first_row + 16 * j) : -1;
  }

  /// Fills the ring for every tile of this CTA, in the order the consumers take them. `ptid` in [0, 128).
  template <class Scheduler>
  __device__ __forceinline__ static void produce(const Params& p, const typename Scheduler::Params& sp, Storage s,
                                                 int ptid) {
    Scheduler sched(sp);
    const int chunk = ptid & 7, row_in_pass = ptid >> 3;
    // Row r = row_in_pass + 16 j has r % 8 = row_in_pass % 8 for every j: one swizzled chunk offset per thread.
    const std::uint32_t swizzled_chunk = static_cast<std::uint32_t>((chunk ^ (row_in_pass & 7)) << 4);
    const Element* a_base = static_cast<const Element*>(p.a);
    const Element* b_base = static_cast<const Element*>(p.b);
    const std::int32_t* gather = kContiguousA ? p.b_gather : p.a_gather;
    int last_expert = -1, last_n_tile = -1;  // the previous tile on the ring
    int run = 0;  // tiles on the ring right before this one with its (expert, n-tile)
    for (int i = 0;; ++i) {
      const VarlenKTileCoord c = sched.get(i);
      if (!c.valid()) break;
      if (c.k_tiles == 0) continue;  // an expert without rows: nothing on the ring
      run = c.expert == last_expert && c.n_tile == last_n_tile ? run + 1 : 0;
      last_expert = c.expert, last_n_tile = c.n_tile;
      // B stays on the ring: where k_tiles divides the ring, the tile kStages / k_tiles tiles back put its k-blocks
      // on the very stages this tile's take (ring positions kStages apart), and the tiles in between used the other
      // stages. If that tile had this (expert, n-tile), its B operand (the same rows and columns, zero-filled the same
      // way) is still there: only A is loaded. The consumers read the stages as always.
      const bool keep_b = p.keep_b_allowed && kStages % c.k_tiles == 0 && run >= kStages / c.k_tiles;
      const std::int64_t a_col0 = static_cast<std::int64_t>(c.m_tile) * kTileM;
      const std::int64_t b_col0 = static_cast<std::int64_t>(c.n_tile) * kTileN;
      const int a_valid = p.M - static_cast<int>(a_col0), b_valid = p.N - static_cast<int>(b_col0);  // edge tiles
      const Element* a_col = a_base + a_col0 + chunk * 8;  // this thread's chunk of the tile's first column block
      const Element* b_col = b_base + b_col0 + chunk * 8;
      // The gathered operand's row indices (none for a kept B), one k-block ahead: the next block's loads are in
      // flight while this block waits for its stage and is copied.
      const bool gathered_copies = !kContiguousA || !keep_b;
      const std::int32_t* index = gather + c.k_begin + row_in_pass;  // this thread's first row of the k-block
      int left = c.k_rows - row_in_pass;  // the segment's rows from that row on
      int rows_g[kRowsPerThread];
#pragma unroll
      for (int j = 0; j < kRowsPerThread; ++j)
        rows_g[j] = gathered_copies && 16 * j < left ? __ldg(index + 16 * j) : -1;
      std::uint32_t iter = c.ring;
      for (int kb = 0; kb < c.k_tiles; ++kb, ++iter) {
        int next_g[kRowsPerThread];
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j)
          next_g[j] = gathered_copies && 16 * j < left - kTileK ? __ldg(index + kTileK + 16 * j) : -1;
        const int stage = static_cast<int>(iter % kStages);
        const std::uint32_t phase = (iter / kStages) & 1u;
        mbar_wait(&s.bar.empty[stage], phase ^ 1u, WaitSite::kProducerEmpty, iter);
        // A whole k-block of the segment: the contiguous operand's 64 rows are all this expert's routed rows.
        const bool by_tma = p.contiguous_tma && (kb + 1) * kTileK <= c.k_rows;
        const bool tma_now = by_tma && !(kContiguousB && keep_b);  // a kept contiguous B is not loaded at all
        if (ptid == 0 && !tma_now) mbar_arrive(&s.bar.full[stage]);
        if (tma_now && ptid == 0) {
          mbar_arrive_expect_tx(&s.bar.full[stage], kContiguousBytes);
          Element* dst = kContiguousA ? &s.t.a[stage][0] : &s.t.b[stage][0];
          const int col0 = static_cast<int>(kContiguousA ? a_col0 : b_col0);
          const int row0 = static_cast<int>(c.k_begin) + kb * kTileK;  // < 2^31: dispatch checks the buffer's rows
#pragma unroll
          for (int blk = 0; blk < kContiguousWidth / 64; ++blk)  // boxes past M or N arrive zero-filled
            tma_load_2d(&p.tma_contiguous, &s.bar.full[stage], dst + blk * 64 * kTileK, col0 + 64 * blk, row0);
        }
        if constexpr (!kContiguousA) {  // A gathered (dW2), B contiguous
          copy_operand<kTileM>(smem_u32(&s.t.a[stage][0]), a_base, a_col, p.lda, a_col0, a_valid, rows_g, row_in_pass,
                               swizzled_chunk, chunk);
          if (!keep_b && !by_tma) {
            int rows_c[kRowsPerThread];
            contiguous_rows(c.k_begin + kb * kTileK + row_in_pass, left, rows_c);
            copy_operand<kTileN>(smem_u32(&s.t.b[stage][0]), b_base, b_col, p.ldb, b_col0, b_valid, rows_c,
                                 row_in_pass, swizzled_chunk, chunk);
          }
        } else {  // A contiguous, B gathered (dW1)
          if (!by_tma) {
            int rows_c[kRowsPerThread];
            contiguous_rows(c.k_begin + kb * kTileK + row_in_pass, left, rows_c);
            copy_operand<kTileM>(smem_u32(&s.t.a[stage][0]), a_base, a_col, p.lda, a_col0, a_valid, rows_c,
                                 row_in_pass, swizzled_chunk, chunk);
          }
          if (!keep_b)
            copy_operand<kTileN>(smem_u32(&s.t.b[stage][0]), b_base, b_col, p.ldb, b_col0, b_valid, rows_g,
                                 row_in_pass, swizzled_chunk, chunk);
        }
        cp_async_arrive_noinc(&s.bar.full[stage]);
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) rows_g[j] = next_g[j];
        index += kTileK, left -= kTileK;
      }
    }
    cp_async_wait_all();
  }

  // ---- consumer ------------------------------------------------------------------------------------------------

  /// The shared memory (32-bit shared address) a borrowing epilogue may stage into once both consumers are done with
  /// `stage` (16 KiB per consumer warpgroup: the A tile for the first, the first half of the B tile for the second).
  __device__ __forceinline__ static std::uint32_t borrowable(Storage s, int stage, int consumer) {
    static_assert(kTileM * kTileK * 2 == 16 * 1024 && kTileN * kTileK * 2 >= 16 * 1024, "16 KiB per consumer");
    return consumer == 0 ? smem_u32(&s.t.a[stage][0]) : smem_u32(&s.t.b[stage][0]);
  }

  /// Accumulates tile `c` into `acc` (zeroed by the first WGMMA). A tile without k-blocks leaves `acc` untouched:
  /// the epilogue stores zeros for it (clearing the registers here, with non-WGMMA instructions, made ptxas
  /// serialise every WGMMA of the kernel, warning C7515).
  /// `on_first_issue` runs (on every thread) once the first k-block's WGMMAs are issued, `on_last_wait` once this
  /// warpgroup has seen the tile's last stage arrive (both at once for a tile without k-blocks).
  /// hold_last: the tile's last stage is not released (a borrowing epilogue stages into it, and the caller releases
  /// it): its index is returned; -1 for a tile without k-blocks or without hold_last.
  template <class Accumulator, class OnFirstIssue, class OnLastWait>
  __device__ __forceinline__ static int consume(const Params&, Storage s, Accumulator& acc,
                                                const VarlenKTileCoord& c, int /*tile_index*/, int mma_thread,
                                                OnFirstIssue&& on_first_issue, OnLastWait&& on_last_wait,
                                                bool hold_last = false) {
    using namespace cute;
    const int wg_thread = mma_thread % 128;
    if (c.k_tiles == 0) {  // the accumulator is left as it is; the epilogue writes zeros for such a tile
      on_first_issue();
      on_last_wait();
      return -1;
    }
    TiledMma mma;
    Tensor sA = make_tensor(make_smem_ptr(&s.t.a[0][0]), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(&s.t.b[0][0]), SmemLayoutB{});
    auto thr = mma.get_thread_slice(mma_thread);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage) descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    const int last_stage = consume_k_blocks<kStages>(
        mma, tCrA, tCrB, acc, s.bar.full, c.ring, c.k_tiles,
        [&](int stage) {
          if (wg_thread == 0) mbar_arrive(&s.bar.empty[stage]);
        },
        on_first_issue, on_last_wait);
    // (From the coordinate, not from the loop: a loop value live past the loop moved the whole loop's stage and WGMMA
    // descriptor arithmetic from uniform to ordinary registers.)
    if (hold_last) return static_cast<int>((c.ring + static_cast<std::uint32_t>(c.k_tiles) - 1) % kStages);
    if (wg_thread == 0) mbar_arrive(&s.bar.empty[last_stage]);
    return -1;
  }
};

}  // namespace machmoe::gpu::hopper
