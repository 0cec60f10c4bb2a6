// Host-side launchers of the GPU runtime's kernels. Plain C++ (no device code), so the orchestration in
// layer_cuda.cpp compiles with the host compiler. Every launcher enqueues work on `stream` and never
// synchronises. Data pointers are of the layer's data dtype (bf16, fp16 or fp32); indices are int32; scores fp32.
//
// Row orders as in include/machmoe/layer.hpp: pair order p, grouped order g.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "machmoe/memory.hpp"
#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"

namespace machmoe::gpu {

/// Rows of one M-tile of the reference grouped GEMM; expert_tiles counts M-tiles per expert in these units.
inline constexpr int kGemmTileM = 64;
/// Columns of one N-tile of the dH kernel: one dS partial per (pair, N-tile) (memory.hpp: ceil(n / 64)).
inline constexpr int kDsTileN = 64;
/// Pairs per tile of the metadata build (one thread per pair; memory.hpp sizes the histograms with it).
inline constexpr int kMetadataTile = static_cast<int>(kMetadataTilePairs);

// ---- router ----------------------------------------------------------------------------------------------------

/// The routing metadata's tile histograms (MetadataArgs::tile_hist: (E, n_tiles) counts of each expert among the
/// pairs of each tile of kMetadataTile pairs, then the tile scan's counter), for the top-K kernel to write as it
/// selects (launch_topk_scores).
struct TopKTileHistograms {
  std::int32_t* hist = nullptr;  // null: not asked for
  std::int64_t n_tiles = 0;      // ceil(T K / kMetadataTile)
};

/// Per token: the top-K experts by logit (ties to the lower index, NaN last), in descending order, and their
/// scores for `variant`. scores/experts are (T, K) in pair order.
/// With `histograms`, the kernel that selects also counts the pairs of each metadata tile and writes every count of
/// the tile histograms (zeros included) and zeroes the scan's counter, so that launch_routing_metadata runs neither
/// its zero-fill nor its histogram kernel (MetadataArgs::histograms_written): where a block's tokens make whole tiles
/// (bf16 rows of at most 128 experts, a multiple of 8, a score over the selection, K in {1, 2, 4, 8}). Returns whether
/// it wrote them; the selections and scores are the same bits either way.
bool launch_topk_scores(DType dt, const void* logits, std::int64_t ld_logits, std::int64_t T, std::int64_t E,
                        std::int64_t K, ScoreVariant variant, float* scores, std::int32_t* experts,
                        cudaStream_t stream, TopKTileHistograms histograms = {});

/// One pair's share of the router's term of dX when d scores / d logits is nonzero only at the token's selections
/// (every score variant but kTopKOfSoftmax): dX[t] += dz * W_r[expert] for each pair of t. 8 bytes, read as one.
struct alignas(8) RouterPairTerm {
  float dz;             // d loss / d logit of the pair's expert (0 for a pair that reads no row)
  std::int32_t expert;  // the pair's expert: its row of W_r
};

/// Whether the router's term of dX can be summed from the pairs (RouterPairTerm) instead of the dense product
/// dlogits W_r: the logit gradient lives at the selections only (MoEProblem::logit_grad_at_selections, the same rule
/// that sizes the pair terms' workspace region), and there is no upstream gradient of the logits (which would fill
/// every element of dlogits).
inline bool router_term_from_pairs(const MoEProblem& p, bool has_grad_logits) {
  return p.logit_grad_at_selections() && !has_grad_logits;
}

/// dlogits (T, E, data dtype, contiguous) = d scores / d logits applied to ds (pair order), plus the upstream
/// grad_logits (T, E, ld_grad; may be null). Top-K routing only. logits (kept) are read for kTopKOfSoftmax.
/// pair_terms (P, pair order; may be null, must be null for kTopKOfSoftmax): each pair's dz and expert as well, in
/// fp32 (dlogits holds the same dz rounded to the data dtype, plus grad_logits).
void launch_router_backward(DType dt, ScoreVariant variant, const float* scores, const float* ds,
                            const std::int32_t* inverse, const std::int32_t* expert_offsets, const void* logits,
                            std::int64_t T, std::int64_t E, std::int64_t K, const void* grad_logits,
                            std::int64_t ld_grad, void* dlogits, RouterPairTerm* pair_terms, cudaStream_t stream);

// ---- routing metadata ------------------------------------------------------------------------------------------

/// The backward's dX~ and the forward's Y in chunks of tokens (memory.hpp, backward_dx_chunks and forward_y_chunks).
/// The plan buffer holds, for C chunks:
///   bounds   C + 1        chunk c's tokens are [bounds[c], bounds[c + 1])
///   offsets  C x (E + 1)  per chunk, the exclusive scan of each expert's rows in it: the chunk's dX~ (Y) rows, grouped
///   tiles    C x (E + 1)  per chunk, the exclusive scan of ceil(rows / kGemmTileM) (the reference GEMM's tiles)
///   shifts   C x E        per chunk and expert, (first grouped row of dH or A) - (first row in the chunk's dX~ or Y)
/// An expert's rows in a chunk are contiguous in grouped order, since tokens ascend within an expert's segment.
struct DxChunkPlan {
  std::int32_t *bounds = nullptr, *offsets = nullptr, *tiles = nullptr, *shifts = nullptr;
  std::int64_t E = 0;
  static DxChunkPlan in(std::int32_t* plan, std::int64_t chunks, std::int64_t E) {
    DxChunkPlan v;
    v.E = E;
    v.bounds = plan;
    v.offsets = v.bounds + chunks + 1;
    v.tiles = v.offsets + chunks * (E + 1);
    v.shifts = v.tiles + chunks * (E + 1);
    return v;
  }
  std::int32_t* chunk_offsets(std::int64_t c) const { return offsets + c * (E + 1); }
  std::int32_t* chunk_tiles(std::int64_t c) const { return tiles + c * (E + 1); }
  std::int32_t* chunk_shifts(std::int64_t c) const { return shifts + c * E; }
};

/// Which kernel places the routing metadata's pairs (MetadataArgs::place).
enum class PlaceKernel { kAuto, kByTile, kSorted };
/// The fewest pairs for which PlaceKernel::kAuto sorts: 96 blocks of the sorted kernel (8 tiles each).
inline constexpr std::int64_t kPlaceSortedMinPairs = 96 * 8 * std::int64_t{kMetadataTile};
struct MetadataArgs {
  std::int64_t T = 0, E = 0, P = 0;        // P: pairs in pair order
  const std::int32_t* pair_expert = nullptr;  // (P); values outside [0, E) are skipped (sentinels)
  const std::int32_t* pair_token = nullptr;   // (P) or null for top-K (token = p / K)
  std::int64_t K = 1;
  std::int32_t* tile_hist = nullptr;       // (E, ceil(P / kMetadataTile)) scratch, then the scan's counter (1)
  bool histograms_written = false;         // tile_hist already holds the histograms and a zero counter (top-K's)
  std::int32_t* expert_counts = nullptr;   // (E) output, may be null
  std::int32_t* expert_offsets = nullptr;  // (E + 1)
  std::int32_t* expert_tiles = nullptr;    // (E + 1): exclusive scan of ceil(count / kGemmTileM)
  std::int32_t* scatter = nullptr;         // (P)
  std::int32_t* inverse = nullptr;         // (P); -1 for skipped pairs
  std::int32_t* gather = nullptr;          // (P)
  std::int32_t* token_offsets = nullptr;   // (T + 1) or null
  // The forward's chunks of tokens (chunks > 1; memory.hpp, forward_y_chunks): the chunk plan and each pair's row in
  // its chunk, as launch_dx_chunk_plan defines them, built from the tile histograms while the metadata is (no search
  // over the grouped rows, no kernels of their own). Taken where E <= kFusedPlanMaxExperts (metadata_built_plan).
  std::int64_t chunks = 0, pairs_per_chunk = 0;
  DxChunkPlan plan;
  std::int32_t* pair_rows = nullptr;  // (P): -1 for pairs routed nowhere
  // The place step's kernel (both write the same bytes): one 256-pair tile a block, or, up to 256 experts, blocks of
  // 2048 pairs sorted by grouped row in shared memory so that scatter and gather are written in runs. kAuto takes
  // the sorted kernel where it was measured faster (place_kernel_sorts); the tests force each.
  PlaceKernel place = PlaceKernel::kAuto;
};
/// The most experts for which launch_routing_metadata builds the chunk plan itself (two E-int histograms of shared
/// memory per block); above it the caller runs launch_dx_chunk_plan.
inline constexpr std::int64_t kFusedPlanMaxExperts = 4096;
inline bool metadata_built_plan(const MetadataArgs& a) { return a.chunks > 1 && a.E <= kFusedPlanMaxExperts; }
/// Whether launch_routing_metadata places the pairs with the kernel sorting blocks of tiles (MetadataArgs::place).
/// kAuto: where E is 128 to 256 and there are at least kPlaceSortedMinPairs pairs (96 blocks), unless
/// MACHMOE_PLACE_BY_TILE=1 (A/B timing). The sorted kernel's gain is its stores, which at E >= 128 the per-tile kernel
/// scatters about two 4-byte entries a sector; its cost is 8x fewer blocks, each about 10 us of latency on an H100.
/// Measured there (session 115): faster on E = 128 with 96 and 160 blocks and E = 256 with 256, slower on E = 64 with
/// 48 blocks; other shapes keep the per-tile kernel until measured.
bool place_kernel_sorts(const MetadataArgs& a);
/// Deterministic metadata without a global sort: per-tile histograms, per-expert scans, in-tile stable ranks; and,
/// where metadata_built_plan(a), the chunk plan and pair rows of the forward's chunks of tokens.
void launch_routing_metadata(const MetadataArgs& a, cudaStream_t stream);
/// expert_tiles from expert_offsets (the backward rebuilds it from what the forward kept).
void launch_expert_tiles(const std::int32_t* expert_offsets, std::int64_t E, std::int32_t* expert_tiles,
                         cudaStream_t stream);

/// Fills the plan of `chunks` chunks of tokens, chunk c holding the tokens whose first pair lies in
/// [c * pairs_per_chunk, (c + 1) * pairs_per_chunk) (the last one every token left), and pair_rows (P_max): each
/// routed pair's row in its chunk's dX~, -1 for pairs routed nowhere (every_pair_routed: there are none, as with
/// top-K). token_offsets null: K pairs per token. Up to kFusedPlanMaxExperts experts one kernel does it all, each
/// chunk's pairs a share of its blocks (plan_chunk_and_pair_rows, chunk_plan.cuh; pair_rows past the last token's
/// pairs, which nothing reads, is not written); beyond, a plan kernel, a -1 fill unless every_pair_routed, and a
/// pair-rows kernel.
void launch_dx_chunk_plan(const std::int32_t* expert_offsets, const std::int32_t* gather,
                          const std::int32_t* scatter, const std::int32_t* inverse,
                          const std::int32_t* token_offsets, std::int64_t K,
                          std::int64_t T, std::int64_t E, std::int64_t P_max, std::int64_t chunks,
                          std::int64_t pairs_per_chunk, const DxChunkPlan& plan, std::int32_t* pair_rows,
                          bool every_pair_routed, cudaStream_t stream);

// ---- aggregation and reductions --------------------------------------------------------------------------------

/// A second sum over the pairs of the gather-sum, added in the same pass: dz_p * weight[expert_p, :] for each pair p
/// that reads a row (the router's term of dX, RouterPairTerm). weight: E x width in the data dtype, row stride ld.
struct GatherRouterTerm {
  const void* weight = nullptr;
  std::int64_t ld = 0;
  const RouterPairTerm* pairs = nullptr;  // pair order; null: no term
};

/// out[t, :] = sum over the pairs p of token t (pair order) of w_p * rows[inverse[p], :] (+ router's term of p,
/// right after p's row), fp32 accumulation, no atomics. weights == null: unweighted. token_offsets == null: pairs of
/// t are t*K .. t*K+K-1.
/// token_range (device, 2 values; null: every token) restricts it to the tokens [token_range[0], token_range[1]),
/// covered by `range_blocks` blocks (the range lives on the device; its length need not be known here).
/// Pairs whose row is outside [0, row_bound) read nothing, and pair offsets are clamped to [0, pair_bound]: caller
/// indices (combine_rows) never leave the buffers.
void launch_gather_sum(DType dt, const void* rows, std::int64_t width, const float* weights,
                       const GatherRouterTerm& router, const std::int32_t* inverse,
                       const std::int32_t* token_offsets, std::int64_t K,
                       std::int64_t T, void* out, std::int64_t ld_out, cudaStream_t stream,
                       const std::int32_t* token_range = nullptr, std::int64_t range_blocks = 0,
                       std::int64_t row_bound = INT64_MAX, std::int64_t pair_bound = INT64_MAX);

/// The gradients of combine_rows (include/machmoe/combine.hpp), one block per token: grad_rows[row_of_pair[p]] =
/// scores[p] * grad_out[t] and grad_scores[p] = <grad_out[t], rows[row_of_pair[p]]> (fp32, a fixed reduction order),
/// either output null when not wanted. Pairs reading a row outside [0, R) get grad_scores 0 and write no row; pair
/// offsets are clamped to [0, P]; with token_offsets, grad_scores of the pairs at and after token_offsets[T] are 0.
void launch_combine_rows_backward(DType dt, const void* grad_out, const void* rows, std::int64_t R, std::int64_t d,
                                  const float* scores, const std::int32_t* row_of_pair,
                                  const std::int32_t* token_offsets, std::int64_t top_k, std::int64_t T,
                                  std::int64_t P, void* grad_rows, float* grad_scores, cudaStream_t stream);

/// ds[p] = sum_tiles ds_partial[p, tile] (fixed order) + (b2 ? <grad_out[t], b2[e]> : 0); 0 for skipped pairs.
void launch_ds_reduce(DType dt, const float* ds_partial, std::int64_t n_tiles, const std::int32_t* inverse,
                      const std::int32_t* gather, const std::int32_t* expert_offsets, std::int64_t E,
                      std::int64_t P, const void* grad_out, std::int64_t ld_grad_out, const void* b2,
                      std::int64_t ld_b2, std::int64_t d, float* ds, cudaStream_t stream);

/// out[e, col_map(c)] = sum over grouped rows g of expert e of w_g * M[row(g), c], fp32, sequential in g.
/// row(g) = gather ? gather[g] : g; w_g = scores ? scores[scatter[g]] : 1; col_map = concatenated-GLU map when
/// glu_concat_n > 0 (c -> (c % 2) * n + c / 2), identity otherwise. out is of out_dt (dt or fp32); with
/// `accumulate` the sum is added to it (in fp32, rounded once) and experts with no rows leave it unchanged.
void launch_segment_column_sum(DType dt, const void* m, std::int64_t ld_m, const std::int32_t* gather,
                               const float* scores, const std::int32_t* scatter,
                               const std::int32_t* expert_offsets, std::int64_t E, std::int64_t cols,
                               std::int64_t glu_concat_n, void* out, std::int64_t ld_out_expert, DType out_dt,
                               bool accumulate, cudaStream_t stream);

// ---- reference grouped GEMMs -----------------------------------------------------------------------------------

/// Per-expert B operand: element (col, k) at ptr + e * expert_stride + col * stride_col + k * stride_k, except on
/// the index named by permute (0: none, 1: col, 2: k), which is an interleaved GLU column of the concatenated layout:
/// index i is row i / 2 of the gate half (i even) or of the up half (i odd), the up half half_stride() elements
/// after the gate half: glu_half_stride where set (any positive distance: halves that lie apart, e.g. torchtitan's
/// w1 and w3), else glu_n rows (the halves joined). The bias of such an operand stays joined: (E, 2n), up column j
/// at n + j.
struct ExpertOperand {
  const void* ptr = nullptr;
  std::int64_t expert_stride = 0, stride_col = 0, stride_k = 0;
  int permute = 0;
  std::int64_t glu_n = 0;
  std::int64_t glu_half_stride = 0;  // 0: glu_n rows
  // Host and device (the reference GEMMs read it in their kernels; cuda_runtime.h defines the qualifiers for g++).
  __host__ __device__ std::int64_t half_stride() const {
    if (glu_half_stride != 0) return glu_half_stride;
    return glu_n * (permute == 2 ? stride_k : stride_col);
  }
};

enum class Epilogue : int {
  kStore,         // out[g, c] = acc (+ bias[e, c])
  kUpActivation,  // acc + b1 -> H (optional store), act -> A
  kActivationGrad,  // dH kernel: acc = dA'; reads H, scores; writes dH, A', dS partials
};

struct VarlenMArgs {
  DType dt = DType::kBF16;
  std::int64_t E = 0, N = 0, K = 0, P_max = 0;
  const std::int32_t* expert_offsets = nullptr;
  const std::int32_t* expert_tiles = nullptr;
  // A: rows g (gathered through a_gather when non-null), element (row, k) at a + row * lda + k.
  const void* a = nullptr;
  std::int64_t lda = 0;
  const std::int32_t* a_gather = nullptr;
  // A contiguous A whose rows do not line up with the output's (the backward's dX~ in chunks of tokens): row g of
  // expert e reads A row g + a_row_shift[e] (device, E values; null: 0). a_rows: rows of A's buffer (0: P_max).
  const std::int32_t* a_row_shift = nullptr;
  std::int64_t a_rows = 0;
  ExpertOperand b;
  Epilogue epilogue = Epilogue::kStore;
  // kStore: out (P, N) ld_out; bias (E, N) optional (column index through b.permute == 1 map).
  void* out = nullptr;
  std::int64_t ld_out = 0;
  const void* bias = nullptr;
  std::int64_t ld_bias = 0;
  // kUpActivation: H -> out (may be null: not stored), A -> act_out (may be null).
  Activation activation = Activation::kSwiGLU;
  float act_alpha = 1.702f, act_limit = 7.0f;  // gptoss_swiglu's parameters (kUpActivation, kActivationGrad)
  void* act_out = nullptr;
  std::int64_t ld_act = 0;
  // kActivationGrad: h_in (P, w1_rows), scores (pair order) via scatter; dH -> out, A' -> act_out.
  const void* h_in = nullptr;
  std::int64_t ld_h = 0;
  const float* scores = nullptr;
  const std::int32_t* scatter = nullptr;
  float* ds_partial = nullptr;  // (P, ceil(N / kDsTileN))
};
/// C[g, col] = sum_k A[g, k] * B_e[col, k] for the grouped rows g of every expert e, then the epilogue.
void launch_varlen_m_gemm(const VarlenMArgs& a, cudaStream_t stream);

struct VarlenKArgs {
  DType dt = DType::kBF16;
  std::int64_t E = 0, M = 0, N = 0;
  const std::int32_t* expert_offsets = nullptr;
  // C_e[m, n] = sum over rows g of expert e of A[rowA(g), m] * B[rowB(g), n].
  const void* a = nullptr;
  std::int64_t lda = 0;
  const std::int32_t* a_gather = nullptr;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  const std::int32_t* b_gather = nullptr;
  // Rows of the contiguous operand's buffer (the one without a gather): an upper bound on expert_offsets[E], the
  // row extent of the Hopper kernel's TMA descriptor for it. 0: unknown (that operand is then copied by cp.async).
  std::int64_t contiguous_rows = 0;
  // out[e * out_expert_stride + map(m) * ld_out + n]; map = concatenated-GLU row map when glu_concat_n > 0, whose
  // up half lies half_stride() elements after its gate half: glu_half_stride where set (halves apart), else
  // glu_concat_n rows (joined).
  void* out = nullptr;
  std::int64_t out_expert_stride = 0, ld_out = 0, glu_concat_n = 0, glu_half_stride = 0;
  __host__ __device__ std::int64_t half_stride() const {
    return glu_half_stride != 0 ? glu_half_stride : glu_concat_n * ld_out;
  }
  DType out_dt = DType::kBF16;
  bool accumulate = false;
};
/// Weight-gradient GEMM, reduction over each expert's rows: out (of out_dt: dt or fp32) = (accumulate ? out : 0) +
/// C_e, the sum in fp32 and rounded once. Experts with no rows get zeros, or keep out unchanged when accumulating.
void launch_varlen_k_gemm(const VarlenKArgs& a, cudaStream_t stream);

}  // namespace machmoe::gpu

namespace machmoe::gpu {

// ---- index checking (include/machmoe/index_checking.hpp) ---------------------------------------------------------

/// What a checked kernel found wrong; the host turns it into the argument name and the expectation.
enum class IndexViolation : std::int32_t {
  kTokenRange = 1,     // routing.token_index[position] = value outside [0, bound)
  kExpertRange = 2,    // routing.expert_index[position] = value outside [0, bound)
  kTokenOrder = 3,     // routing.token_index[position] = value < bound, the token of the pair before it
  kCountNegative = 4,  // expert_counts[position] = value < 0
  kCountTotal = 5,     // expert_counts sum to value instead of bound rows (each count clamped to +-2^40 first)
  kTokenRun = 6,       // routing.token_index[position] = value is the (bound + 1)-th pair of its token, K = bound
};

/// The record a checked kernel writes for the host: in pinned, mapped host memory, so the host reads it without a
/// synchronisation. The winning thread writes the fields, fences (system scope), then sets `ready`.
struct IndexViolationRecord {
  volatile std::int32_t ready;  // 1 once the fields below are complete
  std::int32_t violation;       // IndexViolation
  std::int64_t position, value, bound;
};

/// Per-device status handed to checked kernels; both null (checking off) means the kernels record nothing.
struct IndexCheck {
  std::int32_t* claim = nullptr;             // device memory: 0 until the first violation claims the record
  IndexViolationRecord* record = nullptr;    // device address of the mapped host record
};

/// Caller-supplied triples -> int32 pair arrays that every later kernel can take, whatever the caller passed: pair
/// tokens ascending, in [0, T), and at most K routed pairs per token. A pair is routed (pair_expert = its expert) when
/// its token is in [0, T), its expert in [0, E), its token is not below an earlier valid pair's, and fewer than K pairs
/// before it carry its token; any other pair gets expert -1 and is skipped by every kernel (no host round trip to
/// raise an error on the GPU). Valid routing keeps every routed pair as it was (a skipped pair's token may become an
/// earlier one). `scratch` holds convert_pairs_scratch_entries(P) int32 and is free again when the launches are done.
/// With `check` set, a pair out of range, a token smaller than its predecessor, or more than K pairs of one token, is
/// also recorded (the first to claim the status; which of several concurrent threads that is, is not specified).
void launch_convert_pairs(const void* token, DType token_dt, const void* expert, DType expert_dt, std::int64_t P,
                          std::int64_t T, std::int64_t E, std::int64_t K, std::int32_t* pair_token,
                          std::int32_t* pair_expert, std::int32_t* scratch, const IndexCheck& check,
                          cudaStream_t stream);
std::int64_t convert_pairs_scratch_entries(std::int64_t P);

/// expert_index[r] (rows, int32 or int64) = the expert of grouped row r from per-expert row counts (E, int32 or int64):
/// the e with sum(counts[0..e)) <= r < sum(counts[0..e]), or E when r is past the total. Every row is written, and
/// only counts[0..E) are read, whatever the counts hold (negative counts give unspecified experts in [0, E]). With
/// `check` set, a negative count or a total other than rows is recorded.
void launch_grouped_expert_index(const void* counts, DType counts_dt, std::int64_t E, void* expert_index,
                                 DType index_dt, std::int64_t rows, const IndexCheck& check, cudaStream_t stream);

}  // namespace machmoe::gpu

namespace machmoe::gpu {

// ---- token rounding (docs/SPEC.md §5) ------------------------------------------------------------------------------------

/// Maximum K of token rounding on the GPU (the public checks refuse larger K on CUDA tensors).
inline constexpr int kTokenRoundingMaxK = 64;

/// One token's top-K selection as token rounding's keys kernel finds it, saved for the router backward
/// (SavedLayout::token_selection): the K-th selected rank key (zero-extended where the key has 32 bits), the top
/// selected value and the selection's sum of exp(x - top), the row's max and sum of exp(x - max). The backward
/// derives every choice, TC score and probability from these bit for bit as the forward did.
struct TokenSelectionStats {
  std::uint64_t kth = 0;
  float first = 0.0f, sum_k = 0.0f, max = 0.0f, sum = 0.0f;
};
static_assert(sizeof(TokenSelectionStats) == kTokenSelectionStatsBytes && alignof(TokenSelectionStats) == 8,
              "the saved region's bytes per token");

/// Token rounding and its whole routing metadata (token_rounding_kernels.cu): three kernels after one memset; no
/// routing-metadata launch follows it. Pair order is (token, expert) ascending; grouped order is by expert, tokens
/// ascending, as launch_routing_metadata would build it from the same pairs.
struct TokenRoundingArgs {
  DType dt = DType::kBF16;
  std::int64_t T = 0, E = 0, K = 0, tile_m = 128, P_max = 0;
  ScoreVariant variant = ScoreVariant::kSoftmaxOverTopK;
  RoundingRule rule = RoundingRule::kNearest;
  const void* logits = nullptr;  // (T, E), row stride ld_logits
  std::int64_t ld_logits = 0;
  // scratch (ForwardWorkspaceLayout::tr_*)
  std::uint32_t* keys = nullptr;            // (T, E), only for E > kTokenRoundingRegisterExperts (else unused)
  std::uint32_t* keys_by_expert = nullptr;  // (E, T)
  std::uint32_t* thresholds = nullptr;      // (E, 2)
  std::uint32_t* bounds = nullptr;          // (E, ceil(T / 32), 4): per block of 32 tokens, largest unchosen (after
                                            // the select: the first kept token's grouped row) and smallest chosen
                                            // key, the chosen and the kept tokens' masks (16-byte aligned)
  float* row_scores = nullptr;              // (P_max): the score of each grouped row's pair
  void* counters = nullptr;                 // (TokenRoundingCounters::of(T, E).words int32) zeroed here
  std::size_t counters_bytes = 0;
  // outputs
  std::int32_t* expert_counts = nullptr;   // (E) kept pairs per expert, may be null
  std::int32_t* expert_offsets = nullptr;  // (E + 1)
  std::int32_t* expert_tiles = nullptr;    // (E + 1): exclusive scan of ceil(count / kGemmTileM)
  std::int32_t* scatter = nullptr;         // (P_max) grouped row -> pair, the first expert_offsets[E] written
  std::int32_t* inverse = nullptr;         // (P_max) pair -> grouped row; -1 past the routed pairs
  std::int32_t* gather = nullptr;          // (P_max) grouped row -> token, the first expert_offsets[E] written
  std::int32_t* token_offsets = nullptr;   // (T + 1)
  float* scores = nullptr;                 // (P_max) pair order: TC score, or the softmax probability if padded; 0 past
  TokenSelectionStats* selection = nullptr;  // (T) each token's selection, for the backward (8-byte aligned; required)
  void* logits_copy = nullptr;  // (T, E) contiguous, may be null: the logits copied for the backward as they are read
  // The forward's chunks of tokens (chunks > 1; memory.hpp, forward_y_chunks): the chunk plan and each routed pair's
  // row in its chunk, as launch_dx_chunk_plan defines them (pair_rows past the routed pairs is not written: nothing
  // reads it), built after the emit from the select's per-block kept masks and first rows (no search over the grouped
  // rows, one kernel where launch_dx_chunk_plan takes two and a fill). Taken where E <= kFusedPlanMaxExperts
  // (token_rounding_built_plan); otherwise the caller runs launch_dx_chunk_plan.
  std::int64_t chunks = 0, pairs_per_chunk = 0;
  DxChunkPlan plan;
  std::int32_t* pair_rows = nullptr;  // (P_max)
};
inline bool token_rounding_built_plan(const TokenRoundingArgs& a) {
  return a.chunks > 1 && a.E <= kFusedPlanMaxExperts && a.pair_rows != nullptr;
}
void launch_token_rounding(const TokenRoundingArgs& a, cudaStream_t stream);

/// dlogits (T, E) of token rounding: the token-choice scores' backward (from the kept logits and each token's saved
/// selection) plus the full-softmax backward of padded pairs, plus the upstream grad_logits.
void launch_token_rounding_backward(DType dt, ScoreVariant variant, const void* logits, std::int64_t T,
                                    std::int64_t E, const TokenSelectionStats* selection, const float* ds,
                                    const std::int32_t* inverse, const std::int32_t* expert_offsets,
                                    const std::int32_t* token_offsets, const void* grad_logits, std::int64_t ld_grad,
                                    void* dlogits, cudaStream_t stream);

}  // namespace machmoe::gpu
