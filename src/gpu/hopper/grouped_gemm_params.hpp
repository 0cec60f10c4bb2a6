// Parameters and compile-time configuration of the Hopper grouped GEMM kernels (forward up- and
// down-projection). Host and device code share this header; it holds no device code.
//
// One kernel computes, for every expert e and every row g of its grouped segment [off[e], off[e+1]),
//   C[g, c] = sum_k A[row(g), k] * B_e[c, k]        (fp32 accumulation on the tensor cores)
// and hands the fp32 tile to an epilogue. row(g) = gather[g] (up-projection: rows of X picked by the routing) or g
// (down-projection: the contiguous activation buffer).
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; descriptors are encoded through the runtime's driver entry point)

#include <cstdint>

#include "machmoe/problem.hpp"

namespace machmoe::gpu::hopper {

/// What the epilogue does with the fp32 tile.
enum class EpilogueKind : int {
  kStore,          // out = acc (+ bias): the down-projection Y
  kUpActivation,   // H = acc (+ b1) stored when h_out, A = act(H) stored: the up-projection
};

/// A kernel configuration: the tile, the pipeline depth, the A-operand load path and the epilogue. One
/// configuration per translation unit (src/gpu/hopper/instantiations/).
/// Consumer schedules: ping-pong (the two consumer warpgroups take alternate 128 x kTileN tiles; one's epilogue
/// overlaps the other's mainloop) or cooperative (both share each tile, 64 rows each: twice the N width per
/// WGMMA for the same registers, so fewer operand bytes per FLOP through L2 and shared memory).
enum class Schedule : int { kPingPong, kCooperative };

template <int TileN_, int Stages_, bool GatherA_, EpilogueKind Epi_, Schedule Sched_,
          Activation Act_ = Activation::kSwiGLU, int ClusterM_ = 1>
struct KernelConfig {
  static constexpr int kTileM = 128;  // rows of one tile
  static constexpr int kTileN = TileN_;
  static constexpr int kTileK = 64;   // 128 bytes of bf16: one 128-byte-swizzled row per smem line
  static constexpr int kStages = Stages_;
  static constexpr bool kGatherA = GatherA_;
  static constexpr EpilogueKind kEpilogue = Epi_;
  // The activation is compiled in: a run-time switch per accumulator value made the unrolled epilogue large
  // enough to thrash the instruction cache (measured: 4x slower up-projection).
  static constexpr Activation kActivation = Act_;
  static constexpr bool kGlu = Epi_ == EpilogueKind::kUpActivation &&
                               (Act_ == Activation::kSwiGLU || Act_ == Activation::kGeGLU || Act_ == Activation::kReGLU);
  static constexpr bool kCooperative = Sched_ == Schedule::kCooperative;
  // CTAs per cluster along M: with 2, a cluster takes two M-adjacent tiles of one expert and N tile, and each CTA
  // loads half of the shared weight tile and multicasts it to both (half the weight traffic from L2).
  static constexpr int kClusterM = ClusterM_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
};

struct GroupedGemmParams {
  int E = 0;        // experts
  int N = 0;        // output columns (H columns for the up-projection: 2n for GLU, n otherwise)
  int K = 0;        // reduction length, a multiple of 64
  int n_tiles = 0;  // N / kTileN
  int raster_m = 1;  // M-tiles per rasterisation group of the tile scheduler (1: along N)
  const std::int32_t* expert_offsets = nullptr;  // (E + 1), device

  // A operand. Gathered: rows of `a` (row stride lda elements) picked by `gather`. Contiguous: TMA through tma_a.
  const void* a = nullptr;
  std::int64_t lda = 0;
  const std::int32_t* gather = nullptr;
  CUtensorMap tma_a;  // 2D (K, rows), box (64, 128), 128-byte swizzle; unused when gathered

  // B operand (weights), K-major: 3D (K, rows per expert, E), box (64, kTileN / 2, 1). A tile's kTileN rows are
  // loaded as two halves, so the concatenated GLU layout lands interleaved in shared memory without a copy.
  CUtensorMap tma_b;
  bool b_concatenated = false;

  // Epilogue.
  void* out = nullptr;  // H (kUpActivation, may be null: inference) or Y (kStore); bf16, row stride ld_out
  std::int64_t ld_out = 0;
  const void* bias = nullptr;  // (E, N) in the weights' own row order, row stride ld_bias; may be null
  std::int64_t ld_bias = 0;
  void* act_out = nullptr;  // A (kUpActivation), bf16, row stride ld_act
  std::int64_t ld_act = 0;
  int glu_n = 0;  // n: in the concatenated layout, the first up row of the weights and of the bias
  // TMA stores of whole 64-row blocks: 2D (columns, rows) maps of out and act_out, box (64, 64), 128-byte swizzle
  // (blocks that end past the expert's segment are written with predicated stores instead).
  CUtensorMap tma_out;
  CUtensorMap tma_act;
};

}  // namespace machmoe::gpu::hopper
