// Memory accounting: the bytes the forward keeps for the backward, and the workspace forward and backward need.
// These are layouts, not estimates: the forward writes exactly these regions of the caller's `saved` buffer and
// the backward reads nothing else, so the accounting cannot drift from what is really kept.
// Every function below that takes a MoEProblem validates it first (validate_problem, under the function's own name),
// and the data dtype where it takes one (bf16, fp16, fp32 or fp64), throwing machmoe::Error: a problem the layer
// rejects has no size.
#pragma once

#include <cstddef>
#include <cstdint>

#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"

namespace machmoe {

/// Regions start at multiples of this many bytes (TMA and 16-byte vector loads want aligned bases).
inline constexpr std::size_t kRegionAlignment = 256;
/// The caller's buffers (saved, workspace, deferred) must start at a multiple of this many bytes: the regions above
/// are aligned relative to a buffer's start, and the GPU kernels access them in 16-byte vectors and through TMA.
/// cudaMalloc, PyTorch's allocator and operator new all return such pointers; the entry points reject others.
inline constexpr std::size_t kBufferAlignment = 16;

struct BufferRegion {
  std::size_t offset = 0;  // from the buffer's base
  std::size_t bytes = 0;   // 0: region absent in this configuration
  bool present() const { return bytes != 0; }
};

/// Dtype of router scores and their gradients: fp32, or fp64 when the layer's data are fp64.
DType score_dtype(DType data_dtype);

/// Bytes per token of the saved token_selection region: a 64-bit rank key and four fp32 (gpu/kernels.hpp's
/// TokenSelectionStats).
inline constexpr std::size_t kTokenSelectionStatsBytes = 24;

/// Layout of the buffer the forward fills for the backward ("saved"). Pair count P = problem.max_pairs().
///   h              P x w1_rows   data dtype   pre-activation H, grouped order (kPreActivation only)
///   router_logits  T x E         data dtype   only when problem.keeps_router_logits()
///   scores         P             score dtype  pair order
///   scatter        P             int32        grouped row -> pair (sigma)
///   inverse        P             int32        pair -> grouped row (sigma^-1)
///   gather         P             int32        grouped row -> token (gamma)
///   expert_offsets E + 1         int32        expert_offsets[E] is the routed pair count
///   token_offsets  T + 1         int32        only for variable-K routing (token rounding, caller-supplied)
///   token_selection T x kTokenSelectionStatsBytes  token rounding only: each token's top-K selection as the
///                                       forward found it (the K-th rank key, the top value and the selection's sum of
///                                       exp, the row's max and sum of exp), so the router backward does not select
///                                       again; written by the GPU forward (the CPU backend's backward selects anew)
/// The expert of a pair is not stored: it is the segment of expert_offsets that holds inverse[p].
struct SavedLayout {
  BufferRegion h, router_logits, scores, scatter, inverse, gather, expert_offsets, token_offsets, token_selection;
  std::size_t total_bytes = 0;
};
SavedLayout saved_layout(const MoEProblem& problem, DType data_dtype);

/// Activation memory as docs/TARGETS.md defines it: what the forward keeps alive for the backward, the layer input
/// X counted once (the caller keeps it; the backward takes it again), parameters and the output excluded.
/// In bf16 with top-K routing this is 2Td + 4TKn + 16TK + 4(E+1) (+ alignment) in kPreActivation mode and
/// 2Td + 16TK + 4(E+1) in kInputOnly mode (docs/SPEC.md §4.4, docs/TARGETS.md T6/T7).
struct ActivationMemory {
  std::size_t x_bytes = 0;         // T*d*sizeof(data)
  std::size_t h_bytes = 0;         // saved.h
  std::size_t logits_bytes = 0;    // saved.router_logits
  std::size_t metadata_bytes = 0;  // scores and routing metadata, with region alignment
  std::size_t saved_bytes = 0;     // the `saved` buffer: everything but X
  std::size_t total_bytes() const { return x_bytes + saved_bytes; }
};
ActivationMemory activation_memory(const MoEProblem& problem, DType data_dtype);

/// Pairs per tile of the GPU routing-metadata build (its per-tile expert histograms are E x ceil(P / this)).
inline constexpr std::int64_t kMetadataTilePairs = 256;

/// Token rounding's counters region (ForwardWorkspaceLayout::tr_counters), in int32 words from its start, zeroed at
/// the start of every call: the kept pairs of each block of 32 tokens and of each group of 32 such blocks (the
/// select adds them up; the emit pass takes its blocks' first pairs from them), the token-choice counts f_e, and the
/// flags of the experts the bounded select had to select over their whole column (repeated tokens).
struct TokenRoundingCounters {
  std::int64_t block_kept = 0, group_kept = 0, tc_count = 0, full_select = 0, words = 0;
  static constexpr TokenRoundingCounters of(std::int64_t T, std::int64_t E) {
    TokenRoundingCounters c;
    const std::int64_t blocks = (T + 31) / 32;
    c.group_kept = c.block_kept + blocks;
    c.tc_count = c.group_kept + (blocks + 31) / 32;
    c.full_select = c.tc_count + E;
    c.words = c.full_select + E;
    return c;
  }
};

/// Token rounding's keys kernel holds a token's row in registers up to this many experts; above it the row goes
/// through memory (the token-major keys region).
inline constexpr std::int64_t kTokenRoundingRegisterExperts = 512;

/// Workspace handed to cuBLAS for the router GEMMs (so it allocates nothing itself).
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t{4} << 20;
/// cublasSetWorkspace refuses a pointer that is not this aligned, while a caller's workspace need only start on a
/// kBufferAlignment boundary: the cuBLAS region holds kCublasWorkspaceBytes plus this much slack, and cuBLAS gets the
/// region's first address aligned to it.
inline constexpr std::size_t kCublasWorkspaceAlignment = 256;

/// Transient memory of the GPU forward, one caller-provided workspace:
///   a             P x n                 data dtype  post-activation A (input of the down-projection)
///   y             R x d                 data dtype  down-projection output Y, grouped order, R = forward_y_chunk_rows
///                                                   (one chunk of tokens at a time)
///   y_chunk_plan  C + 1 + C (3E + 2)    int32       with C = forward_y_chunks > 1 only: like dx_chunk_plan below
///   y_pair_rows   P                     int32       with C > 1 only: each pair's row in its chunk's Y
///   pair_expert   P                     int32       expert of each pair, pair order
///   pair_token    P                     int32       token of each pair (variable-K routing only)
///   tile_hist     E x ceil(P / 256) + 1 int32       per-tile expert histograms of the metadata build, its scan's counter
///   expert_tiles  E + 1                 int32       GEMM M-tiles per expert, scanned
///   cublas        kCublasWorkspaceBytes + 256       cuBLAS workspace of the router GEMM, from its first 256-byte
///                                                   aligned address (cuBLAS needs it; not for caller-supplied)
/// Token rounding only (src/gpu/token_rounding_kernels.cu; it builds the routing metadata itself, so pair_expert,
/// pair_token and tile_hist are not used by it):
///   tr_keys            T x E    uint32  each (token, expert)'s ranking key, token-major: only where E is above
///                                       kTokenRoundingRegisterExperts (the keys kernel's transpose reads it back)
///   tr_keys_by_expert  E x T    uint32  the keys expert-major
///   tr_thresholds      E x 2    uint32  per expert: the kept keys' threshold and the tie cut
///   tr_bounds          E x ceil(T / 32) x 4 uint32  per expert and block of 32 tokens: the largest key not chosen
///                                       and the smallest chosen key (they bound where an expert's threshold lies),
///                                       the mask of the block's tokens that chose the expert, and the mask of
///                                       those the expert keeps; the select writes the last and, over the first,
///                                       the grouped row of the block's first kept token (both read by the emit)
///   tr_row_scores      P        fp32    the score of each grouped row's pair (written by the select)
///   tr_counters        2E + ceil(T / 32) + ceil(T / 1024) int32: kept pairs per block of 32 tokens and per
///                                       group of 32 blocks, token-choice counts, the experts selected over their
///                                       whole column (TokenRoundingCounters); zeroed at the start of every call
struct ForwardWorkspaceLayout {
  BufferRegion a, y, y_chunk_plan, y_pair_rows, pair_expert, pair_token, tile_hist, expert_tiles, cublas;
  BufferRegion tr_keys, tr_keys_by_expert, tr_thresholds, tr_bounds, tr_row_scores, tr_counters;
  std::size_t total_bytes = 0;
};
ForwardWorkspaceLayout forward_workspace_layout(const MoEProblem& problem, DType data_dtype);

/// Chunks of tokens in which the GPU backward computes dX~ = dH W1 and sums it into dX: problem.dx_chunks, or when
/// that is 0 the heuristic max(1, min(ceil(d / n), floor(P / (E * kDxChunkMinRowsPerExpert)), kDxChunksMax)):
/// chunks only while a chunk of dX~ (rows x d) is larger than A' (P x n), whose region it shares, and while each
/// expert keeps kDxChunkMinRowsPerExpert rows per chunk on average (every chunk ends each expert's rows with a
/// partial GEMM tile), and at most kDxChunksMax: each chunk also costs a launch tail of the dX~ GEMM and of the
/// gather-sum (docs/MEMORY.md has the measured price). Chunk c holds the tokens whose first pair lies in
/// [c Q, (c + 1) Q), Q = ceil(P / C): their rows, in grouped order, and each token's sum is finished within its
/// chunk, in the same order as in one pass, so the results do not depend on C.
inline constexpr std::int64_t kDxChunkMinRowsPerExpert = 768;
inline constexpr std::int64_t kDxChunksMax = 2;
std::int64_t backward_dx_chunks(const MoEProblem& problem);
/// Rows of dX~ one chunk can hold: min(P, ceil(P / C) + (most pairs of one token) - 1), the most pairs of one token
/// being K (top-K and caller-supplied routing) or E (token rounding). P when C = 1.
std::int64_t backward_dx_chunk_rows(const MoEProblem& problem);

/// Chunks of tokens in which the GPU forward computes Y = A W2_e and its weighted gather-sum into the output, with
/// the same plan as the backward's dX~ chunks: problem.y_chunks, or when that is 0 the backward's heuristic count
/// (backward_dx_chunks without its override) where the forward's own transients would set the layer's peak, else 1.
/// "Would set the peak": A + Y + the output (P n + P d + T d elements) exceed what the backward holds at its dX~
/// phase besides what both hold (the A' / dX~ region, dX, the upstream gradient dO and dW2:
/// max(P n, R d) + 2 T d + E n d). Where the weight gradients or the backward's dX~ set the peak, one pass: each
/// chunk costs a launch tail of the down-projection and of the gather-sum (docs/MEMORY.md has the measured price).
/// Each token's sum is finished within its chunk, in the same order as in one pass: the output does not depend on C.
std::int64_t forward_y_chunks(const MoEProblem& problem);
/// Rows of Y one chunk can hold (the formula of backward_dx_chunk_rows with C = forward_y_chunks).
std::int64_t forward_y_chunk_rows(const MoEProblem& problem);

/// Transient memory of the GPU backward:
///   h_recompute  P x w1_rows        data dtype   kInputOnly only
///   dh           P x w1_rows        data dtype   kInputOnly: the h_recompute region (dH overwrites H in place);
///                                                kPreActivation with consume_saved: absent (dH overwrites the H of
///                                                the caller's saved buffer, BackwardBuffers::consume_saved)
///   a_prime      P x n              data dtype   A' = s * A, left operand of dW2
///   dx_expanded  R x d              data dtype   per-pair input gradient, grouped order, R = backward_dx_chunk_rows
///                                                (one chunk of tokens at a time); in the full backward it shares
///                                                its region with a_prime (dW2 runs before dX~)
///   dx_chunk_plan  C + 1 + C (3E + 2) int32      with C = backward_dx_chunks > 1 only: each chunk's token range,
///                                                and per expert its row count offsets, M-tiles and row shift
///   dx_pair_rows P                  int32        with C > 1 only: each pair's row in its chunk's dX~
///   ds_partial   P x ceil(n / 64)   fp32         per-N-tile partial sums of <dA', A>
///   ds           P                  score dtype  router-score gradient, pair order
///   dlogits      T x E              data dtype   gradient of the router logits (not for caller-supplied routing)
///   router_pair_terms  P x 8 bytes  fp32, int32  top-K with a score other than topk_softmax: each pair's logit
///                                                gradient and expert, which the dX gather-sum turns into the
///                                                router's term of dX (dz W_r[expert]) when no gradient of the
///                                                logits comes from upstream
///   expert_tiles E + 1              int32        GEMM M-tiles per expert, scanned
///   cublas       kCublasWorkspaceBytes + 256     cuBLAS workspace of the router GEMMs, from its first 256-byte
///                                                aligned address (cuBLAS needs it; not for caller-supplied)
struct BackwardWorkspaceLayout {
  BufferRegion h_recompute, dh, a_prime, dx_expanded, dx_chunk_plan, dx_pair_rows, ds_partial, ds, dlogits,
      router_pair_terms, expert_tiles, cublas;
  std::size_t total_bytes = 0;
};
/// split: the layout of backward_input(), without dh and a_prime (they live in the deferred buffer).
/// consume_saved: the layout of a full backward that may overwrite the saved buffer (BackwardBuffers::consume_saved).
BackwardWorkspaceLayout backward_workspace_layout(const MoEProblem& problem, DType data_dtype, bool split = false,
                                                  bool consume_saved = false);

/// What backward_input() leaves for backward_weight() (layer.hpp), kept by the caller in between:
///   dh       P x w1_rows   data dtype   gradient of the pre-activation, grouped order
///   a_prime  P x n         data dtype   A' = s * A, grouped order
struct DeferredLayout {
  BufferRegion dh, a_prime;
  std::size_t total_bytes = 0;
};
DeferredLayout deferred_layout(const MoEProblem& problem, DType data_dtype);

/// Workspace of backward_input(): backward_workspace_layout(..., split = true). backward_weight() needs none.
/// 0 for Device::cpu().
std::size_t backward_input_workspace_bytes(const MoEProblem& problem, DType data_dtype, Device device);

/// Workspace bytes that forward()/backward() need on `device`. The CPU reference allocates its own host scratch
/// (it is a reference, not a production path), so it needs none: 0 for Device::cpu().
std::size_t forward_workspace_bytes(const MoEProblem& problem, DType data_dtype, Device device);
/// consume_saved: for a backward that may overwrite the saved buffer (BackwardBuffers::consume_saved): P x w1_rows
/// elements less in kPreActivation mode.
std::size_t backward_workspace_bytes(const MoEProblem& problem, DType data_dtype, Device device,
                                     bool consume_saved = false);

}  // namespace machmoe
