// Parameters of the pieces of a Hopper kernel (kernel.cuh): each piece owns its own struct, and a kernel's
// parameters are the three side by side. Host and device code share this header; it holds no device code.
//
// A varlen-M kernel computes, for every expert e and every row g of its grouped segment [off[e], off[e+1]),
//   C[g, c] = sum_k A[row(g), k] * B_e[c, k]        (fp32 accumulation on the tensor cores)
// and hands the fp32 tile to its epilogue. row(g) = gather[g] (a gathered A: rows of X picked by the routing) or g
// (a contiguous A loaded by TMA).
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; descriptors are encoded through the runtime's driver entry point)

#include <cstdint>

namespace machmoe::gpu::hopper {

/// The persistent tile scheduler over variable-length expert segments (tile_scheduler.cuh).
struct VarlenMSchedulerParams {
  int E = 0;         // experts
  int n_tiles = 0;   // ceil(N / kTileN): the last N-tile may hang past N (edge tile)
  int raster_m = 1;  // M-tiles per rasterisation group (1: along N)
  const std::int32_t* expert_offsets = nullptr;  // (E + 1), device
};

/// The varlen-M mainloop (mainloop_varlen_m.cuh).
struct MainloopVarlenMParams {
  // Reduction length, a multiple of 8 (16-byte rows). The last k-block may be partial: the tensor maps carry the
  // true K, so TMA zero-fills past it, and the gather's cp.async zero-fills the 16-byte chunks at k >= K.
  int K = 0;
  // A operand. Gathered: rows of `a` (row stride lda elements) picked by `gather`. Contiguous: TMA through tma_a.
  const void* a = nullptr;
  std::int64_t lda = 0;
  const std::int32_t* gather = nullptr;
  CUtensorMap tma_a;  // 2D (K, rows), box (64, 128), 128-byte swizzle; unused when gathered
  // Contiguous A only: grouped row g of expert e is A row g + a_row_shift[e] (null: g). The backward's dX~ in chunks
  // of tokens reads each expert's chunk rows of dH where they lie and writes them packed.
  const std::int32_t* a_row_shift = nullptr;
  // B operand (weights), K-major: 3D (K, rows per expert, E), box (64, kTileN / 2, 1); in the concatenated GLU
  // layout 4D (K, n, 2, E), box (64, kTileN / 2, 1, 1): gate half 0, up half 1, which may lie apart (two
  // allocations). A tile's kTileN rows are loaded as two halves, so the concatenated layout lands interleaved in
  // shared memory without a copy. The map's extents are the true K and N (n): rows past them and k past K arrive
  // as zeros (an edge tile's padded columns). MN-major (the backward's dX~): 4D (N, half, j, E), box (64, 2, 32, 1).
  CUtensorMap tma_b;
  bool b_concatenated = false;
  int glu_n = 0;  // n: in the concatenated layout, the first up column of the bias
};

/// Output written by an epilogue through the swizzled staging buffer: TMA store of whole 64-row blocks
/// (2D (columns, rows) map, box (64, 64), 128-byte swizzle), predicated 16-byte stores for the block cut by the
/// end of an expert's segment. The dH epilogue's outputs (dh, a_prime) go warp by warp instead: box (64, 16), a
/// warp's 16 rows by TMA, a warp's rows cut by the segment's end by predicated stores.
struct EpilogueOutput {
  void* ptr = nullptr;  // bf16, row stride ld; null: not stored
  std::int64_t ld = 0;
  // Valid columns (a multiple of 8): an edge tile's columns at or past it are never written (the TMA store clips
  // at the map's extent, which is `cols`; the predicated 16-byte stores skip those chunks).
  std::int64_t cols = 0;
  CUtensorMap tma;
};

/// Bias of the epilogues: (E, N) in the weights' own row order (concatenated GLU: gate rows then up rows).
struct EpilogueBias {
  const void* ptr = nullptr;  // bf16; null: no bias
  std::int64_t ld = 0;
};

/// Y = acc (+ b2) (epilogue_store.cuh): the down-projection.
struct EpilogueStoreParams {
  EpilogueOutput out;
  EpilogueBias bias;
  int N = 0;  // output columns (bias columns read only below it)
};

/// H = acc (+ b1), A = act(H) from the same fp32 values (epilogue_activation.cuh): the up-projection.
struct EpilogueActivationParams {
  EpilogueOutput h;  // always gate/up-interleaved; ptr null in inference (H not kept)
  EpilogueOutput a;  // A
  EpilogueBias bias;
  // Concatenated GLU weights: a tile holds kTileN / 2 gate columns then the matching up columns (the mainloop
  // loads them so); H is still stored interleaved. glu_n: n, the first up column of the (E, 2n) bias.
  bool concatenated = false;
  int glu_n = 0;
  int N = 0;  // accumulator columns (2n or n): an edge tile reads the bias only below it
  float act_alpha = 1.702f, act_limit = 7.0f;  // gptoss_swiglu's parameters; the other activations ignore them
};

/// dH = act'(H) (s dA'), A' = s act(H), dS partials (epilogue_activation_grad.cuh): the backward's dH kernel.
struct EpilogueActivationGradParams {
  EpilogueOutput dh;       // (rows, w1_rows), gate/up-interleaved like H
  EpilogueOutput a_prime;  // (rows, n)
  // H (bf16, interleaved, grouped row order) by TMA into the staging buffers: 2D (dH columns, rows) map, box
  // (64, 16) (a warp's rows), 128-byte swizzle, the layout of the staging buffer, so dH is computed in place and
  // leaves by TMA store. dh and a_prime's maps have the same 16-row box: each warp stores its own rows.
  CUtensorMap tma_h;
  const float* scores = nullptr;          // pair order
  const std::int32_t* scatter = nullptr;  // grouped row -> pair
  float* ds_partial = nullptr;            // (pairs, ds_tiles): <dA', A> over each 64-column block of A
  int ds_tiles = 0;                       // ceil(n / 64): blocks at or past it (an edge tile's) are not written
  int N = 0;                              // n: A columns; an edge tile reads H only below it
  float act_alpha = 1.702f, act_limit = 7.0f;  // gptoss_swiglu's parameters; the other activations ignore them
};

// ---- varlen-K (weight gradients) ------------------------------------------------------------------------------
//
// A varlen-K kernel computes, for every expert e, the whole (M, N) output
//   C_e[m, n] = sum over grouped rows g in [off[e], off[e+1]) of A[rowA(g), m] * B[rowB(g), n]
// (fp32 accumulation), rowA(g) = a_gather ? a_gather[g] : g and likewise for B: both operands are MN-major (a row g
// holds the m or n index contiguously). The reduction length is each expert's segment, read on the device.

/// The persistent tile scheduler over (expert, m-tile, n-tile) (tile_scheduler_varlen_k.cuh).
struct VarlenKSchedulerParams {
  int E = 0;
  int m_tiles = 0;  // ceil(M / kTileM)
  int n_tiles = 0;  // ceil(N / kTileN)
  // M-tiles of one (expert, n-tile) that a CTA takes back to back (a divisor of m_tiles; 1: the m-tiles of an n-tile
  // spread over neighbouring CTAs). Above 1, the mainloop keeps the shared B operand's k-blocks in the ring for the
  // group's later tiles where an expert's k-blocks divide the ring (mainloop_varlen_k.cuh).
  int m_group = 1;
  const std::int32_t* expert_offsets = nullptr;  // (E + 1), device
};

/// The varlen-K mainloop (mainloop_varlen_k.cuh): the gathered operand copied by cp.async, the contiguous one by
/// TMA for whole k-blocks and cp.async for an expert's partial last block; rows past the segment zero-filled.
struct MainloopVarlenKParams {
  int M = 0, N = 0;  // output extents (multiples of 8): columns of A past M and of B past N are zero-filled
  const void* a = nullptr;  // bf16, row stride lda elements; row rowA(g) holds m = 0 .. M-1
  std::int64_t lda = 0;
  const std::int32_t* a_gather = nullptr;  // null: contiguous rows g
  const void* b = nullptr;  // bf16, row stride ldb; row rowB(g) holds n = 0 .. N-1
  std::int64_t ldb = 0;
  const std::int32_t* b_gather = nullptr;
  // The contiguous operand's whole k-blocks by TMA: 2D (M or N, rows of its buffer), box (64, 64), 128-byte swizzle,
  // columns past M or N zero-filled. Unset (contiguous_tma false): cp.async for every block, as for the gathered one.
  CUtensorMap tma_contiguous;
  bool contiguous_tma = false;
  // The epilogue stages into each tile's last stage (EpilogueWgradParams::borrow_stage): B is then never kept on
  // the ring for a later tile (half of the stage's B holds staged output).
  bool keep_b_allowed = true;
};

/// The weight-gradient epilogue (epilogue_wgrad.cuh): out[e * out_expert_stride + m * ld_out + n] = C (or += C);
/// where glu_concat_n > 0 (the concatenated GLU W1) row m is row m / 2 of half m % 2 instead, at
/// (m % 2) * glu_half_stride + (m / 2) * ld_out (the halves joined: glu_half_stride = glu_concat_n * ld_out).
struct EpilogueWgradParams {
  void* out = nullptr;  // bf16 or fp32 (out_fp32)
  std::int64_t out_expert_stride = 0, ld_out = 0;  // elements
  std::int64_t glu_concat_n = 0, glu_half_stride = 0;
  int M = 0, N = 0;
  bool out_fp32 = false;
  bool accumulate = false;  // read-modify-write out = out + C; an expert with no rows leaves its tiles untouched
  // A bf16 overwrite leaves by TMA store (asynchronous: the consumers go on to the next tile's mainloop while the
  // copy engine writes), 128-byte swizzle: 3D map (N, M, E), box (64, 64, 1); with the concatenated row map 4D
  // (N, n, 2, E), box (64, 32, 1, 1), a 64-row block's gate rows and up rows in two boxes.
  bool tma_store = false;
  CUtensorMap tma_out;
  // (Cooperative tile, TMA path) the epilogue also stages into the tile's last ring stage, which the mainloop holds
  // until the stores have read it: a warpgroup's whole 64 x 256 share in one round.
  bool borrow_stage = false;
};

template <class MainloopParams, class EpilogueParams, class SchedulerParams = VarlenMSchedulerParams>
struct KernelParams {
  MainloopParams mainloop;
  EpilogueParams epilogue;
  SchedulerParams scheduler;
};

}  // namespace machmoe::gpu::hopper
