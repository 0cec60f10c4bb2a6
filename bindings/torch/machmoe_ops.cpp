// PyTorch operators over the torch-free C++ API, registered with TORCH_LIBRARY so one shared library serves every
// Python version (loaded by torch.ops.load_library). CPU tensors (fp32/fp64) run the float reference, CUDA tensors
// (bf16/fp16/fp32) the GPU runtime on the current stream. Workspaces come from torch's caching allocator; the forward
// returns its `saved` buffer as a uint8 tensor that autograd keeps for the backward (python/machmoe/_ops.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "machmoe/machmoe.hpp"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

machmoe::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return machmoe::DType::kBF16;
    case at::kHalf: return machmoe::DType::kFP16;
    case at::kFloat: return machmoe::DType::kFP32;
    case at::kDouble: return machmoe::DType::kFP64;
    case at::kInt: return machmoe::DType::kInt32;
    case at::kLong: return machmoe::DType::kInt64;
    default: TORCH_CHECK(false, "machmoe: unsupported dtype ", t);
  }
}

machmoe::TensorView view(const Tensor& t) {
  machmoe::TensorView v;
  TORCH_CHECK(t.dim() <= machmoe::kMaxRank, "machmoe: tensors of rank <= 4, got rank ", t.dim());
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.device = t.is_cuda() ? machmoe::Device::cuda(t.get_device()) : machmoe::Device::cpu();
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) v.shape[i] = t.size(i), v.stride[i] = t.stride(i);
  return v;
}

machmoe::TensorView view(const OptTensor& t) { return t && t->defined() ? view(*t) : machmoe::TensorView(); }

/// The problem from the operands and the integer options (enum values of machmoe/problem.hpp).
machmoe::MoEProblem problem_of(const Tensor& x, const Tensor& w1, const Tensor& w2, const OptTensor& b1,
                                const OptTensor& b2, const OptTensor& token_index, int64_t top_k, int64_t activation,
                                int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile,
                                int64_t cache) {
  TORCH_CHECK(x.dim() == 2, "machmoe: argument 'x': expected a (T, d) tensor, got shape ", x.sizes());
  TORCH_CHECK(w1.dim() == 3, "machmoe: argument 'w1': expected an (E, 2n or n, d) tensor, got shape ", w1.sizes());
  TORCH_CHECK(w2.dim() == 3, "machmoe: argument 'w2': expected an (E, d, n) tensor, got shape ", w2.sizes());
  machmoe::MoEProblem p;
  p.T = x.size(0), p.d = x.size(1), p.E = w1.size(0), p.n = w2.size(2), p.K = top_k;
  p.activation = static_cast<machmoe::Activation>(activation);
  p.weight_layout = static_cast<machmoe::WeightLayout>(weight_layout);
  p.score = static_cast<machmoe::ScoreVariant>(score);
  p.routing = static_cast<machmoe::RoutingMode>(routing);
  p.rounding = static_cast<machmoe::RoundingRule>(rounding);
  p.tile_m = tile;
  p.cache = static_cast<machmoe::CacheMode>(cache);
  p.has_b1 = b1 && b1->defined();
  p.has_b2 = b2 && b2->defined();
  if (p.routing == machmoe::RoutingMode::kCallerSupplied && token_index) p.num_pairs = token_index->size(0);
  return p;
}

void* stream_for(const Tensor& x) {
  return x.is_cuda() ? static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.get_device()).stream()) : nullptr;
}

machmoe::LayerWeights weights_of(const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
                                  const Tensor& w2, const OptTensor& b2) {
  machmoe::LayerWeights w;
  w.router_weight = view(router_weight);
  w.w1 = view(w1), w.b1 = view(b1), w.w2 = view(w2), w.b2 = view(b2);
  return w;
}

machmoe::RoutingTriples triples_of(bool caller, const OptTensor& token_index, const OptTensor& expert_index,
                                    const OptTensor& scores) {
  machmoe::RoutingTriples r;
  if (!caller) return r;
  TORCH_CHECK(token_index && expert_index && scores,
              "machmoe: routing 'caller' needs token_index, expert_index and scores");
  r.token_index = view(*token_index), r.expert_index = view(*expert_index), r.score = view(*scores);
  return r;
}

at::ScalarType score_type(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

machmoe::Device library_device(const Tensor& x) {
  return x.is_cuda() ? machmoe::Device::cuda(x.get_device()) : machmoe::Device::cpu();
}

Tensor byte_buffer(const Tensor& x, std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_forward(
    const Tensor& x, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
    const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index, const OptTensor& scores,
    int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding,
    int64_t tile, int64_t cache) {
  const machmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  machmoe::validate_problem(p, "forward");
  const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
  const machmoe::DType dt = to_dtype(x.scalar_type());
  Tensor out = at::empty({p.T, p.d}, x.options());
  Tensor logits = caller ? at::empty({0}, x.options()) : at::empty({p.T, p.E}, x.options());
  Tensor counts = at::empty({p.E}, x.options().dtype(at::kInt));
  Tensor saved = byte_buffer(x, machmoe::saved_layout(p, dt).total_bytes);
  Tensor workspace = byte_buffer(x, machmoe::forward_workspace_bytes(p, dt, library_device(x)));
  const machmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  machmoe::ForwardOutputs fo;
  fo.out = view(out);
  if (!caller) fo.router_logits = view(logits);
  fo.expert_counts = view(counts);
  machmoe::forward(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr, fo,
                    {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                     static_cast<std::size_t>(workspace.numel())},
                    stream_for(x));
  return {out, logits, counts, saved};
}

/// Upstream gradients and the input-gradient outputs of a backward (kept alive while the views are used).
struct InputGrads {
  Tensor go, dx, dwr, dscores;
  OptTensor gl;
  machmoe::BackwardInputs inputs;

  InputGrads(const machmoe::MoEProblem& p, const Tensor& x, const Tensor& grad_out, const OptTensor& grad_logits) {
    const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
    go = grad_out.contiguous();
    if (grad_logits && grad_logits->defined() && !caller) gl = grad_logits->contiguous();
    dx = at::empty({p.T, p.d}, x.options());
    dwr = caller ? at::empty({0}, x.options()) : at::empty({p.E, p.d}, x.options());
    dscores = caller ? at::empty({p.num_pairs}, x.options().dtype(score_type(x))) : at::empty({0}, x.options());
    inputs.grad_out = view(go);
    inputs.grad_router_logits = view(gl);
  }
  void attach(const machmoe::MoEProblem& p, machmoe::BackwardOutputs& bo) const {
    bo.grad_x = view(dx);
    if (p.routing == machmoe::RoutingMode::kCallerSupplied) bo.grad_scores = view(dscores);
    else bo.grad_weights.router_weight = view(dwr);
  }
};

/// The expert weight-gradient outputs of a backward.
struct WeightGrads {
  Tensor dw1, db1, dw2, db2;

  WeightGrads(const machmoe::MoEProblem& p, const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
              const OptTensor& b2) {
    dw1 = at::empty(w1.sizes(), x.options()), dw2 = at::empty(w2.sizes(), x.options());
    db1 = p.has_b1 ? at::empty(b1->sizes(), x.options()) : at::empty({0}, x.options());
    db2 = p.has_b2 ? at::empty(b2->sizes(), x.options()) : at::empty({0}, x.options());
  }
  void attach(const machmoe::MoEProblem& p, machmoe::BackwardOutputs& bo) const {
    bo.grad_weights.w1 = view(dw1), bo.grad_weights.w2 = view(dw2);
    if (p.has_b1) bo.grad_weights.b1 = view(db1);
    if (p.has_b2) bo.grad_weights.b2 = view(db2);
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layer_backward(
    const Tensor& grad_out, const OptTensor& grad_logits, const Tensor& x, const OptTensor& router_weight,
    const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2, const OptTensor& token_index,
    const OptTensor& expert_index, const OptTensor& scores, const Tensor& saved, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache) {
  const machmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  machmoe::validate_problem(p, "backward");
  const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
  Tensor workspace = byte_buffer(x, machmoe::backward_workspace_bytes(p, to_dtype(x.scalar_type()), library_device(x)));
  const InputGrads ig(p, x, grad_out, grad_logits);
  const WeightGrads wg(p, x, w1, b1, w2, b2);
  machmoe::BackwardOutputs bo;
  ig.attach(p, bo);
  wg.attach(p, bo);
  const machmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  machmoe::backward(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr, ig.inputs,
                     bo,
                     {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                      static_cast<std::size_t>(workspace.numel())},
                     stream_for(x));
  return {ig.dx, ig.dwr, wg.dw1, wg.db1, wg.dw2, wg.db2, ig.dscores};
}

/// The split backward's input half: (grad_x, grad_router_weight, grad_scores, deferred).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_backward_input(
    const Tensor& grad_out, const OptTensor& grad_logits, const Tensor& x, const OptTensor& router_weight,
    const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2, const OptTensor& token_index,
    const OptTensor& expert_index, const OptTensor& scores, const Tensor& saved, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache) {
  const machmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  machmoe::validate_problem(p, "backward_input");
  const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
  const machmoe::DType dt = to_dtype(x.scalar_type());
  Tensor workspace = byte_buffer(x, machmoe::backward_input_workspace_bytes(p, dt, library_device(x)));
  Tensor deferred = byte_buffer(x, machmoe::deferred_layout(p, dt).total_bytes);
  const InputGrads ig(p, x, grad_out, grad_logits);
  machmoe::BackwardOutputs bo;
  ig.attach(p, bo);
  const machmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  machmoe::backward_input(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr,
                           ig.inputs, bo,
                           {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                            static_cast<std::size_t>(workspace.numel())},
                           {deferred.data_ptr(), static_cast<std::size_t>(deferred.numel())}, stream_for(x));
  return {ig.dx, ig.dwr, ig.dscores, deferred};
}

/// The split backward's weight half: (grad_w1, grad_b1, grad_w2, grad_b2).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_backward_weight(
    const Tensor& grad_out, const Tensor& x, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
    const Tensor& w2, const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index,
    const OptTensor& scores, const Tensor& saved, const Tensor& deferred, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache) {
  const machmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  machmoe::validate_problem(p, "backward_weight");
  const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
  const Tensor go = grad_out.contiguous();
  const WeightGrads wg(p, x, w1, b1, w2, b2);
  machmoe::BackwardOutputs bo;
  wg.attach(p, bo);
  const machmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  machmoe::backward_weight(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr,
                            view(go), bo, saved.data_ptr(), static_cast<std::size_t>(saved.numel()),
                            {deferred.data_ptr(), static_cast<std::size_t>(deferred.numel())}, stream_for(x));
  return {wg.dw1, wg.db1, wg.dw2, wg.db2};
}

/// Size of the saved buffer, for the fake (meta) implementation used by torch.compile.
int64_t saved_nbytes(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, int64_t num_pairs, int64_t activation,
                     int64_t score, int64_t routing, int64_t tile, int64_t cache, int64_t elem_size) {
  machmoe::MoEProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.K = K, p.num_pairs = num_pairs, p.tile_m = tile;
  p.activation = static_cast<machmoe::Activation>(activation);
  p.score = static_cast<machmoe::ScoreVariant>(score);
  p.routing = static_cast<machmoe::RoutingMode>(routing);
  p.cache = static_cast<machmoe::CacheMode>(cache);
  const machmoe::DType dt = elem_size == 8 ? machmoe::DType::kFP64
                             : elem_size == 4 ? machmoe::DType::kFP32
                                              : machmoe::DType::kBF16;
  return static_cast<int64_t>(machmoe::saved_layout(p, dt).total_bytes);
}

// ---- index checking (machmoe/index_checking.hpp) -----------------------------------------------------------------

void set_index_checking(bool enabled) { machmoe::set_index_checking(enabled); }

bool index_checking_enabled() { return machmoe::index_checking_enabled(); }

/// Waits for the current stream of CUDA device `device` and raises a recorded index violation (ValueError).
void check_device_errors(int64_t device) {
  const auto ordinal = static_cast<c10::DeviceIndex>(device);
  machmoe::check_device_errors(machmoe::Device::cuda(static_cast<int>(device)),
                                static_cast<void*>(c10::cuda::getCurrentCUDAStream(ordinal).stream()));
}

/// The expert of each of `rows` pre-dispatched rows from per-expert counts (int32 when rows fit, else int64).
Tensor grouped_expert_index(const Tensor& counts, int64_t rows) {
  if (rows < 0) machmoe::throw_argument_error("grouped_expert_index", "rows", "a count >= 0", std::to_string(rows));
  const at::ScalarType type = rows <= machmoe::Limits::kMaxPairs ? at::kInt : at::kLong;
  Tensor index = at::empty({rows}, counts.options().dtype(type));
  machmoe::grouped_expert_index(view(counts), view(index), stream_for(counts));
  return index;
}

}  // namespace

TORCH_LIBRARY(machmoe, m) {
  m.def(
      "layer_forward(Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "Tensor? token_index, Tensor? expert_index, Tensor? scores, int top_k, int activation, int weight_layout, "
      "int score, int routing, int rounding, int tile, int cache) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward(Tensor grad_out, Tensor? grad_logits, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, "
      "Tensor w2, Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, int top_k, "
      "int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward_input(Tensor grad_out, Tensor? grad_logits, Tensor x, Tensor? router_weight, Tensor w1, "
      "Tensor? b1, Tensor w2, Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, "
      "int top_k, int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward_weight(Tensor grad_out, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, "
      "Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, Tensor deferred, "
      "int top_k, int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "saved_nbytes(int T, int d, int n, int E, int K, int num_pairs, int activation, int score, int routing, "
      "int tile, int cache, int elem_size) -> int");
  m.impl("saved_nbytes", &saved_nbytes);
  m.def("set_index_checking(bool enabled) -> ()");
  m.impl("set_index_checking", &set_index_checking);
  m.def("index_checking_enabled() -> bool");
  m.impl("index_checking_enabled", &index_checking_enabled);
  m.def("check_device_errors(int device) -> ()");
  m.impl("check_device_errors", &check_device_errors);
  m.def("grouped_expert_index(Tensor counts, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(machmoe, CPU, m) {
  m.impl("grouped_expert_index", &grouped_expert_index);
  m.impl("layer_forward", &layer_forward);
  m.impl("layer_backward", &layer_backward);
  m.impl("layer_backward_input", &layer_backward_input);
  m.impl("layer_backward_weight", &layer_backward_weight);
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("grouped_expert_index", &grouped_expert_index);
  m.impl("layer_forward", &layer_forward);
  m.impl("layer_backward", &layer_backward);
  m.impl("layer_backward_input", &layer_backward_input);
  m.impl("layer_backward_weight", &layer_backward_weight);
}
