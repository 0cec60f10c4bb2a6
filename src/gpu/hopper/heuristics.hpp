// Tile heuristics of the Hopper kernels as pure functions of the problem shape (no device query, no environment):
// testable on the CPU. The overrides (environment variables, test switches) live in dispatch.cpp and reach these
// functions as arguments.
#pragma once

#include <cstdint>
#include <string>

#include "gpu/hopper/tile_config.hpp"

namespace machmoe::gpu::hopper {

enum class KernelFamily : int { kUpProjection, kDownProjection, kDxExpanded, kDhKernel };

struct GemmShape {
  KernelFamily family = KernelFamily::kUpProjection;
  std::int64_t N = 0;  // output columns
  std::int64_t K = 0;  // reduction length
  // Routed rows per expert on average (the rows reserved over E; 0: unknown). The counts themselves stay on the
  // device: the host chooses from the shape.
  std::int64_t rows_per_expert = 0;
  // The device's peak memory bandwidth in GB/s (memory clock x bus width; 0: unknown), for the rules that differ
  // between an H100 (3.35 TB/s) and an H200 (4.8 TB/s).
  std::int64_t memory_gbps = 0;
};

/// Forced choices (0: the heuristic decides).
struct TileOverrides {
  int tile_n = 0;    // 128 or 256
  int raster_m = 0;  // M-tiles per rasterisation group
  int cluster_m = 0;  // dX~ only: 1 or 2 CTAs per cluster along M
  int wgrad_m_group = 0;  // weight gradients only: m-tiles of one (expert, n-tile) per CTA run (1: none grouped)
};

struct TileChoice {
  int tile_n = 128;  // 128: Tile128x128PingPong; 256: the 128 x 256 cooperative tile (with clusters of 2 for up)
  int raster_m = 1;  // 1: along N
  int cluster_m = 1;  // dX~: 2 runs CTA pairs along M that share (multicast) the weight tile; the up-projection's
                      // wide tile always runs in pairs (Tile128x256CooperativeCluster2), the other families never
  int wgrad_m_group = 1;  // weight gradients: at most this many m-tiles of one (expert, n-tile) back to back on a CTA
                          // (the dispatcher takes the largest divisor of the m-tile count up to it)
};

/// The narrowest N tile.
inline constexpr int kMinTileN = 128;
/// The granule of every extent the kernels take (N, K; M and N of the weight gradients): 8 bf16 = 16 bytes, the
/// unit of cp.async, of TMA's global strides and of the predicated stores. Any multiple of it runs: tiles that hang
/// past N are edge tiles (loads zero-filled, stores clipped), a partial last k-block is zero-filled past K.
inline constexpr int kExtentGranule = 8;

/// Tiles of `extent` columns at `tile` per tile (ceil-division: the last may be an edge tile).
constexpr std::int64_t tiles_of(std::int64_t extent, std::int64_t tile) { return (extent + tile - 1) / tile; }

/// Why the varlen-M kernels cannot take a GEMM of N output columns and reduction length K ("" when they can):
/// N and K positive multiples of kExtentGranule, and for a GLU up-projection (glu_up) N / 2 = n one as well (A's
/// rows are n wide). Pure: the dispatcher adds the dtype, device, pointer and stride checks.
std::string varlen_m_shape_unsupported_reason(std::int64_t N, std::int64_t K, bool glu_up);
/// The same for a weight-gradient GEMM's output extents M x N.
std::string wgrad_shape_unsupported_reason(std::int64_t M, std::int64_t N);

/// Columns of padding when N is covered by tiles of `tile` columns.
constexpr std::int64_t padded_columns(std::int64_t N, std::int64_t tile) { return tiles_of(N, tile) * tile - N; }

/// The tile and rasterisation for a shape the kernels take (N a multiple of kExtentGranule). Measured on an H200
/// (docs/BENCHMARK_HISTORY.md; docs/SPEC.md §6.2 was the starting point): the 128 x 256 cooperative tile halves the
/// operand bytes per FLOP through L2 and shared memory, which the gathered up-projection needs (7B-256: 614 TFLOP/s
/// against 515 with 128 x 128 ping-pong); for the down-projection it measured equal (n >= 512) or 2-4 % faster
/// (n = 256) at the time; since session 60 the down-projection and dX~ take the ping-pong tile where d >= 4096 and K
/// is short (kContiguousPingPong* below). 128 x 128 ping-pong also serves N that is a multiple of 128 but not of 256
/// (and a forced 128).
/// Rasterisation: the families whose A arrives contiguous by TMA run in groups of kContiguousRasterM M-tiles (dX~
/// always, the down-projection from K = kDownRasterMinK), the others along N (raster_m = 1).
/// The dH kernel takes the ping-pong tile except where d >= kDhWideMinK, n >= kDhWideMinN (a multiple of 256) and
/// the experts have at least kDhWideMinRowsPerExpert routed rows on average: its epilogue (H read, activation
/// gradient, A' and dS) is long, and the ping-pong schedule hides one warpgroup's behind the other's mainloop. The
/// cooperative tile's mainloop is the faster one (H100, session 40, the epilogue switched off: 2.88 against 3.88 ms
/// on 120B (2048,64,4), 0.247 against 0.311 on 7B (256,128,8); cuBLAS 2.96 and 0.31), but its epilogue runs with the
/// tensor cores idle. With H staged by TMA in both (the wide tile's ring keeps its four stages with 8 KiB buffers of
/// 64 columns: Tile128x256CooperativeStagedH), forced tiles, H100 (docs/BENCHMARKS.md, sessions 40 and 41): the wide
/// tile 4.06-4.12 against 4.36-4.73 ms on 120B (2048,64,4); 4.01-4.11 against 4.07-4.21 on 120B (1024,128,8) in seven
/// rounds of three calls (2-3.5 % in session 41's five); 2.00-2.17 against 2.05-2.24 on 30B (1024,64,4) and 1.07-1.10
/// against 1.05-1.16 on (16384,4096,1024,64,4) (1024 rows per expert); but 1.64-1.71 against 1.41-1.44 on
/// (16384,4096,1024,256,4), where an expert's 256 rows make two M-tiles and the wide tile half as many tiles as the
/// square one for 132 SMs; slower at d <= 2880 (7B (256,128,8): 0.48 against 0.44; gpt-oss's d = n = 2880: 2.51-2.56
/// against 2.40), and on an H200 after sessions 64 and 65 sped up the epilogue (session 91, the six 1.4B and 7B rows,
/// two rounds: the dH stage 7-12 % slower on each row's means, 0.46-0.47 against 0.41-0.42 ms at d = 768, 0.40-0.42
/// against 0.37-0.39 at 1536). At n = 256 and 512 with d = 4096 (30B (256,256,16), (512,128,8), 120B (512,256,16))
/// it measured equal on the H100 (session 41) but faster on the H200 (session 63, the dH kernel alone forced, three rounds): dH
/// 2.18-2.24 against 2.28-2.29 ms on the 30B rows, 4.43 against 4.52-4.54 on 120B, the layer's backward 0.5-1.2 %
/// faster in each of the nine pairs (ncu, one launch at the unlocked clock: 1.88 against 1.97, 1.79 against 1.91, 3.58
/// against 3.85 ms), so kDhWideMinN is 256 since.
/// N that is no multiple of 256 (edge tiles, or a multiple of 128 only): the down-projection and dX~ take the tile
/// that pads the fewest columns, the wide one on a tie (N = 256 q + r: 256 iff
/// r > 128, i.e. ceil(N / 128) even; N = 2880 = 11 x 256 + 64 takes 128, 2944 columns where 256 would make 3072).
/// Measured at gpt-oss's d = n = 2880 on an H200 (forced tiles, docs/BENCHMARKS.md, session 23): for them the wide
/// tile was 4 % slower (down) or equal (dX~). The up-projection, whose gathered A the wide tile reads half as
/// often per FLOP, takes the wide tile while its padded width is at most kUpProjectionWidePercent % of the square
/// one's: at N = 2n = 5760 (5888 against 5760 columns, 102 %) it was 7-10 % faster; where N is a multiple of 128
/// only (N = 384: 133 %) the square tile stays. A forced tile (overrides.tile_n = 128 or 256) is honoured for every N.
TileChoice choose_tiles(const GemmShape& shape, const TileOverrides& overrides);

/// The dH kernel's wide tile from this reduction length d, this width n and this many routed rows per expert on
/// average (choose_tiles above).
inline constexpr std::int64_t kDhWideMinK = 4096;
inline constexpr std::int64_t kDhWideMinN = 256;
inline constexpr std::int64_t kDhWideMinRowsPerExpert = 1024;

/// The down-projection (K = n) and dX~ (K = 2n for GLU) take the ping-pong tile where the output is d >=
/// kContiguousPingPongMinN wide and K is at most kDownPingPongMaxK (down) or kDxPingPongMaxK (dX~): there a tile's
/// mainloop is a few k-blocks and its epilogue (a 128 x 256 bf16 tile written by TMA) runs with the tensor cores idle
/// on the cooperative tile, while the ping-pong tile hides one warpgroup's epilogue behind the other's mainloop.
/// Measured on an H200 (docs/BENCHMARKS.md, session 60: both families forced together, two rounds, alternating, every
/// main row): the layer's backward 1.4 and 2.0 % faster on 30B (256,256,16), 2.8 and 4.2 % on 120B (512,256,16) (its
/// forward 1.4 and 2.4 %), level to 1.8 % faster on 30B (512,128,8), whose experts have 120B (512,256,16)'s shapes. At
/// n >= 1024 the layer was no faster (120B (2048,64,4): backward 2.5 % slower in both rounds), and at d = 768 and 1536
/// level or up to 1.8 % slower, although there too the two stages were faster against the stages the change does not
/// touch (the down-projection 1.5-10 % on every row), so the wide tile stays there.
/// dX~ at K = 2n = 1024 (n = 512: 30B (512,128,8), 120B (512,256,16)) takes the ping-pong tile only on a device of
/// at least kDxPingPongFastMemoryGbps: on an H100 (3.35 TB/s; docs/BENCHMARKS.md, session 99, the tiles forced, order
/// A B B A) its dX~ stage took 10.16-10.31 ms on 120B (512,256,16) against 7.22-7.41 on the wide tile (the backward
/// 31.7-32.1 against 29.2 ms) and 5.11-5.16 against 4.29 on 30B (512,128,8), where the H200 had it 5-11 % faster than
/// the wide tile (session 60). Unknown bandwidth: the wide tile (what the H100 needs; the H200 gave up ~1.5 % of
/// those backwards).
inline constexpr std::int64_t kContiguousPingPongMinN = 4096;
inline constexpr std::int64_t kDownPingPongMaxK = 512;
inline constexpr std::int64_t kDxPingPongMaxK = 1024;
inline constexpr std::int64_t kDxPingPongSlowMemoryMaxK = 512;
inline constexpr std::int64_t kDxPingPongFastMemoryGbps = 4000;

/// The up-projection's and the weight gradients' limit on the wide tile's padded width, in % of the square tile's.
inline constexpr std::int64_t kUpProjectionWidePercent = 110;
inline constexpr std::int64_t kWgradWidePercent = 125;

/// dX~ runs in 2-CTA clusters along M (the pair shares W1's tile by multicast, each CTA loading half of it) from this
/// reduction length K = 2n (GLU) on. Measured on an H100 (docs/BENCHMARKS.md, session 28, two rounds, before dX~ ran in
/// groups of M-tiles): where K is long every tile streams K x kTileN of W1, and the pairs halve that traffic: the
/// backward 2.3-3.0 % faster on gpt-oss-20b (K = 5760), 2.6-7.1 % on gpt-oss-120b, 2.9-3.3 % on 120B (2048,64,4)
/// (K = 4096); where K = 512 (30B (256,256,16), 7B (256,128,8)) the pairs' lockstep cost more than they saved. Since
/// the groups of M-tiles (kContiguousRasterM: the CTAs that run together already share each weight tile in L2), an
/// H100 (session 35, forced clusters, stage times, three runs) measured the pairs slower at K = 4096 (120B
/// (2048,64,4): dX~ 6.44-6.56 ms alone against 6.77-6.98 in pairs) and at K = 2048 (120B (1024,128,8): 6.72 against
/// 7.16-7.20; (16384,4096,1024,256,4): 2.07 against 2.66), and still faster at K = 5760 (gpt-oss-20b: 3.86-3.92
/// against 4.65-4.86 alone; gpt-oss-120b 4.36-4.43 against 4.36-4.61): pairs from K = 5120 on.
inline constexpr std::int64_t kDxClusterMinK = 5120;

/// M-tiles per rasterisation group of the down-projection and dX~ (A contiguous by TMA, the weight tile by TMA): the
/// group's M-tiles take one N-tile after the other, so the CTAs that run together read the same weight tile. Where an
/// expert has few M-tiles the along-N order had M-adjacent tiles of one weight tile run far apart, and the weights came
/// from HBM once per M-tile: on an H100 (session 32, two rounds, docs/BENCHMARKS.md) groups of 4 took dX~ from
/// 3.39-3.43 to 1.98 ms and the down-projection from 1.68-1.70 to 1.07 ms on (16384,4096,1024,256,4) (about 256 rows
/// per expert), dX~ on 120B (1024,128,8) from 8.26-8.70 to 6.52-6.63 ms and the down-projection on 120B (2048,64,4)
/// from 3.73 to 3.18-3.19 ms and on gpt-oss-120b from 2.49-2.52 to 2.05-2.07 ms; within 1-2 % elsewhere (the 1.4B
/// and 7B rows, where d is short). The gathered families keep the along-N order: groups of 4 cost the up-projection
/// 5 % and the dH kernel up to 14 % (1.4B (256,128,8)) there.
inline constexpr int kContiguousRasterM = 4;
/// The down-projection's groups start at this reduction length K = n: below it a weight tile is small (K x 256 x 2 =
/// 128 KiB at n = 256) and the groups measured no faster on the main rows and 17 % slower on (16384,1536,256,512,8)
/// (0.388-0.392 against 0.451-0.457 ms, H100, session 32); dX~ (K = 2n) gained 1-4 % there and keeps them.
inline constexpr std::int64_t kDownRasterMinK = 512;

/// A weight-gradient GEMM (varlen-K): per expert an M x N output, the reduction over the expert's grouped rows.
struct WgradShape {
  std::int64_t E = 0, M = 0, N = 0;  // M, N: multiples of kExtentGranule (edge tiles past them)
  int sm_count = 132;                // CTAs of the persistent grid
  // Grouped rows per expert on average (the rows reserved over E; 0: unknown). The counts stay on the device.
  std::int64_t rows_per_expert = 0;
};

/// The tile of a weight-gradient GEMM: 128 x 256 cooperative (tile_n 256) when N is a multiple of 256 and that tile
/// still gives every SM a tile, else 128 x 128 ping-pong. Why (measured on the H200, docs/BENCHMARK_HISTORY.md:
/// 128 x 128 is 30-45 % slower on every main configuration): both operands come from shared memory and every k-block of 64 rows
/// brings (128 + kTileN) x 64 bf16, so the wide tile needs 85 FLOP per byte of L2 and shared-memory traffic against 64
/// for the square one (the forward measured the same trade: 614 against 515 TFLOP/s gathered). Its cost is an epilogue
/// that no other warpgroup hides, small next to the 24 k-blocks of a 7B tile (1536 rows per expert). The square tile,
/// ping-pong, serves N = 128 mod 256 and shapes with fewer wide tiles than SMs (more, smaller tiles fill the grid).
/// N that is no multiple of 256: the wide tile while its padded width is at most kWgradWidePercent % of the square
/// one's, and then only with enough wide tiles (ceil-divided) for the grid. Measured at gpt-oss's shapes on an H200
/// (session 23, forced tiles): at N = 2880 or 2944 (3072 columns against 2944, 104 %) the wide tile took dW2 and dW1
/// 16-33 % faster than the square one; N = 384 (133 %) keeps the square tile.
/// overrides.tile_n = 128 forces the square tile; 256 the wide one (for every N).
/// Groups of m-tiles (wgrad_m_group): kWgradMGroup where the experts average at most one k-block more than the
/// tile's ring holds (rows_per_expert <= (stages + 1) x 64: 320 rows on the wide tile's 4 stages, 384 on the square
/// one's 5), else 1. There an expert's segment is a handful of k-blocks, every tile streams as many bytes of B as of
/// A per FLOP, and a CTA's tiles of one group take B from the ring instead (mainloop_varlen_k.cuh). Where the
/// segments are long the grouping would only move the m-tiles that share B in L2 from neighbouring CTAs onto one.
/// overrides.wgrad_m_group > 0 forces the group (1: none).
TileChoice choose_wgrad_tiles(const WgradShape& shape, const TileOverrides& overrides);

/// The weight gradients' group of m-tiles where the segments are short (choose_wgrad_tiles).
inline constexpr int kWgradMGroup = 4;
/// Pipeline stages of the weight gradients' tile of this N width.
constexpr int wgrad_stages(int tile_n) {
  return tile_n == 256 ? Tile128x256Cooperative::kStages : Tile128x128PingPong::kStages;
}

}  // namespace machmoe::gpu::hopper
