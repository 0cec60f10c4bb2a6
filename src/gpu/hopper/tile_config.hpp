// Tile configurations of the Hopper kernels: named structs (tile shape, pipeline depth, consumer schedule,
// cluster), shared by host and device code; no device code here. A kernel is assembled from a mainloop, an
// epilogue and a tile scheduler (kernel.cuh), each parameterised by one of these.
#pragma once

namespace machmoe::gpu::hopper {

/// Consumer schedules: ping-pong (the two consumer warpgroups take alternate 128 x kTileN tiles; one's epilogue
/// overlaps the other's mainloop) or cooperative (both share each tile, 64 rows each: twice the N width per WGMMA
/// for the same registers, so fewer operand bytes per FLOP through L2 and shared memory).
enum class Schedule : int { kPingPong, kCooperative };

/// 128 x 128 tiles, ping-pong, 5 stages: 5 x 32 KiB ring + 2 x 16 KiB staging.
struct Tile128x128PingPong {
  static constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
  static constexpr int kStages = 5;
  static constexpr int kEpilogueStageCols = 128;  // columns of an epilogue staging buffer (64 rows)
  static constexpr Schedule kSchedule = Schedule::kPingPong;
  static constexpr int kClusterM = 1;
};

/// 128 x 256 tiles, cooperative, 4 stages: 4 x 48 KiB ring + 2 x 16 KiB staging.
struct Tile128x256Cooperative {
  static constexpr int kTileM = 128, kTileN = 256, kTileK = 64;
  static constexpr int kStages = 4;
  static constexpr int kEpilogueStageCols = 128;
  static constexpr Schedule kSchedule = Schedule::kCooperative;
  static constexpr int kClusterM = 1;
};

/// 128 x 256 tiles, cooperative, 4 stages, and epilogue staging buffers of 64 columns: 4 x 48 KiB ring + 2 x 2 x 8 KiB
/// staging. The dH kernel's wide tile: its epilogue stages H by TMA in two buffers per consumer warpgroup
/// (epilogue_activation_grad.cuh); buffers of 128 columns would have cost the ring a stage (measured slower on every
/// 30B/120B row, docs/BENCHMARKS.md, session 40).
struct Tile128x256CooperativeStagedH : Tile128x256Cooperative {
  static constexpr int kEpilogueStageCols = 64;  // the ring's four stages kept
};

/// The same in clusters of 2 CTAs along M: a cluster takes two M-adjacent tiles of one expert and N tile, and each
/// CTA loads half of the shared weight tile and multicasts it to both (half the weight traffic from L2; measured
/// equal on 1.4B/7B and 4 % faster on 120B (2048,64,4) than without clusters, docs/BENCHMARK_HISTORY.md).
struct Tile128x256CooperativeCluster2 : Tile128x256Cooperative {
  static constexpr int kClusterM = 2;
};

/// The ping-pong tile in clusters of 2 CTAs along M, the weight tile multicast (each CTA loads half of it).
struct Tile128x128PingPongCluster2 : Tile128x128PingPong {
  static constexpr int kClusterM = 2;
};

/// Rows of an epilogue staging buffer that one warp stages and stores (its accumulator fragment's rows; the box height
/// of the dH epilogue's H, dH and A' tensor maps).
inline constexpr int kEpilogueWarpRows = 16;

/// What follows from a tile configuration.
template <class Tile>
struct TileTraits {
  static constexpr bool kCooperative = Tile::kSchedule == Schedule::kCooperative;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);  // + the producer warpgroup
  static_assert(Tile::kTileM == 128, "the consumers cover 128 rows with 64-row WGMMA atoms");
  static_assert(Tile::kTileK == 64, "128 bytes of bf16: one 128-byte-swizzled row per shared-memory line");
  static_assert(Tile::kClusterM == 1 || Tile::kClusterM == 2, "clusters of 1 or 2 CTAs along M");
};

/// Named barrier ids (id 0 is __syncthreads): one per consumer warpgroup for its epilogue's staging buffer, and one
/// of both consumer warpgroups (the weight gradients' epilogue, before it stages into a borrowed ring stage).
enum class NamedBarrier : int { kEpilogueConsumer0 = 1, kEpilogueConsumer1 = 2, kConsumersDone = 3 };
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int epilogue_barrier(int consumer) {
  return static_cast<int>(NamedBarrier::kEpilogueConsumer0) + consumer;
}

}  // namespace machmoe::gpu::hopper
