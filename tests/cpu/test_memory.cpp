// Memory accounting: closed forms of docs/SPEC.md §4.4 / docs/TARGETS.md T6-T7, layout sanity, 64-bit sizes, and agreement
// with what the reference really keeps.
#include <gtest/gtest.h>

#include "machmoe/memory.hpp"
#include "test_support.hpp"

namespace machmoe::test {
namespace {

MoEProblem config(std::int64_t T, std::int64_t d, std::int64_t n, std::int64_t E, std::int64_t K) {
  MoEProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.K = K;
  return p;
}

std::size_t up256(std::size_t b) { return (b + 255) / 256 * 256; }

TEST(MemoryAccounting, PreActivationModeIs2Td_Plus_4TKn_PlusMetadata) {
  const MoEProblem p = config(24576, 1536, 256, 128, 8);  // 7B
  const std::size_t T = 24576, d = 1536, n = 256, E = 128, TK = 24576 * 8;
  const ActivationMemory m = activation_memory(p, DType::kBF16);
  EXPECT_EQ(m.x_bytes, 2 * T * d);
  EXPECT_EQ(m.h_bytes, 4 * TK * n);
  EXPECT_EQ(m.logits_bytes, 0u);
  // scores fp32 + scatter + inverse + gather int32, expert offsets int32, each region 256-byte aligned.
  EXPECT_EQ(m.metadata_bytes, 4 * up256(4 * TK) + up256(4 * (E + 1)));
  EXPECT_LE(m.metadata_bytes, 24 * TK) << "docs/TARGETS.md T6: metadata <= 24 bytes per routed pair";
  EXPECT_EQ(m.total_bytes(), 2 * T * d + 4 * TK * n + m.metadata_bytes);
  // docs/SPEC.md §4.4's 7B example: 72 MiB of X + 192 MiB of H.
  EXPECT_EQ(m.x_bytes, 72u << 20);
  EXPECT_EQ(m.h_bytes, 192u << 20);
}

TEST(MemoryAccounting, InputOnlyModeIs2Td_PlusMetadata) {
  MoEProblem p = config(24576, 1536, 256, 128, 8);
  p.cache = CacheMode::kInputOnly;
  const ActivationMemory m = activation_memory(p, DType::kBF16);
  EXPECT_EQ(m.h_bytes, 0u);
  EXPECT_EQ(m.total_bytes(), 2u * 24576 * 1536 + m.metadata_bytes);
  EXPECT_LE(m.metadata_bytes, 24u * 24576 * 8) << "docs/TARGETS.md T7";
}

TEST(MemoryAccounting, FlatInGranularityAtFixedActivatedParameters) {
  // 7B family: n*K constant, so 4TKn (and the total, up to metadata) does not grow with granularity.
  const ActivationMemory a = activation_memory(config(24576, 1536, 256, 128, 8), DType::kBF16);
  const ActivationMemory b = activation_memory(config(24576, 1536, 512, 64, 4), DType::kBF16);
  const ActivationMemory c = activation_memory(config(24576, 1536, 1024, 32, 2), DType::kBF16);
  EXPECT_EQ(a.h_bytes, b.h_bytes);
  EXPECT_EQ(b.h_bytes, c.h_bytes);
  EXPECT_GT(a.metadata_bytes, c.metadata_bytes);  // only the per-pair metadata grows with K
}

TEST(MemoryAccounting, KeptLogitsAndVariableKRegions) {
  MoEProblem p = config(1000, 64, 32, 16, 2);
  p.score = ScoreVariant::kTopKOfSoftmax;
  EXPECT_EQ(saved_layout(p, DType::kBF16).router_logits.bytes, 2u * 1000 * 16);
  EXPECT_FALSE(saved_layout(p, DType::kBF16).token_offsets.present());
  p.score = ScoreVariant::kTopKOfSoftmaxRenorm;
  EXPECT_FALSE(saved_layout(p, DType::kBF16).router_logits.present()) << "renorm backward needs only the scores";
  p.routing = RoutingMode::kTokenRounding;
  const SavedLayout l = saved_layout(p, DType::kBF16);
  EXPECT_TRUE(l.router_logits.present());
  EXPECT_EQ(l.token_offsets.bytes, 4u * 1001);
  EXPECT_EQ(l.scores.bytes, 4u * static_cast<std::size_t>(p.max_pairs()));
  EXPECT_EQ(l.token_selection.bytes, kTokenSelectionStatsBytes * 1000) << "each token's selection, for the backward";
  p.routing = RoutingMode::kTopK;
  EXPECT_FALSE(saved_layout(p, DType::kBF16).token_selection.present()) << "top-K's backward reads its scores";
}

// The backward's per-pair router terms exist exactly where the logits' gradient lives at the selections: top-K
// routing with a score renormalised over them. Written out per case, so that the predicate is checked against the
// table rather than against itself.
TEST(MemoryAccounting, RouterPairTermsWhereTheLogitGradientIsAtTheSelections) {
  struct Case {
    RoutingMode routing;
    ScoreVariant score;
    bool at_selections;
  };
  const Case cases[] = {
      {RoutingMode::kTopK, ScoreVariant::kSoftmaxOverTopK, true},
      {RoutingMode::kTopK, ScoreVariant::kTopKOfSoftmaxRenorm, true},
      {RoutingMode::kTopK, ScoreVariant::kTopKOfSoftmax, false},
      {RoutingMode::kTokenRounding, ScoreVariant::kSoftmaxOverTopK, false},
      {RoutingMode::kTokenRounding, ScoreVariant::kTopKOfSoftmax, false},
      {RoutingMode::kCallerSupplied, ScoreVariant::kSoftmaxOverTopK, false},
  };
  for (const Case& c : cases) {
    MoEProblem p = config(1000, 64, 32, 16, 2);
    p.routing = c.routing, p.score = c.score;
    if (c.routing == RoutingMode::kCallerSupplied) p.num_pairs = 2000;
    const std::string what = std::string(routing_mode_name(c.routing)) + " / " + score_variant_name(c.score);
    EXPECT_EQ(p.logit_grad_at_selections(), c.at_selections) << what;
    const BackwardWorkspaceLayout b = backward_workspace_layout(p, DType::kBF16);
    EXPECT_EQ(b.router_pair_terms.present(), c.at_selections) << what;
    if (c.at_selections) {
      EXPECT_EQ(b.router_pair_terms.bytes, 8u * static_cast<std::size_t>(p.max_pairs())) << what;
    }
  }
}

TEST(MemoryAccounting, RegionsAreAlignedDisjointAndInsideTheTotal) {
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding}) {
    MoEProblem p = config(777, 96, 40, 12, 3);
    p.routing = r;
    p.score = ScoreVariant::kTopKOfSoftmax;
    const SavedLayout l = saved_layout(p, DType::kBF16);
    const BufferRegion regions[] = {l.h, l.router_logits, l.scores, l.scatter, l.inverse,
                                    l.gather, l.expert_offsets, l.token_offsets, l.token_selection};
    std::size_t end = 0;
    for (const BufferRegion& reg : regions) {
      if (!reg.present()) continue;
      EXPECT_EQ(reg.offset % kRegionAlignment, 0u);
      EXPECT_GE(reg.offset, end);
      end = reg.offset + reg.bytes;
    }
    EXPECT_LE(end, l.total_bytes);
  }
}

// cublasSetWorkspace refuses a pointer that is not 256-byte aligned, while a workspace need only start on a 16-byte
// boundary (kBufferAlignment). The GPU path hands cuBLAS the cuBLAS region's first 256-byte aligned address: for
// every 16-byte aligned start of the workspace, kCublasWorkspaceBytes from there must lie inside the region and the
// workspace, in each layout that has the region.
TEST(MemoryAccounting, CublasRegionHasSlackForA256ByteAlignedStart) {
  const auto check = [](const BufferRegion& r, std::size_t total, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(r.present());
    EXPECT_EQ(r.bytes, kCublasWorkspaceBytes + 256);
    EXPECT_LE(r.offset + r.bytes, total);
    for (std::size_t start = 0; start < 256; start += kBufferAlignment) {  // the workspace's address modulo 256
      const std::size_t at = start + r.offset, aligned = (at + 255) / 256 * 256;
      EXPECT_LE(aligned + kCublasWorkspaceBytes, start + r.offset + r.bytes) << "workspace at 256 k + " << start;
    }
  };
  for (RoutingMode routing : {RoutingMode::kTopK, RoutingMode::kTokenRounding}) {
    MoEProblem p = config(777, 96, 40, 12, 3);
    p.routing = routing;
    const ForwardWorkspaceLayout f = forward_workspace_layout(p, DType::kBF16);
    check(f.cublas, f.total_bytes, "forward");
    for (bool split : {false, true})
      for (bool consume : {false, true}) {
        const BackwardWorkspaceLayout b = backward_workspace_layout(p, DType::kBF16, split, consume);
        check(b.cublas, b.total_bytes, split ? "backward_input" : consume ? "backward, consume_saved" : "backward");
      }
  }
  // Caller-supplied routing has no router GEMM: no region, no slack.
  MoEProblem caller = config(64, 32, 16, 4, 2);
  caller.routing = RoutingMode::kCallerSupplied, caller.num_pairs = 100;
  EXPECT_FALSE(forward_workspace_layout(caller, DType::kBF16).cublas.present());
  EXPECT_FALSE(backward_workspace_layout(caller, DType::kBF16).cublas.present());
}

TEST(MemoryAccounting, SizesPast2To31UseSixtyFourBitArithmetic) {
  const MoEProblem p = config(1 << 20, 8192, 2048, 64, 8);  // T*d = 2^33, TK*w1_rows = 2^35
  const ActivationMemory m = activation_memory(p, DType::kBF16);
  EXPECT_EQ(m.x_bytes, std::size_t{2} << 33);
  EXPECT_EQ(m.h_bytes, std::size_t{2} * (std::size_t{1} << 23) * 4096);
  const ForwardWorkspaceLayout fw = forward_workspace_layout(p, DType::kBF16);
  // Y in two chunks of tokens (forward_y_chunks): each holds ceil(P / 2) + K - 1 rows.
  EXPECT_EQ(fw.y.bytes, std::size_t{2} * ((std::size_t{1} << 22) + 7) * 8192);
  MoEProblem one = p;
  one.y_chunks = 1;
  EXPECT_EQ(forward_workspace_layout(one, DType::kBF16).y.bytes, std::size_t{2} * (std::size_t{1} << 23) * 8192);
}

TEST(MemoryAccounting, WorkspaceFormulas) {
  MoEProblem p = config(4096, 1024, 512, 64, 4);
  const std::size_t P = 4096 * 4;
  const ForwardWorkspaceLayout f = forward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(f.a.bytes, 2 * P * 512);
  EXPECT_EQ(f.y.bytes, 2 * P * 1024);
  EXPECT_EQ(f.pair_expert.bytes, 4 * P);
  EXPECT_FALSE(f.pair_token.present());
  EXPECT_EQ(f.tile_hist.bytes, 4u * (64 * (P / 256) + 1));  // 256 pairs per tile, and the scan's block counter
  EXPECT_EQ(f.expert_tiles.bytes, 4u * 65);
  EXPECT_FALSE(f.tr_keys.present());
  EXPECT_FALSE(f.tr_keys_by_expert.present());
  EXPECT_FALSE(f.tr_bounds.present());
  EXPECT_FALSE(f.tr_row_scores.present());
  EXPECT_FALSE(f.tr_counters.present());
  EXPECT_EQ(f.cublas.bytes, kCublasWorkspaceBytes + 256);  // + slack to align it for cuBLAS (below)
  const BackwardWorkspaceLayout b = backward_workspace_layout(p, DType::kBF16);
  EXPECT_FALSE(b.h_recompute.present());
  EXPECT_EQ(b.dh.bytes, 2 * P * 1024);
  EXPECT_EQ(b.a_prime.bytes, 2 * P * 512);
  EXPECT_EQ(b.dx_expanded.bytes, 2 * P * 1024);
  EXPECT_EQ(b.ds_partial.bytes, 4 * P * 8);
  EXPECT_EQ(b.dlogits.bytes, 2u * 4096 * 64);
  EXPECT_EQ(b.router_pair_terms.bytes, 8 * P);  // top-K, softmax over the selections: dz and expert per pair
  {
    MoEProblem dense = p;  // topk_softmax's logit gradient fills the row: dX takes dlogits W_r, no pair terms
    dense.score = ScoreVariant::kTopKOfSoftmax;
    const BackwardWorkspaceLayout d = backward_workspace_layout(dense, DType::kBF16);
    EXPECT_FALSE(d.router_pair_terms.present());
    EXPECT_EQ(d.total_bytes + 8 * P, b.total_bytes);
  }
  EXPECT_EQ(b.expert_tiles.bytes, 4u * 65);
  // A' and dX~ share one region (the full backward runs dW2 before dX~); the split backward keeps dX~ apart.
  EXPECT_EQ(b.a_prime.offset, b.dx_expanded.offset);
  EXPECT_EQ(b.total_bytes, backward_workspace_bytes(p, DType::kBF16, Device::cuda(0)));
  // A backward that takes the saved buffer over writes dH over the saved H: no dH region, the rest unchanged.
  const BackwardWorkspaceLayout consumed = backward_workspace_layout(p, DType::kBF16, false, true);
  EXPECT_FALSE(consumed.dh.present());
  EXPECT_EQ(consumed.a_prime.bytes, b.a_prime.bytes);
  EXPECT_EQ(consumed.dx_expanded.bytes, b.dx_expanded.bytes);
  EXPECT_EQ(consumed.total_bytes, b.total_bytes - 2 * P * 1024);
  EXPECT_EQ(consumed.total_bytes, backward_workspace_bytes(p, DType::kBF16, Device::cuda(0), true));
  EXPECT_EQ(backward_workspace_bytes(p, DType::kBF16, Device::cpu(), true), 0u);
  const BackwardWorkspaceLayout split = backward_workspace_layout(p, DType::kBF16, true);
  EXPECT_FALSE(split.dh.present());
  EXPECT_FALSE(split.a_prime.present());
  EXPECT_EQ(split.dx_expanded.bytes, 2 * P * 1024);
  p.cache = CacheMode::kInputOnly;
  const BackwardWorkspaceLayout r = backward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(r.h_recompute.bytes, 2 * P * 1024);
  // dH overwrites the recomputed H in place: no region of its own.
  EXPECT_EQ(r.dh.offset, r.h_recompute.offset);
  EXPECT_EQ(r.dh.bytes, r.h_recompute.bytes);
  EXPECT_EQ(r.total_bytes, b.total_bytes) << "recompute mode's backward workspace is the default's: H's region is dH's";
  EXPECT_EQ(backward_workspace_layout(p, DType::kBF16, false, true).total_bytes, r.total_bytes)
      << "input-only mode keeps no H to write over";
  p.routing = RoutingMode::kTokenRounding;
  const ForwardWorkspaceLayout tr = forward_workspace_layout(p, DType::kBF16);
  EXPECT_FALSE(tr.tr_keys.present()) << "E = 64 rows stay in registers: no token-major keys";
  EXPECT_EQ(tr.tr_keys_by_expert.bytes, 4u * 4096 * 64);
  EXPECT_EQ(tr.tr_thresholds.bytes, 8u * 64);
  EXPECT_EQ(tr.tr_bounds.bytes, 16u * 64 * (4096 / 32));
  EXPECT_EQ(tr.tr_row_scores.bytes, 4 * static_cast<std::size_t>(p.max_pairs()));
  // Look-back states (one uint64 per 64-token block), then 2E + 4 int32 counters.
  EXPECT_EQ(tr.tr_counters.bytes, 4u * (4096 / 32 + 4096 / 1024 + 2 * 64));
  EXPECT_EQ(tr.pair_token.bytes, 4 * static_cast<std::size_t>(p.max_pairs()));
  MoEProblem wide = p;  // rows past the registers: the keys kernel's transpose reads the token-major keys back
  wide.E = kTokenRoundingRegisterExperts + 1, wide.K = 2;
  EXPECT_EQ(forward_workspace_layout(wide, DType::kBF16).tr_keys.bytes, 4u * 4096 * wide.E);
  EXPECT_EQ(forward_workspace_bytes(p, DType::kBF16, Device::cpu()), 0u) << "the CPU reference needs no workspace";
  EXPECT_EQ(forward_workspace_bytes(p, DType::kBF16, Device::cuda(0)), forward_workspace_layout(p, DType::kBF16).total_bytes);
}

// dX~ in chunks of tokens: the heuristic on the benchmark's configurations, the rows a chunk can hold, and the
// regions of the backward workspace that follow from them.
TEST(MemoryAccounting, DxChunksHeuristicAndLayout) {
  // min(ceil(d / n), floor(P / (E * 768)), 2), at least 1.
  EXPECT_EQ(backward_dx_chunks(config(40960, 768, 256, 128, 8)), 2);    // 1.4B (256,128,8): 2560 rows per expert
  EXPECT_EQ(backward_dx_chunks(config(24576, 1536, 256, 128, 8)), 2);   // 7B (256,128,8): 1536
  EXPECT_EQ(backward_dx_chunks(config(32768, 4096, 256, 256, 16)), 2);  // 30B (256,256,16): 2048
  EXPECT_EQ(backward_dx_chunks(config(32768, 4096, 2048, 64, 4)), 2);   // 120B (2048,64,4): ceil(d / n) = 2
  EXPECT_EQ(backward_dx_chunks(config(16384, 1536, 256, 512, 8)), 1);   // 256 rows per expert: one pass
  EXPECT_EQ(backward_dx_chunks(config(16384, 1024, 1024, 8, 2)), 1);    // d = n: chunks would save nothing
  EXPECT_EQ(backward_dx_chunks(config(0, 1024, 256, 8, 2)), 1);
  MoEProblem p = config(24576, 1536, 256, 128, 8);
  const std::size_t P = 24576 * 8;
  EXPECT_EQ(backward_dx_chunk_rows(p), static_cast<std::int64_t>(P / 2 + 7));  // ceil(P / C) + K - 1
  const BackwardWorkspaceLayout b = backward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(b.dx_expanded.bytes, 2 * (P / 2 + 7) * 1536);
  EXPECT_EQ(b.a_prime.offset, b.dx_expanded.offset);
  EXPECT_EQ(b.dx_chunk_plan.bytes, 4u * (3 + 2 * (3 * 128 + 2)));
  EXPECT_EQ(b.dx_pair_rows.bytes, 4 * P);
  p.dx_chunks = 1;
  const BackwardWorkspaceLayout one = backward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(one.dx_expanded.bytes, 2 * P * 1536);
  EXPECT_FALSE(one.dx_chunk_plan.present());
  EXPECT_FALSE(one.dx_pair_rows.present());
  EXPECT_EQ(one.total_bytes - b.total_bytes, 2 * 1536 * (P - P / 2 - 7) - up256(b.dx_chunk_plan.bytes) - 4 * P)
      << "two chunks save half of dX~, less the plan and the pair rows";
  // Token rounding: a token may hold up to E pairs, so a chunk holds up to ceil(P / C) + E - 1 rows.
  p.routing = RoutingMode::kTokenRounding, p.dx_chunks = 4;
  EXPECT_EQ(backward_dx_chunk_rows(p), (p.max_pairs() + 3) / 4 + 128 - 1);
  // The split backward's own dX~ region is a chunk too.
  EXPECT_EQ(backward_workspace_layout(p, DType::kBF16, true).dx_expanded.bytes,
            2 * static_cast<std::size_t>(backward_dx_chunk_rows(p)) * 1536);
  // Never more rows than pairs (T = 1: every chunk but the first is empty).
  MoEProblem tiny = config(1, 64, 32, 8, 2);
  tiny.dx_chunks = 3;
  EXPECT_EQ(backward_dx_chunk_rows(tiny), 2);
  // Checked like every field.
  tiny.dx_chunks = -1;
  EXPECT_THROW(validate_problem(tiny), Error);
  tiny.dx_chunks = Limits::kMaxDxChunks + 1;
  EXPECT_THROW(validate_problem(tiny), Error);
  tiny.dx_chunks = Limits::kMaxDxChunks;
  EXPECT_NO_THROW(validate_problem(tiny));
}

// Y in chunks of tokens: where the forward's A + Y + output would exceed what the backward holds at its dX~ phase
// (the forward would set the layer's peak), the backward's chunk count; one pass elsewhere; the forward workspace's
// regions that follow.
TEST(MemoryAccounting, YChunksHeuristicAndLayout) {
  EXPECT_EQ(forward_y_chunks(config(40960, 768, 256, 128, 8)), 2);    // 1.4B (256,128,8): 700 > 408 MiB
  EXPECT_EQ(forward_y_chunks(config(40960, 768, 512, 64, 4)), 2);     // 1.4B (512,64,4): 460 > 328
  EXPECT_EQ(forward_y_chunks(config(40960, 768, 1024, 32, 2)), 1);    // 1.4B (1024,32,2): no dX~ chunks either
  EXPECT_EQ(forward_y_chunks(config(24576, 1536, 256, 128, 8)), 2);   // 7B (256,128,8): 744 > 528
  EXPECT_EQ(forward_y_chunks(config(24576, 1536, 1024, 32, 2)), 1);   // 7B (1024,32,2): 312 < 336
  EXPECT_EQ(forward_y_chunks(config(32768, 4096, 256, 256, 16)), 2);  // 30B (256,256,16): 4608 > 3072
  EXPECT_EQ(forward_y_chunks(config(32768, 4096, 1024, 64, 4)), 1);   // 30B (1024,64,4): 1536 = 1536
  EXPECT_EQ(forward_y_chunks(config(32768, 4096, 2048, 64, 4)), 1);   // 120B (2048,64,4): dW2 sets the peak
  EXPECT_EQ(forward_y_chunks(config(16384, 1536, 256, 512, 8)), 1);   // 256 rows per expert: one pass
  EXPECT_EQ(forward_y_chunks(config(0, 1024, 256, 8, 2)), 1);
  MoEProblem p = config(40960, 768, 256, 128, 8);
  const std::size_t P = 40960 * 8;
  EXPECT_EQ(forward_y_chunk_rows(p), static_cast<std::int64_t>(P / 2 + 7));  // ceil(P / C) + K - 1
  const ForwardWorkspaceLayout f = forward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(f.y.bytes, 2 * (P / 2 + 7) * 768);
  EXPECT_EQ(f.y_chunk_plan.bytes, 4u * (3 + 2 * (3 * 128 + 2)));
  EXPECT_EQ(f.y_pair_rows.bytes, 4 * P);
  // The override: one pass, or any count (independent of dx_chunks).
  p.y_chunks = 1;
  const ForwardWorkspaceLayout one = forward_workspace_layout(p, DType::kBF16);
  EXPECT_EQ(one.y.bytes, 2 * P * 768);
  EXPECT_FALSE(one.y_chunk_plan.present());
  EXPECT_FALSE(one.y_pair_rows.present());
  EXPECT_EQ(one.total_bytes - f.total_bytes, 2 * 768 * (P - P / 2 - 7) - up256(f.y_chunk_plan.bytes) - 4 * P)
      << "two chunks save half of Y, less the plan and the pair rows";
  p.y_chunks = 3, p.dx_chunks = 1;
  EXPECT_EQ(forward_y_chunks(p), 3);
  EXPECT_EQ(backward_dx_chunks(p), 1);
  EXPECT_EQ(forward_y_chunk_rows(p), static_cast<std::int64_t>((P + 2) / 3 + 7));
  // Token rounding: up to E pairs per token.
  p.routing = RoutingMode::kTokenRounding;
  EXPECT_EQ(forward_y_chunk_rows(p), (p.max_pairs() + 2) / 3 + 128 - 1);
  MoEProblem tiny = config(1, 64, 32, 8, 2);
  tiny.y_chunks = 3;
  EXPECT_EQ(forward_y_chunk_rows(tiny), 2);
  tiny.y_chunks = -1;
  EXPECT_THROW(validate_problem(tiny), Error);
  tiny.y_chunks = Limits::kMaxDxChunks + 1;
  EXPECT_THROW(validate_problem(tiny), Error);
  tiny.y_chunks = Limits::kMaxDxChunks;
  EXPECT_NO_THROW(validate_problem(tiny));
}

// What the reference keeps for its backward is exactly what the layout accounts for, element by element.
TEST(MemoryAccounting, MatchesWhatTheReferenceKeeps) {
  for (RoutingMode r : {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied})
    for (CacheMode cm : {CacheMode::kPreActivation, CacheMode::kInputOnly})
      for (ScoreVariant sv : {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax}) {
        MoEProblem p = config(40, 8, 6, 5, 2);
        p.routing = r, p.cache = cm, p.score = sv, p.tile_m = 8;
        LayerCase<double> c(p, 1);
        p = c.problem;
        const ref::ForwardResult<double> f = ref::layer_forward(p, c.inputs());
        const SavedLayout l = saved_layout(p, DType::kFP64);
        const std::size_t P = static_cast<std::size_t>(f.saved.meta.num_pairs());
        EXPECT_LE(P, static_cast<std::size_t>(p.max_pairs()));
        const std::size_t cap = static_cast<std::size_t>(p.max_pairs());
        EXPECT_EQ(l.h.bytes, f.saved.h.empty() ? 0 : cap * 12 * 8);
        EXPECT_EQ(f.saved.h.size(), cm == CacheMode::kPreActivation ? P * 12 : 0u);
        EXPECT_EQ(l.router_logits.bytes / 8, f.saved.router_logits.size());
        EXPECT_EQ(f.saved.scores.size(), P);
        EXPECT_EQ(l.scores.bytes, cap * 8);
      }
}

}  // namespace
}  // namespace machmoe::test
