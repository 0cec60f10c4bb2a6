#include "gpu/layer_cuda.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "gpu/cuda_check.hpp"
#include "gpu/hopper/dispatch.hpp"
#include "gpu/kernels.hpp"
#include "gpu/stage_timing.hpp"
#include "machmoe/fallback.hpp"
#include "machmoe/index_checking.hpp"
#include "machmoe/memory.hpp"

namespace machmoe::gpu {
namespace {

/// Makes `ordinal` current for the scope of a call and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    MACHMOE_CUDA_CHECK(cudaGetDevice(&previous_));
    changed_ = previous_ != ordinal;
    if (changed_) MACHMOE_CUDA_CHECK(cudaSetDevice(ordinal));
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

/// One cuBLAS handle per (thread, device), created on first use and kept for the thread's life.
cublasHandle_t cublas_handle(int ordinal) {
  thread_local std::map<int, cublasHandle_t> handles;
  auto it = handles.find(ordinal);
  if (it != handles.end()) return it->second;
  cublasHandle_t h = nullptr;
  MACHMOE_CUBLAS_CHECK(cublasCreate(&h));
  handles.emplace(ordinal, h);
  return h;
}

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kFP16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

/// Column-major C (m x n) = alpha op(A) op(B) + beta C, A and B in the data dtype, C in c_dt (the data dtype, or fp32
/// for fp32 weight gradients), fp32 accumulation. Row-major callers pass their transposed problem.
void gemm(cublasHandle_t h, DType dt, cublasOperation_t opa, cublasOperation_t opb, std::int64_t m, std::int64_t n,
          std::int64_t k, const void* A, std::int64_t lda, const void* B, std::int64_t ldb, float beta, void* C,
          std::int64_t ldc, DType c_dt) {
  const float alpha = 1.0f;
  const cudaDataType_t t = cuda_type(dt);
  MACHMOE_CUBLAS_CHECK(cublasGemmEx(h, opa, opb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                     &alpha, A, t, static_cast<int>(lda), B, t, static_cast<int>(ldb), &beta, C,
                                     cuda_type(c_dt), static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
}

/// cublasSetWorkspace needs a kCublasWorkspaceAlignment (256-byte) aligned pointer, while the caller's workspace need
/// only start on a kBufferAlignment (16-byte) boundary: the cuBLAS region (`region`, its start) holds that much slack
/// past kCublasWorkspaceBytes (memory.hpp), and cuBLAS gets the region's first aligned address, which leaves
/// kCublasWorkspaceBytes inside the region.
cublasHandle_t prepared_cublas(int ordinal, cudaStream_t stream, void* region) {
  constexpr std::uintptr_t kAlignment = kCublasWorkspaceAlignment;
  const std::uintptr_t misalignment = reinterpret_cast<std::uintptr_t>(region) % kAlignment;
  void* workspace = static_cast<char*>(region) + (misalignment == 0 ? 0 : kAlignment - misalignment);
  cublasHandle_t h = cublas_handle(ordinal);
  MACHMOE_CUBLAS_CHECK(cublasSetStream(h, stream));
  MACHMOE_CUBLAS_CHECK(cublasSetWorkspace(h, workspace, kCublasWorkspaceBytes));
  return h;
}

template <class Tp = void>
Tp* at(const void* base, const BufferRegion& r) {
  return r.present() ? reinterpret_cast<Tp*>(static_cast<char*>(const_cast<void*>(base)) + r.offset) : nullptr;
}

/// Writes zeros over a view (row-major, unit inner stride, rows possibly padded: what the public checks accept)
/// with memsets only; nothing for an absent or empty view.
void zero_view(const TensorView& t, cudaStream_t stream) {
  if (t.empty() || t.numel() == 0) return;
  const std::size_t el = dtype_size(t.dtype);
  if (t.is_contiguous()) {
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(t.data, 0, el * static_cast<std::size_t>(t.numel()), stream));
    return;
  }
  // Padded rows: 2D memsets of `rows` rows of `width` bytes, one per index of the outer dimensions.
  const int r = t.rank;  // >= 2: a rank-1 view with unit stride is contiguous
  const std::size_t width = el * static_cast<std::size_t>(t.shape[r - 1]);
  const std::int64_t rows = t.shape[r - 2];
  const std::size_t pitch = rows > 1 ? el * static_cast<std::size_t>(t.stride[r - 2]) : width;
  std::int64_t outer = 1;
  for (int i = 0; i < r - 2; ++i) outer *= t.shape[i];
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t offset = 0, rest = o;
    for (int i = r - 3; i >= 0; --i) {
      offset += (rest % t.shape[i]) * t.stride[i];
      rest /= t.shape[i];
    }
    MACHMOE_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(t.data) + el * static_cast<std::size_t>(offset), pitch,
                                          0, width, static_cast<std::size_t>(rows), stream));
  }
}

// ---- index checking --------------------------------------------------------------------------------------------

/// One device's status: a claim word in device memory (the kernels' atomicCAS target) and the record in pinned,
/// mapped host memory (read by the host without a synchronisation). Allocated once per device and kept for the
/// process's life (freeing it at exit could race the CUDA runtime's own teardown).
struct IndexStatus {
  std::int32_t* claim = nullptr;
  IndexViolationRecord* host = nullptr;
  IndexViolationRecord* device = nullptr;
};

std::mutex& index_status_mutex() {
  static std::mutex m;
  return m;
}
std::map<int, IndexStatus>& index_statuses() {
  static std::map<int, IndexStatus> m;
  return m;
}

/// What checked kernels get on `ordinal` (the current device): nothing when checking is off (the default, so the
/// default path allocates nothing and reads nothing), else the device's status, allocated on its first use.
IndexCheck index_check_for(int ordinal, cudaStream_t stream) {
  if (!index_checking_enabled()) return {};
  const std::lock_guard<std::mutex> lock(index_status_mutex());
  auto it = index_statuses().find(ordinal);
  if (it == index_statuses().end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      throw RuntimeError("machmoe: index checking allocates its status on the first checked call on cuda:" +
                         std::to_string(ordinal) +
                         ", which cannot happen during a CUDA graph capture: make one checked call on that device "
                         "before capturing");
    }
    IndexStatus st;
    MACHMOE_CUDA_CHECK(cudaMalloc(&st.claim, sizeof(std::int32_t)));
    MACHMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&st.host), sizeof(IndexViolationRecord),
                                      cudaHostAllocMapped));
    st.host->ready = 0;
    MACHMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.device), st.host, 0));
    // The claim must read 0 before any kernel on any stream looks at it: the one wait of checking mode, once per
    // device.
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(st.claim, 0, sizeof(std::int32_t), stream));
    MACHMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    it = index_statuses().emplace(ordinal, st).first;
  }
  return {it->second.claim, it->second.device};
}

/// The public message for a record: the argument, what was expected and the value, from `where`.
[[noreturn]] void throw_violation(const IndexViolationRecord& r, int ordinal, const char* where) {
  const std::string pos = "[" + std::to_string(r.position) + "]";
  const std::string found =
      " (recorded on cuda:" + std::to_string(ordinal) + " by device-side index checking in an earlier launch)";
  const std::string value = std::to_string(r.value);
  switch (static_cast<IndexViolation>(r.violation)) {
    case IndexViolation::kTokenRange:
      throw_argument_error(where, "routing.token_index" + pos, "a token in [0, " + std::to_string(r.bound) + ")",
                           value + found);
    case IndexViolation::kExpertRange:
      throw_argument_error(where, "routing.expert_index" + pos, "an expert in [0, " + std::to_string(r.bound) + ")",
                           value + found);
    case IndexViolation::kTokenOrder:
      throw_argument_error(where, "routing.token_index" + pos,
                           "token indices in ascending order (the pairs of a token contiguous), so >= " +
                               std::to_string(r.bound),
                           value + found);
    case IndexViolation::kTokenRun:
      throw_argument_error(where, "routing.token_index" + pos,
                           "at most K = " + std::to_string(r.bound) + " pairs per token",
                           "at least " + std::to_string(r.bound + 1) + " pairs for token " + value + found);
    case IndexViolation::kCountNegative:
      throw_argument_error(where, "expert_counts" + pos, "a count >= 0", value + found);
    case IndexViolation::kCountTotal:
      throw_argument_error(where, "expert_counts", "counts summing to the " + std::to_string(r.bound) + " grouped rows",
                           "a sum of " + value + found);
  }
  throw_argument_error(where, "indices", "valid caller indices",
                       "violation code " + std::to_string(r.violation) + found);
}

/// W1's (or its gradient's) strides in elements: from one expert to the next, from one row to the next, and in the
/// concatenated layout from gate row j to up row j (0 otherwise). A 4D (E, 2, n, d) view gives the last one itself:
/// its halves may lie apart (layer.hpp, LayerWeights::w1).
struct W1Strides {
  std::int64_t expert = 0, row = 0, half = 0;
};
W1Strides w1_strides(const MoEProblem& p, const TensorView& w1) {
  if (w1.rank == 4) return {w1.stride[0], w1.stride[2], w1.stride[1]};
  const bool concat = p.weight_layout == WeightLayout::kConcatenated;
  return {w1.stride[0], w1.stride[1], concat ? p.n * w1.stride[1] : 0};
}

/// The up-projection: H = gather(X) W1^T + b1 (stored when h_out), A = act(H) (stored when a_out).
VarlenMArgs up_projection_args(const MoEProblem& p, DType dt, const TensorView& x, const LayerWeights& w,
                               const std::int32_t* offsets, const std::int32_t* tiles, const std::int32_t* gather,
                               void* h_out, void* a_out) {
  VarlenMArgs a;
  a.dt = dt;
  a.E = p.E, a.N = p.w1_rows(), a.K = p.d, a.P_max = p.max_pairs();
  a.expert_offsets = offsets, a.expert_tiles = tiles;
  a.a = x.data, a.lda = x.stride[0], a.a_gather = gather;
  const W1Strides s = w1_strides(p, w.w1);
  a.b.ptr = w.w1.data, a.b.expert_stride = s.expert, a.b.stride_col = s.row, a.b.stride_k = 1;
  a.b.permute = p.weight_layout == WeightLayout::kConcatenated ? 1 : 0;
  a.b.glu_n = p.n, a.b.glu_half_stride = s.half;
  a.epilogue = Epilogue::kUpActivation;
  a.out = h_out, a.ld_out = p.w1_rows();
  if (p.has_b1) a.bias = w.b1.data, a.ld_bias = w.b1.stride[0];
  a.activation = p.activation;
  a.act_alpha = static_cast<float>(p.swiglu_alpha), a.act_limit = static_cast<float>(p.swiglu_limit);
  a.act_out = a_out, a.ld_act = p.n;
  return a;
}

/// The down-projection: Y = A W2^T + b2, A's rows contiguous in expert order.
VarlenMArgs down_projection_args(const MoEProblem& p, DType dt, const LayerWeights& w, const std::int32_t* offsets,
                                 const std::int32_t* tiles, const void* a, void* y) {
  VarlenMArgs down;
  down.dt = dt;
  down.E = p.E, down.N = p.d, down.K = p.n, down.P_max = p.max_pairs();
  down.expert_offsets = offsets, down.expert_tiles = tiles;
  down.a = a, down.lda = p.n;
  down.b.ptr = w.w2.data, down.b.expert_stride = w.w2.stride[0], down.b.stride_col = w.w2.stride[1];
  down.b.stride_k = 1;
  down.epilogue = Epilogue::kStore;
  down.out = y, down.ld_out = p.d;
  if (p.has_b2) down.bias = w.b2.data, down.ld_bias = w.b2.stride[0];
  return down;
}

/// The routing of a layer call as the token-chunk machinery reads it (the saved metadata).
struct ChunkRouting {
  const std::int32_t *expert_offsets, *gather, *scatter, *inverse, *token_offsets;
};

/// Where a chunked GEMM + gather-sum keeps its plan and its chunk's pair -> packed row map (workspace regions).
struct ChunkWorkspace {
  std::int32_t* plan;
  std::int32_t* pair_rows;
};

/// `gemm` (over every pair: P_max = the pair count) as it runs on chunk c of tokens: the chunk's rows of A where
/// they lie (a per-expert row shift), its output rows packed (at most chunk_rows).
VarlenMArgs chunk_args(VarlenMArgs gemm, const DxChunkPlan& plan, std::int64_t c, std::int64_t chunk_rows) {
  gemm.a_rows = gemm.P_max;  // A keeps every pair's row
  gemm.P_max = chunk_rows;   // the chunk's rows: the extent of the output
  gemm.expert_offsets = plan.chunk_offsets(c), gemm.expert_tiles = plan.chunk_tiles(c);
  gemm.a_row_shift = plan.chunk_shifts(c);
  return gemm;
}

/// refuse_expert_gemm_fallback for the GEMM of gemm_then_gather_sum (same arguments), as its launches take it.
void refuse_chunked_gemm_fallback(const MoEProblem& p, const VarlenMArgs& gemm, const char* gemm_stage,
                                  std::int64_t chunks, std::int64_t chunk_rows, std::int32_t* plan) {
  refuse_expert_gemm_fallback(chunks == 1 ? gemm : chunk_args(gemm, DxChunkPlan::in(plan, chunks, p.E), 0, chunk_rows),
                              gemm_stage);
}

/// A grouped GEMM whose output rows are then summed per token into `out` (weights: per pair, or nullptr for a plain
/// sum): the forward's down-projection and weighted gather-sum, the backward's dX~ and its gather-sum. chunks == 1:
/// the GEMM over every pair, then the sum. Otherwise one chunk of tokens at a time (memory.hpp: forward_y_chunks,
/// backward_dx_chunks): the chunk plan, then per chunk the GEMM over the chunk's rows of A where they lie (a per-expert
/// row shift), its output rows packed (at most chunk_rows), and its tokens' sums finished before the next chunk
/// overwrites them. gemm.P_max is the pair count on entry; the three names mark the GEMM's, the sum's and the plan's
/// stages (and name the GEMM in a fallback notice). plan_built: the routing metadata already wrote the plan and the
/// pair rows into ws (the forward's chunks, metadata_built_plan). router: a second per-pair term the sum adds (the
/// backward's router term of dX), or none.
void gemm_then_gather_sum(const MoEProblem& p, const VarlenMArgs& gemm, const char* gemm_stage, const char* sum_stage,
                          const char* plan_stage, std::int64_t chunks, std::int64_t chunk_rows,
                          const ChunkRouting& r, const ChunkWorkspace& ws, const float* weights,
                          const GatherRouterTerm& router, const TensorView& out, cudaStream_t stream,
                          bool plan_built = false) {
  const std::int64_t P = gemm.P_max;
  if (chunks == 1) {
    mark_stage(gemm_stage, stream);
    launch_expert_gemm(gemm, gemm_stage, stream);
    mark_stage(sum_stage, stream);
    launch_gather_sum(gemm.dt, gemm.out, p.d, weights, router, r.inverse, r.token_offsets, p.K, p.T, out.data,
                      out.stride[0], stream);
    return;
  }
  const DxChunkPlan plan = DxChunkPlan::in(ws.plan, chunks, p.E);
  const std::int64_t pairs_per_chunk = (P + chunks - 1) / chunks;
  if (!plan_built) {
    mark_stage(plan_stage, stream);
    launch_dx_chunk_plan(r.expert_offsets, r.gather, r.scatter, r.inverse, r.token_offsets, p.K, p.T, p.E, P, chunks,
                         pairs_per_chunk, plan, ws.pair_rows, p.routing == RoutingMode::kTopK, stream);
  }
  // Blocks of the chunk's gather-sum: its tokens for top-K (a chunk holds at most ceil(Q / K) + 1), a share of T
  // when a token's pair count varies (they stride over the range, whatever its length).
  const std::int64_t range_blocks = p.variable_k() ? (p.T + chunks - 1) / chunks + 1
                                                   : (pairs_per_chunk + p.K - 1) / p.K + 1;
  for (std::int64_t c = 0; c < chunks; ++c) {
    mark_stage(gemm_stage, stream);
    launch_expert_gemm(chunk_args(gemm, plan, c, chunk_rows), gemm_stage, stream);
    mark_stage(sum_stage, stream);
    launch_gather_sum(gemm.dt, gemm.out, p.d, weights, router, ws.pair_rows, r.token_offsets, p.K, p.T, out.data,
                      out.stride[0], stream, plan.bounds + c, range_blocks);
  }
}

}  // namespace

void forward_cuda(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
                  const ForwardOutputs& out, const ForwardBuffers& buf, void* stream_ptr) {
  const DeviceGuard guard(x.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DType dt = x.dtype;
  const std::int64_t P = p.max_pairs();
  const SavedLayout sl = saved_layout(p, dt);
  const ForwardWorkspaceLayout wl = forward_workspace_layout(p, dt);
  if (P == 0) {
    // No routed pairs: T = 0, or caller routing with no triples. Experts contribute nothing, so the output is zero;
    // the counts and the offsets the backward reads are zero too. Memsets only: no kernel runs on empty data.
    // (Top-K and token rounding produce pairs whenever T > 0, so their logits here are (0, E): nothing to write.)
    zero_view(out.out, stream);
    zero_view(out.expert_counts, stream);
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(at(buf.saved, sl.expert_offsets), 0, sl.expert_offsets.bytes, stream));
    if (sl.token_offsets.present())
      MACHMOE_CUDA_CHECK(cudaMemsetAsync(at(buf.saved, sl.token_offsets), 0, sl.token_offsets.bytes, stream));
    return;
  }
  // The expert GEMMs, and under the fallback policy "error" each checked before anything is launched: a GEMM the
  // Hopper kernels refuse then raises with nothing written (docs/VALIDATION.md), not after the stages before it.
  void* a_buf = at(buf.workspace, wl.a);
  void* y_buf = at(buf.workspace, wl.y);
  const std::int32_t* gemm_offsets = at<std::int32_t>(buf.saved, sl.expert_offsets);
  const std::int32_t* gemm_tiles = at<std::int32_t>(buf.workspace, wl.expert_tiles);
  // Input-only cache mode keeps no H (its saved region is absent): the kernel then stores only A.
  const VarlenMArgs up = up_projection_args(p, dt, x, w, gemm_offsets, gemm_tiles,
                                            at<std::int32_t>(buf.saved, sl.gather), at(buf.saved, sl.h), a_buf);
  const VarlenMArgs down = down_projection_args(p, dt, w, gemm_offsets, gemm_tiles, a_buf, y_buf);
  std::int32_t* y_plan = at<std::int32_t>(buf.workspace, wl.y_chunk_plan);
  std::int32_t* y_pair_rows = at<std::int32_t>(buf.workspace, wl.y_pair_rows);
  refuse_expert_gemm_fallback(up, "forward/up_projection");
  refuse_chunked_gemm_fallback(p, down, "forward/down_projection", forward_y_chunks(p), forward_y_chunk_rows(p),
                               y_plan);

  float* scores = at<float>(buf.saved, sl.scores);
  std::int32_t* pair_expert = at<std::int32_t>(buf.workspace, wl.pair_expert);
  std::int32_t* pair_token = at<std::int32_t>(buf.workspace, wl.pair_token);

  bool tr_built_plan = false;  // token rounding built the plan of the forward's chunks of tokens
  bool histograms_written = false;  // the top-K kernel wrote the metadata's tile histograms

  // Router and routing.
  if (p.routing != RoutingMode::kCallerSupplied) {
    mark_stage("forward/router_gemm", stream);
    // logits (T x E, row-major) = x W_r^T: column-major E x T = W_r (op T of d x E) * x^T (d x T).
    cublasHandle_t h = prepared_cublas(x.device.index, stream, at(buf.workspace, wl.cublas));
    gemm(h, dt, CUBLAS_OP_T, CUBLAS_OP_N, p.E, p.T, p.d, w.router_weight.data, w.router_weight.stride[0], x.data,
         x.stride[0], 0.0f, out.router_logits.data, out.router_logits.stride[0], dt);
  }
  if (p.routing == RoutingMode::kTopK) {
    mark_stage("forward/topk_scores", stream);
    TopKTileHistograms histograms;
    if (wl.tile_hist.present())
      histograms = {at<std::int32_t>(buf.workspace, wl.tile_hist), (P + kMetadataTile - 1) / kMetadataTile};
    histograms_written = launch_topk_scores(dt, out.router_logits.data, out.router_logits.stride[0], p.T, p.E, p.K,
                                            p.score, scores, pair_expert, stream, histograms);
  } else if (p.routing == RoutingMode::kTokenRounding) {
    // Selection and the whole routing metadata (no routing-metadata stage follows): this stage is all of token
    // rounding's routing, to be compared with forward/topk_scores + forward/routing_metadata of top-K.
    mark_stage("forward/token_rounding", stream);
    TokenRoundingArgs tr;
    tr.dt = dt;
    tr.T = p.T, tr.E = p.E, tr.K = p.K, tr.tile_m = p.tile_m, tr.P_max = P;
    tr.variant = p.score, tr.rule = p.rounding;
    tr.logits = out.router_logits.data, tr.ld_logits = out.router_logits.stride[0];
    if (wl.tr_keys.present()) tr.keys = at<std::uint32_t>(buf.workspace, wl.tr_keys);
    tr.row_scores = at<float>(buf.workspace, wl.tr_row_scores);
    tr.keys_by_expert = at<std::uint32_t>(buf.workspace, wl.tr_keys_by_expert);
    tr.thresholds = at<std::uint32_t>(buf.workspace, wl.tr_thresholds);
    tr.bounds = at<std::uint32_t>(buf.workspace, wl.tr_bounds);
    tr.counters = at(buf.workspace, wl.tr_counters), tr.counters_bytes = wl.tr_counters.bytes;
    tr.expert_counts = static_cast<std::int32_t*>(out.expert_counts.data);
    tr.expert_offsets = at<std::int32_t>(buf.saved, sl.expert_offsets);
    tr.expert_tiles = at<std::int32_t>(buf.workspace, wl.expert_tiles);
    tr.scatter = at<std::int32_t>(buf.saved, sl.scatter);
    tr.inverse = at<std::int32_t>(buf.saved, sl.inverse);
    tr.gather = at<std::int32_t>(buf.saved, sl.gather);
    tr.token_offsets = at<std::int32_t>(buf.saved, sl.token_offsets);
    tr.scores = scores;
    tr.selection = at<TokenSelectionStats>(buf.saved, sl.token_selection);
    tr.logits_copy = at(buf.saved, sl.router_logits);  // the keys kernel copies the logits as it reads them
    const std::int64_t chunks = forward_y_chunks(p);
    if (chunks > 1) {  // the forward's chunks of tokens: their plan built after the emit (token_rounding_built_plan)
      tr.chunks = chunks, tr.pairs_per_chunk = (P + chunks - 1) / chunks;
      tr.plan = DxChunkPlan::in(at<std::int32_t>(buf.workspace, wl.y_chunk_plan), chunks, p.E);
      tr.pair_rows = at<std::int32_t>(buf.workspace, wl.y_pair_rows);
    }
    tr_built_plan = token_rounding_built_plan(tr);
    launch_token_rounding(tr, stream);
  } else {
    mark_stage("forward/caller_routing", stream);
    // The scores' region (P floats) is the conversion's scratch (ceil(P / 1024) int32) until the copy below.
    launch_convert_pairs(routing->token_index.data, routing->token_index.dtype, routing->expert_index.data,
                         routing->expert_index.dtype, P, p.T, p.E, p.K, pair_token, pair_expert,
                         reinterpret_cast<std::int32_t*>(scores), index_check_for(x.device.index, stream), stream);
    if (P > 0)
      MACHMOE_CUDA_CHECK(cudaMemcpyAsync(scores, routing->score.data, sizeof(float) * P, cudaMemcpyDeviceToDevice,
                                          stream));
  }
  MetadataArgs m;
  m.T = p.T, m.E = p.E, m.P = P, m.K = p.K;
  m.pair_expert = pair_expert, m.pair_token = pair_token;
  m.tile_hist = at<std::int32_t>(buf.workspace, wl.tile_hist);
  m.histograms_written = histograms_written;
  m.expert_counts = static_cast<std::int32_t*>(out.expert_counts.data);
  m.expert_offsets = at<std::int32_t>(buf.saved, sl.expert_offsets);
  m.expert_tiles = at<std::int32_t>(buf.workspace, wl.expert_tiles);
  m.scatter = at<std::int32_t>(buf.saved, sl.scatter);
  m.inverse = at<std::int32_t>(buf.saved, sl.inverse);
  m.gather = at<std::int32_t>(buf.saved, sl.gather);
  m.token_offsets = at<std::int32_t>(buf.saved, sl.token_offsets);
  // The forward's chunks of tokens (memory.hpp, forward_y_chunks): their plan is built with the metadata.
  const std::int64_t y_chunks = forward_y_chunks(p);
  if (y_chunks > 1 && p.routing != RoutingMode::kTokenRounding) {
    m.chunks = y_chunks, m.pairs_per_chunk = (P + y_chunks - 1) / y_chunks;
    m.plan = DxChunkPlan::in(y_plan, y_chunks, p.E);
    m.pair_rows = y_pair_rows;
  }
  if (p.routing != RoutingMode::kTokenRounding) {  // token rounding built the metadata itself
    mark_stage("forward/routing_metadata", stream);
    launch_routing_metadata(m, stream);
  }
  if (sl.router_logits.present() && p.routing != RoutingMode::kTokenRounding) {
    const std::size_t row = dtype_size(dt) * static_cast<std::size_t>(p.E);
    MACHMOE_CUDA_CHECK(cudaMemcpy2DAsync(at(buf.saved, sl.router_logits), row, out.router_logits.data,
                                          dtype_size(dt) * out.router_logits.stride[0], row, p.T,
                                          cudaMemcpyDeviceToDevice, stream));
  }

  // Experts: up-projection with the activation epilogue, down-projection, weighted gather-sum.
  mark_stage("forward/up_projection", stream);
  launch_expert_gemm(up, "forward/up_projection", stream);
  // Y at once, or one chunk of tokens at a time where Y would set the layer's peak (memory.hpp, forward_y_chunks),
  // over the backward's dX~ chunk plan.
  gemm_then_gather_sum(p, down, "forward/down_projection", "forward/aggregation", "forward/y_chunk_plan",
                       forward_y_chunks(p), forward_y_chunk_rows(p),
                       {m.expert_offsets, m.gather, m.scatter, m.inverse, m.token_offsets}, {y_plan, y_pair_rows},
                       scores, {}, out.out, stream,
                       p.routing == RoutingMode::kTokenRounding ? tr_built_plan : metadata_built_plan(m));
  mark_stage(nullptr, stream);
}

namespace {

// The backward in four phases. The full backward runs them as dH, dW2, dX, dW1: A' is dead once dW2 has run, so
// dX~ takes its workspace region (memory.hpp). The split backward runs dH and dX in backward_input and dW2 and dW1
// in backward_weight.

/// The saved buffer's regions the backward reads (memory.hpp's SavedLayout), decoded once per backward call.
struct SavedState {
  const float* scores;
  const std::int32_t *offsets, *scatter, *inverse, *gather, *token_offsets;
  const void *h, *router_logits;
  const TokenSelectionStats* token_selection;  // token rounding only
};
SavedState saved_state(const MoEProblem& p, DType dt, const void* saved) {
  const SavedLayout sl = saved_layout(p, dt);
  return {at<float>(saved, sl.scores),         at<std::int32_t>(saved, sl.expert_offsets),
          at<std::int32_t>(saved, sl.scatter), at<std::int32_t>(saved, sl.inverse),
          at<std::int32_t>(saved, sl.gather),  at<std::int32_t>(saved, sl.token_offsets),
          at(saved, sl.h),                     at(saved, sl.router_logits),
          at<TokenSelectionStats>(saved, sl.token_selection)};
}

/// The dH kernel: dA' = gather(dO) W2_e (W2 read in place, MN-major), its epilogue writing dH, A' = s A and the
/// dS partials from H.
VarlenMArgs dh_kernel_args(const MoEProblem& p, DType dt, const LayerWeights& w, const TensorView& grad_out,
                           const SavedState& sv, const std::int32_t* tiles, const void* h, void* dh, void* a_prime,
                           float* ds_partial) {
  const std::int64_t rows = p.w1_rows();
  VarlenMArgs dha;
  dha.dt = dt;
  dha.E = p.E, dha.N = p.n, dha.K = p.d, dha.P_max = p.max_pairs();
  dha.expert_offsets = sv.offsets, dha.expert_tiles = tiles;
  dha.a = grad_out.data, dha.lda = grad_out.stride[0], dha.a_gather = sv.gather;
  dha.b.ptr = w.w2.data, dha.b.expert_stride = w.w2.stride[0], dha.b.stride_col = 1;
  dha.b.stride_k = w.w2.stride[1];
  dha.epilogue = Epilogue::kActivationGrad;
  dha.activation = p.activation;
  dha.act_alpha = static_cast<float>(p.swiglu_alpha), dha.act_limit = static_cast<float>(p.swiglu_limit);
  dha.out = dh, dha.ld_out = rows;
  dha.act_out = a_prime, dha.ld_act = p.n;
  dha.h_in = h, dha.ld_h = rows;
  dha.scores = sv.scores, dha.scatter = sv.scatter, dha.ds_partial = ds_partial;
  return dha;
}

/// dX~ = dH W1_e over contiguous dH (W1 read in place, MN-major; the concatenated layout's rows mapped).
VarlenMArgs dx_expanded_args(const MoEProblem& p, DType dt, const LayerWeights& w, const SavedState& sv,
                             const std::int32_t* tiles, const void* dh, void* dxe) {
  const std::int64_t rows = p.w1_rows();
  VarlenMArgs dxa;
  dxa.dt = dt;
  dxa.E = p.E, dxa.N = p.d, dxa.K = rows, dxa.P_max = p.max_pairs();
  dxa.expert_offsets = sv.offsets, dxa.expert_tiles = tiles;
  dxa.a = dh, dxa.lda = rows;
  const W1Strides s = w1_strides(p, w.w1);
  dxa.b.ptr = w.w1.data, dxa.b.expert_stride = s.expert, dxa.b.stride_col = 1;
  dxa.b.stride_k = s.row, dxa.b.permute = p.weight_layout == WeightLayout::kConcatenated ? 2 : 0;
  dxa.b.glu_n = p.n, dxa.b.glu_half_stride = s.half;
  dxa.epilogue = Epilogue::kStore;
  dxa.out = dxe, dxa.ld_out = p.d;
  return dxa;
}

/// dW2_e = sum over the expert's pairs of gather(dO)^T A' (dO gathered along the reduction).
VarlenKArgs dw2_args(const MoEProblem& p, DType dt, const TensorView& grad_out, const LayerWeightGrads& gw,
                     const SavedState& sv, const void* a_prime) {
  VarlenKArgs dw2;
  dw2.dt = dt;
  dw2.E = p.E, dw2.M = p.d, dw2.N = p.n;
  dw2.expert_offsets = sv.offsets;
  dw2.a = grad_out.data, dw2.lda = grad_out.stride[0], dw2.a_gather = sv.gather;
  dw2.b = a_prime, dw2.ldb = p.n, dw2.contiguous_rows = p.max_pairs();  // A' holds max_pairs rows
  dw2.out = gw.w2.data, dw2.out_expert_stride = gw.w2.stride[0];
  dw2.ld_out = gw.w2.stride[1];
  dw2.out_dt = gw.w2.dtype, dw2.accumulate = gw.accumulate;
  return dw2;
}

/// dW1_e = sum over the expert's pairs of dH^T gather(X) (X gathered along the reduction).
VarlenKArgs dw1_args(const MoEProblem& p, DType dt, const TensorView& x, const LayerWeightGrads& gw,
                     const SavedState& sv, const void* dh) {
  const std::int64_t rows = p.w1_rows();
  VarlenKArgs dw1;
  dw1.dt = dt;
  dw1.E = p.E, dw1.M = rows, dw1.N = p.d;
  dw1.expert_offsets = sv.offsets;
  dw1.a = dh, dw1.lda = rows, dw1.contiguous_rows = p.max_pairs();  // dH holds max_pairs rows
  dw1.b = x.data, dw1.ldb = x.stride[0], dw1.b_gather = sv.gather;
  const W1Strides s = w1_strides(p, gw.w1);
  dw1.out = gw.w1.data, dw1.out_expert_stride = s.expert;
  dw1.ld_out = s.row, dw1.glu_concat_n = p.weight_layout == WeightLayout::kConcatenated ? p.n : 0;
  dw1.glu_half_stride = s.half;
  dw1.out_dt = gw.w1.dtype, dw1.accumulate = gw.accumulate;
  return dw1;
}

/// Under the fallback policy "error", raises for the first GEMM of the input phases (H recomputed, dH, dX~) that the
/// Hopper kernels refuse, before the backward launches anything (docs/VALIDATION.md); with the arguments those phases
/// launch with, built by the same functions.
void refuse_input_phase_fallbacks(const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                                  const TensorView& grad_out, const SavedState& sv, void* workspace,
                                  const BackwardWorkspaceLayout& wl, void* dh, void* a_prime) {
  if (fallback_policy() != FallbackPolicy::kError || p.max_pairs() == 0) return;  // (no pairs: no GEMM runs)
  const DType dt = x.dtype;
  const std::int32_t* tiles = at<std::int32_t>(workspace, wl.expert_tiles);
  const void* h = sv.h;
  if (p.cache == CacheMode::kInputOnly) {
    void* hr = at(workspace, wl.h_recompute);
    refuse_expert_gemm_fallback(up_projection_args(p, dt, x, w, sv.offsets, tiles, sv.gather, hr, nullptr),
                                "backward/h_recompute");
    h = hr;
  }
  refuse_expert_gemm_fallback(
      dh_kernel_args(p, dt, w, grad_out, sv, tiles, h, dh, a_prime, at<float>(workspace, wl.ds_partial)),
      "backward/dh_kernel");
  refuse_chunked_gemm_fallback(p, dx_expanded_args(p, dt, w, sv, tiles, dh, at(workspace, wl.dx_expanded)),
                               "backward/dx_expanded", backward_dx_chunks(p), backward_dx_chunk_rows(p),
                               at<std::int32_t>(workspace, wl.dx_chunk_plan));
}

/// The same for the weight phases' GEMMs: dW2 (where `w2`) and dW1 (where `w1`), into the gradient views of `gw`.
void refuse_weight_phase_fallbacks(const MoEProblem& p, const TensorView& x, const TensorView& grad_out,
                                   const LayerWeightGrads& gw, const SavedState& sv, const void* a_prime,
                                   const void* dh, bool w2, bool w1) {
  if (fallback_policy() != FallbackPolicy::kError || p.max_pairs() == 0) return;
  if (w2) refuse_weight_gemm_fallback(dw2_args(p, x.dtype, grad_out, gw, sv, a_prime), "backward/dw2");
  if (w1) refuse_weight_gemm_fallback(dw1_args(p, x.dtype, x, gw, sv, dh), "backward/dw1");
}

/// dH: expert tiles, H (recomputed in input-only mode, where dH then overwrites it in place), the dH kernel (dH and
/// A' into dh/a_prime, dS partials) and dS. Returns false when there is no routed pair: grad_x and the router's
/// gradient are then written here, and the dX phase has nothing to do.
bool backward_dh_phase(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const BackwardInputs& in,
                       const BackwardOutputs& out, const SavedState& sv, void* workspace,
                       const BackwardWorkspaceLayout& wl, void* dh, void* a_prime, cudaStream_t stream) {
  const DType dt = x.dtype;
  const std::int64_t P = p.max_pairs();
  const bool accumulate = out.grad_weights.accumulate;
  if (P == 0) {
    // No routed pairs (T = 0, or caller routing with no triples): nothing reaches x through the experts, and with
    // T = 0 nothing reaches the router either (accumulating zero leaves its gradient as it is). grad_scores has no
    // element.
    zero_view(out.grad_x, stream);
    if (!accumulate) zero_view(out.grad_weights.router_weight, stream);
    return false;
  }
  const std::int32_t *offsets = sv.offsets, *inverse = sv.inverse, *gather = sv.gather;
  std::int32_t* tiles = at<std::int32_t>(workspace, wl.expert_tiles);
  mark_stage("backward/expert_tiles", stream);
  launch_expert_tiles(offsets, p.E, tiles, stream);

  // H: kept by the forward, or recomputed (input-only mode) with the forward's arithmetic.
  const void* h = sv.h;
  if (p.cache == CacheMode::kInputOnly) {
    mark_stage("backward/h_recompute", stream);
    void* hr = at(workspace, wl.h_recompute);
    // The forward's kernel, so that the recomputed H is bitwise the H the forward would have kept.
    launch_expert_gemm(up_projection_args(p, dt, x, w, offsets, tiles, gather, hr, nullptr),
                        "backward/h_recompute", stream);
    h = hr;
  }

  // dH kernel: dA' = gather(dO) W2_e, epilogue -> dH, A' = s A, dS partials.
  float* ds_partial = at<float>(workspace, wl.ds_partial);
  mark_stage("backward/dh_kernel", stream);
  launch_expert_gemm(dh_kernel_args(p, dt, w, in.grad_out, sv, tiles, h, dh, a_prime, ds_partial),
                     "backward/dh_kernel", stream);

  // dS (pair order), with the b2 term.
  const bool caller = p.routing == RoutingMode::kCallerSupplied;
  float* ds = caller ? static_cast<float*>(out.grad_scores.data) : at<float>(workspace, wl.ds);
  mark_stage("backward/ds_reduce", stream);
  launch_ds_reduce(dt, ds_partial, (p.n + kDsTileN - 1) / kDsTileN, inverse, gather, offsets, p.E, P,
                   in.grad_out.data, in.grad_out.stride[0], p.has_b2 ? w.b2.data : nullptr,
                   p.has_b2 ? w.b2.stride[0] : 0, p.d, ds, stream);
  mark_stage(nullptr, stream);
  return true;
}

/// dX: dX~ = dH W1_e (grouped), dX = gather-sum of dX~, and the router's gradients (dlogits from dS, dx += dlogits
/// W_r, dW_r). Runs after backward_dh_phase returned true.
/// Where dlogits is nonzero only at each token's selections (router_term_from_pairs: top-K, a renormalised score,
/// no upstream gradient of the logits), the router's backward runs first and also leaves each pair's dz and expert,
/// and the gather-sum adds dz W_r[expert] per pair as it sums the token's dX~ rows: dX is written once. The dense
/// product dlogits W_r (a GEMM with beta = 1) read and wrote all of dX again after the gather-sum had written it:
/// 4 T d bytes for a term of K rows of W_r per token. Otherwise that GEMM runs, after the gather-sum.
void backward_dx_phase(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const BackwardInputs& in,
                       const BackwardOutputs& out, const SavedState& sv, void* workspace,
                       const BackwardWorkspaceLayout& wl, const void* dh, cudaStream_t stream) {
  const DType dt = x.dtype;
  const bool accumulate = out.grad_weights.accumulate;
  const float* scores = sv.scores;
  const std::int32_t *offsets = sv.offsets, *inverse = sv.inverse, *token_offsets = sv.token_offsets;
  const std::int32_t* tiles = at<std::int32_t>(workspace, wl.expert_tiles);
  const bool caller = p.routing == RoutingMode::kCallerSupplied;
  const float* ds = caller ? static_cast<const float*>(out.grad_scores.data) : at<float>(workspace, wl.ds);
  void* dlogits = caller ? nullptr : at(workspace, wl.dlogits);
  const void* upstream = in.grad_router_logits.empty() ? nullptr : in.grad_router_logits.data;
  const std::int64_t ld_up = in.grad_router_logits.empty() ? 0 : in.grad_router_logits.stride[0];

  // dlogits from dS (+ the caller's gradient of the logits): first where the gather-sum takes the router's term.
  auto router_backward = [&](RouterPairTerm* pair_terms) {
    mark_stage("backward/router_backward", stream);
    if (p.routing == RoutingMode::kTokenRounding)
      launch_token_rounding_backward(dt, p.score, sv.router_logits, p.T, p.E, sv.token_selection, ds, inverse,
                                     offsets, token_offsets, upstream, ld_up, dlogits, stream);
    else
      launch_router_backward(dt, p.score, scores, ds, inverse, offsets, sv.router_logits, p.T, p.E, p.K, upstream,
                             ld_up, dlogits, pair_terms, stream);
  };
  GatherRouterTerm router_term;
  // The gather-sum reads W_r's rows 16 bytes at a time where the other rows allow it; a router weight whose rows
  // do not (an offset view) keeps the GEMM, so that it does not turn the whole sum to element-wise loads.
  const std::int64_t vec = 16 / static_cast<std::int64_t>(dtype_size(dt));
  const bool wr_rows_aligned = (reinterpret_cast<std::uintptr_t>(w.router_weight.data) & 15u) == 0 &&
                               w.router_weight.stride[0] % vec == 0;
  const bool term_in_sum =
      router_term_from_pairs(p, upstream != nullptr) && wl.router_pair_terms.present() && wr_rows_aligned;
  if (term_in_sum) {
    auto* pair_terms = at<RouterPairTerm>(workspace, wl.router_pair_terms);
    router_backward(pair_terms);
    router_term = {w.router_weight.data, w.router_weight.stride[0], pair_terms};
  }

  // dX~ = dH W1_e (grouped), then dX = gather-sum of dX~, at once, or one chunk of tokens at a time (memory.hpp,
  // backward_dx_chunks), each chunk's rows packed in the dX~ region and its tokens' sums finished before the next.
  const VarlenMArgs dxa = dx_expanded_args(p, dt, w, sv, tiles, dh, at(workspace, wl.dx_expanded));
  gemm_then_gather_sum(p, dxa, "backward/dx_expanded", "backward/dx_aggregation", "backward/dx_chunk_plan",
                       backward_dx_chunks(p), backward_dx_chunk_rows(p),
                       {offsets, sv.gather, sv.scatter, inverse, token_offsets},
                       {at<std::int32_t>(workspace, wl.dx_chunk_plan), at<std::int32_t>(workspace, wl.dx_pair_rows)},
                       nullptr, router_term, out.grad_x, stream);

  if (caller) {
    mark_stage(nullptr, stream);
    // No router in the layer: its gradient is zero, and accumulating zero leaves the buffer as it is.
    if (!accumulate) zero_view(out.grad_weights.router_weight, stream);
    return;
  }
  if (!term_in_sum) router_backward(nullptr);
  mark_stage("backward/router_gemms", stream);
  cublasHandle_t hd = prepared_cublas(x.device.index, stream, at(workspace, wl.cublas));
  if (!term_in_sum) {
    // dx (T x d row-major = col-major d x T) += W_r^T-view: col-major (d x E) * dlogits^T-view (E x T).
    gemm(hd, dt, CUBLAS_OP_N, CUBLAS_OP_N, p.d, p.T, p.E, w.router_weight.data, w.router_weight.stride[0], dlogits,
         p.E, 1.0f, out.grad_x.data, out.grad_x.stride[0], dt);
  }
  // dW_r (E x d row-major = col-major d x E) = x^T-view (d x T) * dlogits (T x E), (+ dW_r when accumulating).
  const TensorView& gr = out.grad_weights.router_weight;
  gemm(hd, dt, CUBLAS_OP_N, CUBLAS_OP_T, p.d, p.E, p.T, x.data, x.stride[0], dlogits, p.E, accumulate ? 1.0f : 0.0f,
       gr.data, gr.stride[0], gr.dtype);
  mark_stage(nullptr, stream);
}

/// dW2: db2 and dW2 (from dO and A'). Needs no workspace.
void backward_w2_phase(const MoEProblem& p, const TensorView& x, const TensorView& grad_out,
                       const BackwardOutputs& out, const SavedState& sv, const void* a_prime, cudaStream_t stream) {
  const DType dt = x.dtype;
  const LayerWeightGrads& gw = out.grad_weights;
  const bool accumulate = gw.accumulate;
  if (p.max_pairs() == 0) {
    // No routed pairs: every expert's weight gradient is zero (the caller's buffers may hold anything), and
    // accumulating it leaves them as they are.
    if (!accumulate)
      for (const TensorView* g : {&gw.w2, &gw.b2}) zero_view(*g, stream);
    return;
  }
  const float* scores = sv.scores;
  const std::int32_t *offsets = sv.offsets, *scatter = sv.scatter, *gather = sv.gather;
  mark_stage("backward/db2", stream);
  if (p.has_b2)
    launch_segment_column_sum(dt, grad_out.data, grad_out.stride[0], gather, scores, scatter, offsets, p.E, p.d, 0,
                              gw.b2.data, gw.b2.stride[0], gw.b2.dtype, accumulate, stream);
  mark_stage("backward/dw2", stream);
  launch_weight_gemm(dw2_args(p, dt, grad_out, gw, sv, a_prime), "backward/dw2", stream);
  mark_stage(nullptr, stream);
}

/// dW1: dW1 (from dH and X) and db1 (from dH). Needs no workspace.
void backward_w1_phase(const MoEProblem& p, const TensorView& x, const BackwardOutputs& out, const SavedState& sv,
                       const void* dh, cudaStream_t stream) {
  const DType dt = x.dtype;
  const std::int64_t rows = p.w1_rows();
  const LayerWeightGrads& gw = out.grad_weights;
  const bool accumulate = gw.accumulate;
  if (p.max_pairs() == 0) {
    if (!accumulate)
      for (const TensorView* g : {&gw.w1, &gw.b1}) zero_view(*g, stream);
    return;
  }
  const std::int32_t* offsets = sv.offsets;
  const bool concat = p.weight_layout == WeightLayout::kConcatenated;
  mark_stage("backward/dw1", stream);
  launch_weight_gemm(dw1_args(p, dt, x, gw, sv, dh), "backward/dw1", stream);
  mark_stage("backward/db1", stream);
  if (p.has_b1)
    launch_segment_column_sum(dt, dh, rows, nullptr, nullptr, nullptr, offsets, p.E, rows, concat ? p.n : 0,
                              gw.b1.data, gw.b1.stride[0], gw.b1.dtype, accumulate, stream);
  mark_stage(nullptr, stream);
}

}  // namespace

void backward_cuda(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
                   const BackwardInputs& in, const BackwardOutputs& out, const BackwardBuffers& buf,
                   void* stream_ptr) {
  (void)routing;
  const DeviceGuard guard(x.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const BackwardWorkspaceLayout wl = backward_workspace_layout(p, x.dtype, false, buf.consume_saved);
  const SavedState sv = saved_state(p, x.dtype, buf.saved);
  // A consumed saved buffer takes dH over its H (the dH kernel reads each element before it writes it, as over the
  // recomputed H of input-only mode): the caller handed that memory over (layer.hpp, BackwardBuffers).
  void* dh = wl.dh.present() ? at(buf.workspace, wl.dh) : const_cast<void*>(sv.h);
  void* a_prime = at(buf.workspace, wl.a_prime);  // the region dX~ takes after dW2 (memory.hpp)
  refuse_input_phase_fallbacks(p, x, w, in.grad_out, sv, buf.workspace, wl, dh, a_prime);
  refuse_weight_phase_fallbacks(p, x, in.grad_out, out.grad_weights, sv, a_prime, dh, true, !out.w1_grads_later);
  const bool routed = backward_dh_phase(p, x, w, in, out, sv, buf.workspace, wl, dh, a_prime, stream);
  backward_w2_phase(p, x, in.grad_out, out, sv, a_prime, stream);
  if (routed) backward_dx_phase(p, x, w, in, out, sv, buf.workspace, wl, dh, stream);
  // With w1_grads_later (validated: consume_saved in preact mode), dH stays over the saved H for
  // finish_backward_w1_cuda, which the caller runs once it has freed this workspace.
  if (!out.w1_grads_later) backward_w1_phase(p, x, out, sv, dh, stream);
}

void finish_backward_w1_cuda(const MoEProblem& p, const TensorView& x, const BackwardOutputs& out, const void* saved,
                             void* stream_ptr) {
  const DeviceGuard guard(x.device.index);
  const SavedState sv = saved_state(p, x.dtype, saved);
  refuse_weight_phase_fallbacks(p, x, TensorView{}, out.grad_weights, sv, nullptr, sv.h, false, true);
  backward_w1_phase(p, x, out, sv, sv.h, static_cast<cudaStream_t>(stream_ptr));
}

void backward_input_cuda(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const BackwardInputs& in,
                         const BackwardOutputs& out, const BackwardBuffers& buf, const DeferredBuffer& deferred,
                         void* stream_ptr) {
  const DeviceGuard guard(x.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeferredLayout dl = deferred_layout(p, x.dtype);
  const BackwardWorkspaceLayout wl = backward_workspace_layout(p, x.dtype, true);
  void* dh = at(deferred.data, dl.dh);
  const SavedState sv = saved_state(p, x.dtype, buf.saved);
  refuse_input_phase_fallbacks(p, x, w, in.grad_out, sv, buf.workspace, wl, dh, at(deferred.data, dl.a_prime));
  if (backward_dh_phase(p, x, w, in, out, sv, buf.workspace, wl, dh, at(deferred.data, dl.a_prime), stream))
    backward_dx_phase(p, x, w, in, out, sv, buf.workspace, wl, dh, stream);
}

void backward_weight_cuda(const MoEProblem& p, const TensorView& x, const TensorView& grad_out,
                          const BackwardOutputs& out, const void* saved, const DeferredBuffer& deferred,
                          void* stream_ptr) {
  const DeviceGuard guard(x.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const DeferredLayout dl = deferred_layout(p, x.dtype);
  const SavedState sv = saved_state(p, x.dtype, saved);
  refuse_weight_phase_fallbacks(p, x, grad_out, out.grad_weights, sv, at(deferred.data, dl.a_prime),
                                at(deferred.data, dl.dh), true, true);
  backward_w2_phase(p, x, grad_out, out, sv, at(deferred.data, dl.a_prime), stream);
  backward_w1_phase(p, x, out, sv, at(deferred.data, dl.dh), stream);
}

// ---- index checking: public entry points ------------------------------------------------------------------------

void raise_recorded_index_violation(int ordinal, const char* where, void* stream_ptr) {
  IndexViolationRecord found{};
  {
    const std::lock_guard<std::mutex> lock(index_status_mutex());
    const auto it = index_statuses().find(ordinal);
    if (it == index_statuses().end() || it->second.host->ready == 0) return;
    std::atomic_thread_fence(std::memory_order_acquire);  // the fields were published before `ready`
    const IndexViolationRecord& r = *it->second.host;
    found.violation = r.violation, found.position = r.position, found.value = r.value, found.bound = r.bound;
    it->second.host->ready = 0;
    // Re-arm in stream order: launches still in flight cannot record any more (the claim is taken), later ones can.
    const DeviceGuard guard(ordinal);
    MACHMOE_CUDA_CHECK(cudaMemsetAsync(it->second.claim, 0, sizeof(std::int32_t),
                                        static_cast<cudaStream_t>(stream_ptr)));
  }
  throw_violation(found, ordinal, where);
}

void check_device_errors_cuda(int ordinal, void* stream_ptr) {
  {
    const std::lock_guard<std::mutex> lock(index_status_mutex());
    if (index_statuses().count(ordinal) == 0) return;  // no checked call ever ran on this device
  }
  {
    const DeviceGuard guard(ordinal);
    MACHMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_ptr)));
  }
  raise_recorded_index_violation(ordinal, "check_device_errors", stream_ptr);
}

void grouped_expert_index_cuda(const TensorView& counts, const TensorView& expert_index, void* stream_ptr) {
  const DeviceGuard guard(counts.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  raise_recorded_index_violation(counts.device.index, "grouped_expert_index", stream_ptr);
  launch_grouped_expert_index(counts.data, counts.dtype, counts.shape[0], expert_index.data, expert_index.dtype,
                              expert_index.shape[0], index_check_for(counts.device.index, stream), stream);
}

void combine_rows_cuda(const TensorView& rows, const TensorView& scores, const TensorView& row_of_pair,
                       const TensorView& token_offsets, std::int64_t top_k, const TensorView& out, void* stream_ptr) {
  const DeviceGuard guard(rows.device.index);
  launch_gather_sum(rows.dtype, rows.data, rows.shape[1], static_cast<const float*>(scores.data), {},
                    static_cast<const std::int32_t*>(row_of_pair.data),
                    static_cast<const std::int32_t*>(token_offsets.data), top_k, out.shape[0], out.data, out.shape[1],
                    static_cast<cudaStream_t>(stream_ptr), nullptr, 0, rows.shape[0], row_of_pair.shape[0]);
}

void combine_rows_backward_cuda(const TensorView& grad_out, const TensorView& rows, const TensorView& scores,
                                const TensorView& row_of_pair, const TensorView& token_offsets, std::int64_t top_k,
                                const TensorView& grad_rows, const TensorView& grad_scores, void* stream_ptr) {
  const DeviceGuard guard(rows.device.index);
  launch_combine_rows_backward(rows.dtype, grad_out.data, rows.data, rows.shape[0], rows.shape[1],
                               static_cast<const float*>(scores.data),
                               static_cast<const std::int32_t*>(row_of_pair.data),
                               static_cast<const std::int32_t*>(token_offsets.data), top_k, grad_out.shape[0],
                               row_of_pair.shape[0], grad_rows.data, static_cast<float*>(grad_scores.data),
                               static_cast<cudaStream_t>(stream_ptr));
}

}  // namespace machmoe::gpu
