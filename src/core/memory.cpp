#include "machmoe/memory.hpp"

#include <algorithm>
#include <string>

#include "machmoe/error.hpp"

namespace machmoe {

namespace {
/// Appends regions at kRegionAlignment boundaries.
class LayoutBuilder {
 public:
  BufferRegion add(std::size_t bytes) {
    if (bytes == 0) return {};
    BufferRegion r{end_, bytes};
    end_ += (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
    return r;
  }
  std::size_t total() const { return end_; }

 private:
  std::size_t end_ = 0;
};

std::size_t u(std::int64_t v) { return static_cast<std::size_t>(v); }
std::size_t aligned(std::size_t b) { return (b + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment; }

/// The cuBLAS region: kCublasWorkspaceBytes and the slack that lets the GPU path round its start up to the next
/// kCublasWorkspaceAlignment address inside it (memory.hpp; src/gpu/layer_cuda.cpp, prepared_cublas): regions sit at
/// multiples of kRegionAlignment from a workspace start that need only be kBufferAlignment aligned.
constexpr std::size_t kCublasRegionBytes = kCublasWorkspaceBytes + kCublasWorkspaceAlignment;

/// What every public sizing function checks first, once: a problem the layer accepts (the formulas below divide by
/// n and E and widen T, E and P to size_t, so an unchecked one divides by zero or wraps to a huge size) and a data
/// dtype the layer runs on. The public functions call the unchecked *_of helpers, never one another.
void validate_sizing(const MoEProblem& p, const char* where) { validate_problem(p, where); }
void validate_sizing(const MoEProblem& p, DType data_dtype, const char* where) {
  validate_problem(p, where);
  if (data_dtype != DType::kBF16 && data_dtype != DType::kFP16 && data_dtype != DType::kFP32 &&
      data_dtype != DType::kFP64)
    throw_argument_error(where, "data_dtype", "the layer's data dtype: bf16, fp16, fp32 or fp64",
                         is_floating(data_dtype) ? "dtype code " + std::to_string(static_cast<int>(data_dtype))
                                                 : std::string(dtype_name(data_dtype)));
}
}  // namespace

DType score_dtype(DType data_dtype) { return data_dtype == DType::kFP64 ? DType::kFP64 : DType::kFP32; }

namespace {
SavedLayout saved_layout_of(const MoEProblem& p, DType data_dtype) {
  const std::size_t elem = dtype_size(data_dtype), P = u(p.max_pairs()), i32 = 4;
  LayoutBuilder b;
  SavedLayout l;
  if (p.cache == CacheMode::kPreActivation) l.h = b.add(P * u(p.w1_rows()) * elem);
  if (p.keeps_router_logits()) l.router_logits = b.add(u(p.T) * u(p.E) * elem);
  l.scores = b.add(P * dtype_size(score_dtype(data_dtype)));
  l.scatter = b.add(P * i32);
  l.inverse = b.add(P * i32);
  l.gather = b.add(P * i32);
  l.expert_offsets = b.add(u(p.E + 1) * i32);
  if (p.variable_k()) l.token_offsets = b.add(u(p.T + 1) * i32);
  if (p.routing == RoutingMode::kTokenRounding) l.token_selection = b.add(u(p.T) * kTokenSelectionStatsBytes);
  l.total_bytes = b.total();
  return l;
}
}  // namespace

SavedLayout saved_layout(const MoEProblem& p, DType data_dtype) {
  validate_sizing(p, data_dtype, "saved_layout");
  return saved_layout_of(p, data_dtype);
}

ActivationMemory activation_memory(const MoEProblem& p, DType data_dtype) {
  validate_sizing(p, data_dtype, "activation_memory");
  const SavedLayout l = saved_layout_of(p, data_dtype);
  ActivationMemory m;
  m.x_bytes = u(p.T) * u(p.d) * dtype_size(data_dtype);
  m.h_bytes = aligned(l.h.bytes);
  m.logits_bytes = aligned(l.router_logits.bytes);
  m.saved_bytes = l.total_bytes;
  m.metadata_bytes = m.saved_bytes - m.h_bytes - m.logits_bytes;
  return m;
}

namespace {
/// The token-chunk heuristic of backward_dx_chunks (memory.hpp), without the problem's override.
std::int64_t heuristic_dx_chunks(const MoEProblem& p) {
  const std::int64_t P = p.max_pairs();
  if (P == 0 || p.E == 0) return 1;
  const std::int64_t by_size = (p.d + p.n - 1) / p.n;
  const std::int64_t by_rows = P / (p.E * kDxChunkMinRowsPerExpert);
  return std::max<std::int64_t>(1, std::min({by_size, by_rows, kDxChunksMax}));
}

/// Rows one chunk of C can hold: ceil(P / C) pairs and the rest of the pairs of the chunk's last token.
std::int64_t token_chunk_rows(const MoEProblem& p, std::int64_t C) {
  const std::int64_t P = p.max_pairs();
  if (C == 1) return P;
  const std::int64_t per_token = p.routing == RoutingMode::kTokenRounding ? p.E : p.K;
  return std::min(P, (P + C - 1) / C + per_token - 1);
}

std::int64_t backward_dx_chunks_of(const MoEProblem& p) {
  return p.dx_chunks > 0 ? p.dx_chunks : heuristic_dx_chunks(p);
}

std::int64_t forward_y_chunks_of(const MoEProblem& p) {
  if (p.y_chunks > 0) return p.y_chunks;
  const std::int64_t C = heuristic_dx_chunks(p);
  if (C == 1) return 1;
  // Elements (the data dtype is common to every term). Doubles: P d reaches 2^40 and more within the limits.
  const double P = static_cast<double>(p.max_pairs()), T = static_cast<double>(p.T), d = static_cast<double>(p.d),
               n = static_cast<double>(p.n), E = static_cast<double>(p.E);
  const double R = static_cast<double>(token_chunk_rows(p, C));
  const double forward = P * n + P * d + T * d;
  const double backward = std::max(P * n, R * d) + 2 * T * d + E * n * d;
  return forward > backward ? C : 1;
}

std::int64_t forward_y_chunk_rows_of(const MoEProblem& p) { return token_chunk_rows(p, forward_y_chunks_of(p)); }

ForwardWorkspaceLayout forward_workspace_layout_of(const MoEProblem& p, DType data_dtype) {
  const std::size_t elem = dtype_size(data_dtype), P = u(p.max_pairs());
  LayoutBuilder b;
  ForwardWorkspaceLayout l;
  l.a = b.add(P * u(p.n) * elem);
  l.y = b.add(u(forward_y_chunk_rows_of(p)) * u(p.d) * elem);
  const std::size_t chunks = u(forward_y_chunks_of(p));
  if (chunks > 1) {
    l.y_chunk_plan = b.add((chunks + 1 + chunks * (3 * u(p.E) + 2)) * 4);
    l.y_pair_rows = b.add(P * 4);
  }
  l.pair_expert = b.add(P * 4);
  if (p.variable_k()) l.pair_token = b.add(P * 4);
  const std::size_t metadata_tiles = (P + u(kMetadataTilePairs) - 1) / u(kMetadataTilePairs);
  if (metadata_tiles > 0) l.tile_hist = b.add((u(p.E) * metadata_tiles + 1) * 4);  // + the scan's block counter
  l.expert_tiles = b.add(u(p.E + 1) * 4);
  if (p.routing != RoutingMode::kCallerSupplied) l.cublas = b.add(kCublasRegionBytes);
  if (p.routing == RoutingMode::kTokenRounding) {
    if (p.E > kTokenRoundingRegisterExperts) l.tr_keys = b.add(u(p.T) * u(p.E) * 4);
    l.tr_keys_by_expert = b.add(u(p.T) * u(p.E) * 4);
    l.tr_thresholds = b.add(u(p.E) * 8);
    l.tr_bounds = b.add(u(p.E) * ((u(p.T) + 31) / 32) * 16);
    l.tr_row_scores = b.add(P * 4);
    l.tr_counters = b.add(u(TokenRoundingCounters::of(p.T, p.E).words) * 4);
  }
  l.total_bytes = b.total();
  return l;
}

BackwardWorkspaceLayout backward_workspace_layout_of(const MoEProblem& p, DType data_dtype, bool split,
                                                     bool consume_saved) {
  const std::size_t elem = dtype_size(data_dtype), P = u(p.max_pairs());
  const std::int64_t C = backward_dx_chunks_of(p);
  const std::size_t chunks = u(C), rows = u(token_chunk_rows(p, C));
  LayoutBuilder b;
  BackwardWorkspaceLayout l;
  if (p.cache == CacheMode::kInputOnly) l.h_recompute = b.add(P * u(p.w1_rows()) * elem);
  if (!split) {
    // The dH kernel reads each element of H once, before it writes that element's dH, so dH may overwrite the
    // recomputed H in place. The H the forward kept (kPreActivation) belongs to the caller: it is overwritten only
    // when the caller hands the saved buffer over (consume_saved), and dH then needs no region here.
    if (l.h_recompute.present()) l.dh = l.h_recompute;
    else if (!consume_saved) l.dh = b.add(P * u(p.w1_rows()) * elem);
    // A' is dead once dW2 has run, and the full backward runs dW2 before dX~: the two share one region.
    const BufferRegion shared = b.add(std::max(P * u(p.n), rows * u(p.d)) * elem);
    if (shared.present()) {
      l.a_prime = {shared.offset, P * u(p.n) * elem};
      l.dx_expanded = {shared.offset, rows * u(p.d) * elem};
    }
  } else {
    l.dx_expanded = b.add(rows * u(p.d) * elem);
  }
  if (chunks > 1) {
    l.dx_chunk_plan = b.add((chunks + 1 + chunks * (3 * u(p.E) + 2)) * 4);
    l.dx_pair_rows = b.add(P * 4);
  }
  l.ds_partial = b.add(P * ((u(p.n) + 63) / 64) * 4);
  l.ds = b.add(P * dtype_size(score_dtype(data_dtype)));
  if (p.routing != RoutingMode::kCallerSupplied) l.dlogits = b.add(u(p.T) * u(p.E) * elem);
  // Each pair's dz and expert (8 bytes), for the router's term of dX inside the gather-sum, where the logits'
  // gradient lives at the selections (top-K with a renormalised score; src/gpu/kernels.hpp, RouterPairTerm).
  if (p.logit_grad_at_selections()) l.router_pair_terms = b.add(P * 8);
  l.expert_tiles = b.add(u(p.E + 1) * 4);
  if (p.routing != RoutingMode::kCallerSupplied) l.cublas = b.add(kCublasRegionBytes);
  l.total_bytes = b.total();
  return l;
}
}  // namespace

std::int64_t backward_dx_chunks(const MoEProblem& p) {
  validate_sizing(p, "backward_dx_chunks");
  return backward_dx_chunks_of(p);
}

std::int64_t backward_dx_chunk_rows(const MoEProblem& p) {
  validate_sizing(p, "backward_dx_chunk_rows");
  return token_chunk_rows(p, backward_dx_chunks_of(p));
}

std::int64_t forward_y_chunks(const MoEProblem& p) {
  validate_sizing(p, "forward_y_chunks");
  return forward_y_chunks_of(p);
}

std::int64_t forward_y_chunk_rows(const MoEProblem& p) {
  validate_sizing(p, "forward_y_chunk_rows");
  return forward_y_chunk_rows_of(p);
}

ForwardWorkspaceLayout forward_workspace_layout(const MoEProblem& p, DType data_dtype) {
  validate_sizing(p, data_dtype, "forward_workspace_layout");
  return forward_workspace_layout_of(p, data_dtype);
}

BackwardWorkspaceLayout backward_workspace_layout(const MoEProblem& p, DType data_dtype, bool split,
                                                  bool consume_saved) {
  validate_sizing(p, data_dtype, "backward_workspace_layout");
  return backward_workspace_layout_of(p, data_dtype, split, consume_saved);
}

DeferredLayout deferred_layout(const MoEProblem& p, DType data_dtype) {
  validate_sizing(p, data_dtype, "deferred_layout");
  const std::size_t elem = dtype_size(data_dtype), P = u(p.max_pairs());
  LayoutBuilder b;
  DeferredLayout l;
  l.dh = b.add(P * u(p.w1_rows()) * elem);
  l.a_prime = b.add(P * u(p.n) * elem);
  l.total_bytes = b.total();
  return l;
}

// The problem is checked for the cpu too, where the answer is 0: a problem the layer rejects has no size anywhere.
std::size_t backward_input_workspace_bytes(const MoEProblem& p, DType data_dtype, Device device) {
  validate_sizing(p, data_dtype, "backward_input_workspace_bytes");
  return device.type == DeviceType::kCPU ? 0 : backward_workspace_layout_of(p, data_dtype, true, false).total_bytes;
}

std::size_t forward_workspace_bytes(const MoEProblem& p, DType data_dtype, Device device) {
  validate_sizing(p, data_dtype, "forward_workspace_bytes");
  return device.type == DeviceType::kCPU ? 0 : forward_workspace_layout_of(p, data_dtype).total_bytes;
}

std::size_t backward_workspace_bytes(const MoEProblem& p, DType data_dtype, Device device, bool consume_saved) {
  validate_sizing(p, data_dtype, "backward_workspace_bytes");
  return device.type == DeviceType::kCPU
             ? 0
             : backward_workspace_layout_of(p, data_dtype, false, consume_saved).total_bytes;
}

}  // namespace machmoe
