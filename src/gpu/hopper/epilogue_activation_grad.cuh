// The activation-gradient epilogue of the backward's dH kernel (docs/SPEC.md §3.2), run by the consumer warpgroup
// that computed the tile. The accumulator holds dA' = gather(dO) W2_e^T for kTileN columns j of A; with H (the
// forward's pre-activation, gate/up-interleaved) and the pair's score s it writes, from the same fp32 values:
//   dH  = act'(H) (s dA')     (GLU: math::glu_backward, e.g. d gate = s dA' up f'(gate), d up = s dA' f(gate));
//                             bf16, interleaved like H
//   A'  = s A, A = act(H)     (the dW2 GEMM's operand; bf16)
//   dS partials: <dA', A> over each 64-column block of the tile, one fp32 per (pair, block), reduced later in a
//   fixed order (launch_ds_reduce), so dS is deterministic without atomics.
//
// H: by TMA into the warpgroup's two staging buffers, a pass (64 rows x kStageCols dH columns: 128 in the ping-pong
// tile, 64 in the cooperative one) at a time, ahead of use: the first two passes of a tile before its mainloop, each
// later one as soon as its buffer is free. Each warp loads, computes and stores only its own 16 rows of a pass (its
// own TMA boxes and H barriers), so no pass waits for the warpgroup's other warps: with a named barrier of the four
// warps before and after each pass, ncu put 21 % of the wide tile's epilogue stall samples on those barriers (H200,
// session 76), and warp-private passes took the dH kernel's cycles down 2.5 % on 120B (2048,64,4) and 0.8 % on 7B
// (256,128,8) (ncu, one launch, H200, session 92). dH is computed in place over H in the buffer and leaves by TMA store; a
// thread reads exactly the H elements whose dH it then writes, so in-place mode (dH over H in global memory, input-only
// mode, memory.hpp) stays safe: a tile loads the H of its rows and columns before it stores their dH, and no other tile
// stores them. Under the ping-pong schedule (the default tile) the other consumer warpgroup's mainloop keeps the tensor
// cores busy meanwhile; under the cooperative one (Tile128x256CooperativeStagedH, where d and n are large:
// heuristics.hpp) nothing does, and the epilogue is exposed, but its mainloop runs the GEMM at cuBLAS's rate. The
// cooperative tile once read H from global memory into registers pass by pass (its 4-stage ring left no room for 16 KiB
// buffers); staged in 8 KiB buffers of 64 columns it measured 0.3-0.6 ms faster than the ping-pong tile on 120B
// (2048,64,4) (H100, docs/BENCHMARKS.md, session 40). H is not prefetched into L2: a bulk L2 prefetch of the tile's H
// rows by the producer, one mainloop ahead, was evicted before the epilogue read it, so H came from HBM twice (ncu,
// H100, 1.4B (256,128,8): 1.20 GB read from HBM with the prefetch, 0.87 GB without, and the kernel 12 % faster without;
// docs/BENCHMARKS.md, session 28); prefetched by TMA when the tile's own mainloop had 16 or 32 k-blocks left, it was
// still evicted first (ncu, H200, session 61: 5-13 % more read from HBM, the kernel 0-2 % slower on four main rows).
// Nor is the cooperative tile short of H in flight: loading the tile's whole H (128 KiB) into three of the mainloop's
// ring stages after its k-blocks, dH computed in place there, measured equal (ncu and the layer, H200, session 63,
// docs/measurements/2026-11-29-h200-session63/dh_h_through_ring.diff).
//
// Scores: a row's pair index (scatter) is loaded in tile_start, before the tile's mainloop, and the scores of all the
// thread's rows in one batch once the tile's first WGMMAs are issued (first_mma_issued), so that the rest of the
// mainloop hides both latencies. Loaded per row atom inside the epilogue, the dependent pair -> score loads were the
// kernel's hottest stall after the ring waits (ncu, H200, 1.4B (256,128,8): ~12 % of the samples); hoisted to the
// epilogue's start, the kernel went 0.470-0.473 -> 0.433-0.439 ms there (H200, same-machine A/B, session 31), and
// the first use of the batch still waited on it at ~7 % of the consumer warps' samples (ncu, H100, session 32).
//
// Edge tiles (n not a multiple of kTileN): the accumulator's columns j >= n are exact zeros (W2's rows past n arrive
// zero-filled by TMA, so dA' = sum_k dO[k] * 0), H is not loaded past the row's valid columns
// (the padded columns read H = 0, so A = act(0) * 0 or act(0), finite), and dH and A' are clipped by the stores
// (warp_release below, as Staging::release). A padded column thus adds dA' * A = 0 * finite = +0 exactly to its dS
// block; a 64-column block wholly past n (j0 / 64 + b >= ds_tiles = ceil(n / 64)) is not written at all, since the
// partials of a pair are ds_tiles wide and the next pair's follow (launch_ds_reduce reads exactly ds_tiles per pair).
#pragma once

#include "gpu/hopper/epilogue_staging.cuh"
#include "gpu/hopper/fast_math.cuh"

namespace machmoe::gpu::hopper {

template <class Tile, Activation kAct>
struct EpilogueActivationGrad {
  using Params = EpilogueActivationGradParams;
  using Staging = EpilogueStaging<Tile>;
  static constexpr int kTileN = Tile::kTileN;
  static constexpr bool kGlu = math::is_glu_activation(kAct);
  static constexpr int kDhCols = kGlu ? 2 * kTileN : kTileN;  // dH (and H) columns of a tile
  static constexpr int kPasses = kDhCols / Staging::kStageCols;
  static constexpr int kV2PerPass = (kTileN / 8) / kPasses;   // accumulator column blocks of 8 per pass
  static constexpr int kDsBlocks = kTileN / 64;               // dS partials per row and tile
  // Accumulator column blocks of 8 whose H a thread loads at once, before their dH goes back over it (see apply):
  // 4 in the ping-pong tile, 2 in the cooperative one. H200, session 64, the layer's dH stage against loading pair by
  // pair: 4 took 1.4B (256,128,8) 0.48 -> 0.42 ms and 7B (256,128,8) 0.42 -> 0.39 (2: 0.44, 0.39); in the wide tile 2
  // took 120B (2048,64,4) 4.41 -> 4.22 where 4 took 4.28 (ncu: 3.50 against 3.59 ms, one launch). With 8 ptxas spilled
  // 24 bytes in gptoss_swiglu's ping-pong kernel.
  static constexpr int kHLoadBatch = Tile::kSchedule == Schedule::kPingPong ? 4 : 2;
  static_assert(kDhCols % Staging::kStageCols == 0 && kTileN % 64 == 0, "tile columns");

  // H by TMA: two staging buffers per warpgroup, into which TMA loads a pass of H (64 rows x kStageCols dH columns, the
  // staging layout); the pass's dH is computed in place and leaves by TMA store from the same buffer. A tile's passes
  // and A' passes ("slots") take the two buffers in turn; the H of a tile's first two slots is loaded before its
  // mainloop, and each later H slot's as soon as its buffer has been stored from, so the epilogue finds H in shared
  // memory instead of waiting on global loads pass by pass.
  static constexpr int kAPasses = kTileN / Staging::kStageCols;  // A' passes per row atom
  static constexpr int kSlotsPerAtom = kPasses + kAPasses;
  static constexpr int kSlots = Staging::kRowAtoms * kSlotsPerAtom;
  // Each warp owns rows [16 warp, 16 warp + 16) of a row atom, in both buffers: its H arrives by its own TMA loads (a
  // box of 16 rows, dispatch.cpp), its dH and A' leave by its own TMA stores, and no pass needs another warp, so the
  // epilogue has no named barrier: a warp waits only for its own loads and for its own stores to have read a buffer.
  static constexpr int kWarpRows = kEpilogueWarpRows;  // the box height of dispatch.cpp's maps for this epilogue
  static constexpr int kWarps = Staging::kRows / kWarpRows;
  static_assert(kWarps == 4, "the warpgroup's four warps cover a 64-row atom, 16 rows each");
  static constexpr int kWarpElems = kWarpRows * 64;  // a warp's rows of one 64 x 64 swizzled block (1024-B aligned)
  static constexpr std::uint32_t kHWarpBytes = kWarpRows * Staging::kStageCols * 2;
  __host__ __device__ static constexpr bool slot_is_h(int s) { return s % kSlotsPerAtom < kPasses; }

  struct Storage {
    typename Staging::Storage buf[2];
    std::uint64_t h_full[2][kWarps];  // warp w's rows of buffer b hold its slot's H (TMA complete_tx)
  };
  /// Per thread, across the warpgroup's tiles: the parity of each buffer's next H arrival, and the
  /// current tile's pair index of each of the thread's rows (-1: past the tile's rows), loaded by tile_start, and
  /// their scores (0 past the rows), loaded by first_mma_issued.
  struct State {
    std::uint32_t h_parity = 0;
    std::int32_t pair[Staging::kRowAtoms][2];
    float score[Staging::kRowAtoms][2];
  };

  /// The pair of each of the thread's rows (row_in_warp and row_in_warp + 8 of its warp's 16, in each row atom),
  /// issued before the tile's mainloop: the loads' latency passes under the mainloop instead of stalling the
  /// epilogue, which then reads only the scores (one dependent load for all its rows, not two per row atom).
  __device__ __forceinline__ static void load_pairs(const Params& p, State& state, const TileCoord& c, int row_base,
                                                    int wg_thread) {
    const int warp = wg_thread / 32, row_in_warp = (wg_thread % 32) / 4;
#pragma unroll
    for (int m = 0; m < Staging::kRowAtoms; ++m) {
      const int rows = c.rows - row_base - m * Staging::kRows;
      const std::int64_t g0 = c.row0 + row_base + m * Staging::kRows;
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = warp * 16 + v1 * 8 + row_in_warp;
        state.pair[m][v1] = r < rows ? p.scatter[g0 + r] : -1;
      }
    }
  }

  /// The scores of the thread's rows (0 past the tile's rows), all loads issued together, while the tile's first
  /// WGMMAs run: the epilogue reads them from the state.
  __device__ __forceinline__ static void first_mma_issued(const Params& p, State& state) {
#pragma unroll
    for (int m = 0; m < Staging::kRowAtoms; ++m)
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1)
        state.score[m][v1] = state.pair[m][v1] >= 0 ? p.scores[state.pair[m][v1]] : 0.0f;
  }

  __device__ __forceinline__ static void init(Storage& st) {
    for (int b = 0; b < 2; ++b)
      for (int w = 0; w < kWarps; ++w) mbar_init(&st.h_full[b][w], 1);
  }

  /// Lane 0 of warp `warp`: the TMA loads of the warp's rows of slot s's H (row atom s / kSlotsPerAtom, pass
  /// s % kSlotsPerAtom) into buffer s % 2. Rows past the tile's (another expert's H, or past P: zero-filled) and
  /// columns past 2n (zero-filled) are loaded but never stored.
  __device__ __forceinline__ static void issue_h(const Params& p, Storage& st, const TileCoord& c, int row_base,
                                                 int s, int warp) {
    const int b = s % 2, m = s / kSlotsPerAtom, pass = s % kSlotsPerAtom;
    const int row = static_cast<int>(c.row0) + row_base + m * Staging::kRows + warp * kWarpRows;
    const int col = static_cast<int>(static_cast<std::int64_t>(c.n_tile) * kDhCols) + pass * Staging::kStageCols;
    mbar_arrive_expect_tx(&st.h_full[b][warp], kHWarpBytes);
#pragma unroll
    for (int blk = 0; blk < Staging::kStageCols / 64; ++blk)
      tma_load_2d(&p.tma_h, &st.h_full[b][warp],
                  st.buf[b].staged + blk * Staging::kBlockElems + warp * kWarpElems, col + 64 * blk, row);
  }

  /// Waits until the warp's rows of a buffer are free: its lanes are done with them (their shared-memory accesses
  /// ordered before the async proxy's) and lane 0's TMA stores have read them.
  __device__ __forceinline__ static void warp_acquire(int lane) {
    fence_proxy_async_shared();
    if (lane == 0) bulk_wait_group_read0();
    __syncwarp();
  }

  /// Sends the warp's `rows` (<= 16) staged rows of a pass (kStageCols columns) to (row g0, column c0) of `out`: TMA
  /// when all 16 rows are valid, predicated 16-byte stores otherwise. Columns at or past out.cols are not written (as
  /// Staging::release).
  __device__ __forceinline__ static void warp_release(const typename Staging::Storage& buf, const EpilogueOutput& out,
                                                      int rows, std::int64_t g0, std::int64_t c0, int warp,
                                                      int lane) {
    constexpr int kCols = Staging::kStageCols;
    fence_proxy_async_shared();  // the fragments written with st.shared, made visible to the copy engine
    __syncwarp();
    if (rows == kWarpRows) {
      if (lane == 0) {
        for (int b = 0; b < kCols / 64; ++b)
          if (c0 + 64 * b < out.cols)
            tma_store_2d(&out.tma, buf.staged + b * Staging::kBlockElems + warp * kWarpElems,
                         static_cast<int>(c0) + 64 * b, static_cast<int>(g0));
        bulk_commit_group();
      }
      return;
    }
    constexpr int kChunksPerRow = kCols / 8;
    const std::int64_t valid = out.cols - c0;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(out.ptr) + g0 * out.ld + c0;
    for (int i = lane; i < kWarpRows * kChunksPerRow; i += 32) {
      const int r = i / kChunksPerRow, ch = i - r * kChunksPerRow;
      if (r < rows && ch * 8 < valid) {
        const uint4 v = *reinterpret_cast<const uint4*>(buf.staged + Staging::staged_index(warp * kWarpRows + r, ch * 8));
        *reinterpret_cast<uint4*>(dst + static_cast<std::int64_t>(r) * out.ld + ch * 8) = v;
      }
    }
  }

  /// Before the tile's mainloop: once the warp's rows of the buffers are free, the H of the first two slots.
  __device__ __forceinline__ static void tile_start(const Params& p, Storage& st, State& state, const TileCoord& c,
                                                    int row_base, int wg_thread, int /*barrier_id*/) {
    load_pairs(p, state, c, row_base, wg_thread);
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    warp_acquire(lane);
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < 2 && s < kSlots; ++s)
        if (slot_is_h(s)) issue_h(p, st, c, row_base, s, warp);
    }
  }

  /// One variant: the epilogue has no bias (b1 is already in H; the b2 term of dS is added by the reduction).
  template <class F>
  __device__ __forceinline__ static void with_variant(const Params&, F&& f) {
    f(EpilogueVariant<false, false>{});
  }

  /// row_base: the warpgroup's first row in the tile (cooperative: 0 or 64). H from the staging buffers (loaded by
  /// TMA, see Storage), dH computed in place.
  template <class Variant, class Accumulator>
  __device__ __forceinline__ static void apply(const Params& p, Storage& st, State& state, Accumulator& acc,
                                               const TileCoord& c, int row_base, int wg_thread, int /*barrier_id*/) {
    using namespace cute;
    const int warp = wg_thread / 32, lane = wg_thread % 32;
    const int quad = lane % 4, row_in_warp = lane / 4;
    const std::int64_t j0 = static_cast<std::int64_t>(c.n_tile) * kTileN;
    const std::int64_t dh_col0 = kGlu ? 2 * j0 : j0;
    const int valid_j = p.N - j0 < kTileN ? static_cast<int>(p.N - j0) : kTileN;
    const math::ActParams<float> ap{p.act_alpha, p.act_limit};
    // After slot s: if slot s + 2 (the next user of s's buffer) is an H slot, the warp's load of it, once the warp is
    // done with its rows of the buffer and its store has read them.
    auto refill = [&](int s) __attribute__((always_inline)) {
      if (s + 2 < kSlots && slot_is_h(s + 2)) {
        warp_acquire(lane);
        if (lane == 0) issue_h(p, st, c, row_base, s + 2, warp);
      }
    };

    CUTE_UNROLL
    for (int m = 0; m < Staging::kRowAtoms; ++m) {
      // The warp's valid rows of the atom (<= 0: none; uniform within the warp).
      const int rows = min(kWarpRows, c.rows - row_base - m * Staging::kRows - warp * kWarpRows);
      const std::int64_t g0 = c.row0 + row_base + m * Staging::kRows + warp * kWarpRows;
      auto value = [&](int v0, int v1, int v2) __attribute__((always_inline)) -> float& {
        return acc(make_coord(make_coord(v0, v1, v2), m, 0));
      };
      const float (&score)[2] = state.score[m];
      float ds[2][kDsBlocks];
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1)
        CUTE_UNROLL
        for (int b = 0; b < kDsBlocks; ++b) ds[v1][b] = 0.0f;

      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const int s = m * kSlotsPerAtom + pass, b = s % 2;
        auto& buf = st.buf[b];
        // Every H slot's arrival is waited for, stored or not (uniform): the parities stay in step.
        mbar_wait(&st.h_full[b][warp], (state.h_parity >> b) & 1u);
        state.h_parity ^= 1u << b;
        if (rows > 0 && pass * kV2PerPass * 8 < valid_j) {
          // A row's H pairs are loaded kLoadBatch blocks at a time, before the batch's dH is stored. dH goes over H in
          // the same buffer, and the compiler cannot prove a later pair's address apart from an earlier pair's store,
          // so with load, math and store pair by pair it kept that order: every pair waited out its own shared-memory
          // load, one warp alone on its scheduler (ncu, H200, session 63, 1.4B (256,128,8): the epilogue's samples 29 %
          // short-scoreboard and 25 % fixed-latency waits, LDS and STS alternating in the SASS).
          // A thread's H of one 8-column block of the accumulator: one bf16 pair (columns col, col + 1), or with a GLU
          // the two gate/up pairs of A columns col and col + 1, adjacent in H (columns 2 col .. 2 col + 3, 8-byte
          // aligned: 2 col is a multiple of 4, and the swizzle moves whole 16-byte chunks), read and written back as
          // one 8-byte access: half the instructions of the H loads and dH stores (ncu, H200, session 65: the kernel's
          // shared-memory instructions 8.2M -> 5.5M on 1.4B (256,128,8), the dH stage 1-3 % faster on four rows).
          constexpr int kPairsPerBlock = kGlu ? 2 : 1;
          struct alignas(4 * kPairsPerBlock) HPairs {
            __nv_bfloat162 pair[kPairsPerBlock];
          };
          constexpr int kLoadBatch = kHLoadBatch < kV2PerPass ? kHLoadBatch : kV2PerPass;
          static_assert(kV2PerPass % kLoadBatch == 0, "whole batches");
          auto h_col = [&](int i, int v0) __attribute__((always_inline)) {
            const int col = (pass * kV2PerPass + i) * 8 + quad * 2;
            return (kGlu ? 2 * (col + v0) : col) - pass * Staging::kStageCols;
          };
          CUTE_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            const int r = warp * 16 + v1 * 8 + row_in_warp;
            const float sc = score[v1];
            CUTE_UNROLL
            for (int i0 = 0; i0 < kV2PerPass; i0 += kLoadBatch) {
              HPairs h[kLoadBatch];
              CUTE_UNROLL
              for (int i = 0; i < kLoadBatch; ++i)
                h[i] = *reinterpret_cast<const HPairs*>(&buf.staged[Staging::staged_index(r, h_col(i0 + i, 0))]);
              CUTE_UNROLL
              for (int i = 0; i < kLoadBatch; ++i) {
                const int v2 = pass * kV2PerPass + i0 + i;
                if constexpr (kGlu) {
                  HPairs dh;
                  CUTE_UNROLL
                  for (int v0 = 0; v0 < 2; ++v0) {
                    // gate/up of A column col + v0 at dH columns 2 (col + v0), + 1, overwritten with dH
                    const float dap = value(v0, v1, v2), da = sc * dap;
                    const math::GluGrad<float> f = math::glu_backward<kAct, FastMath>(
                        __low2float(h[i].pair[v0]), __high2float(h[i].pair[v0]), da, ap);
                    dh.pair[v0] = __floats2bfloat162_rn(f.d_gate, f.d_up);
                    ds[v1][v2 / 8] += dap * f.value;
                    value(v0, v1, v2) = sc * f.value;
                  }
                  *reinterpret_cast<HPairs*>(&buf.staged[Staging::staged_index(r, h_col(i0 + i, 0))]) = dh;
                } else {  // H columns col, col + 1: one bf16 pair, overwritten with their dH
                  float d[2];
                  CUTE_UNROLL
                  for (int v0 = 0; v0 < 2; ++v0) {
                    const float dap = value(v0, v1, v2);
                    const math::ActValue<float> f = math::act_value_and_derivative<kAct, FastMath>(
                        v0 == 0 ? __low2float(h[i].pair[0]) : __high2float(h[i].pair[0]));
                    d[v0] = sc * dap * f.derivative;
                    ds[v1][v2 / 8] += dap * f.value;
                    value(v0, v1, v2) = sc * f.value;
                  }
                  Staging::put2(buf, r, h_col(i0 + i, 0), d[0], d[1]);
                }
              }
            }
          }
          warp_release(buf, p.dh, rows, g0, dh_col0 + pass * Staging::kStageCols, warp, lane);
        }
        refill(s);
      }

      // A' (kTileN columns) from the accumulator: the dH passes left s A in place of dA'.
      CUTE_UNROLL
      for (int pass = 0; pass < kAPasses; ++pass) {
        const int s = m * kSlotsPerAtom + kPasses + pass;
        auto& buf = st.buf[s % 2];
        if (rows > 0 && pass * Staging::kStageCols < valid_j) {
          warp_acquire(lane);
          CUTE_UNROLL
          for (int v2 = pass * (Staging::kStageCols / 8); v2 < (pass + 1) * (Staging::kStageCols / 8); ++v2) {
            CUTE_UNROLL
            for (int v1 = 0; v1 < 2; ++v1) {
              const int r = warp * 16 + v1 * 8 + row_in_warp;
              Staging::put2(buf, r, v2 * 8 + quad * 2 - pass * Staging::kStageCols, value(0, v1, v2),
                            value(1, v1, v2));
            }
          }
          warp_release(buf, p.a_prime, rows, g0, j0 + pass * Staging::kStageCols, warp, lane);
        }
        refill(s);
      }
      store_ds(p, ds, state.pair[m], j0, quad);
    }
  }

  /// dS partials: the quad's four lanes hold the row's columns; a fixed butterfly sums them (deterministic).
  __device__ __forceinline__ static void store_ds(const Params& p, float (&ds)[2][kDsBlocks], const std::int32_t (&pair)[2],
                                                  std::int64_t j0, int quad) {
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
      CUTE_UNROLL
      for (int b = 0; b < kDsBlocks; ++b) {
        float x = ds[v1][b];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        // A block wholly past n is not written (it would land in the next pair's partials).
        if (quad == 0 && pair[v1] >= 0 && j0 / 64 + b < p.ds_tiles)
          p.ds_partial[static_cast<std::int64_t>(pair[v1]) * p.ds_tiles + j0 / 64 + b] = x;
      }
    }
  }
};

}  // namespace machmoe::gpu::hopper
