// PyTorch operators over the torch-free C++ API, registered with TORCH_LIBRARY so one shared library serves every
// Python version (loaded by torch.ops.load_library). CPU tensors (fp32/fp64) run the float reference, CUDA tensors
// (bf16/fp16/fp32) the GPU runtime on the current stream. Workspaces come from torch's caching allocator; the forward
// returns its `saved` buffer as a uint8 tensor that autograd keeps for the backward (python/sonicmoe/_ops.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "sonicmoe/sonicmoe.hpp"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

sonicmoe::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return sonicmoe::DType::kBF16;
    case at::kHalf: return sonicmoe::DType::kFP16;
    case at::kFloat: return sonicmoe::DType::kFP32;
    case at::kDouble: return sonicmoe::DType::kFP64;
    case at::kInt: return sonicmoe::DType::kInt32;
    case at::kLong: return sonicmoe::DType::kInt64;
    default: TORCH_CHECK(false, "sonicmoe: unsupported dtype ", t);
  }
}

sonicmoe::TensorView view(const Tensor& t) {
  sonicmoe::TensorView v;
  TORCH_CHECK(t.dim() <= sonicmoe::kMaxRank, "sonicmoe: tensors of rank <= 4, got rank ", t.dim());
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.device = t.is_cuda() ? sonicmoe::Device::cuda(t.get_device()) : sonicmoe::Device::cpu();
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) v.shape[i] = t.size(i), v.stride[i] = t.stride(i);
  return v;
}

sonicmoe::TensorView view(const OptTensor& t) { return t && t->defined() ? view(*t) : sonicmoe::TensorView(); }

/// The problem from the operands and the integer options (enum values of sonicmoe/problem.hpp).
sonicmoe::MoEProblem problem_of(const Tensor& x, const Tensor& w1, const Tensor& w2, const OptTensor& b1,
                                const OptTensor& b2, const OptTensor& token_index, int64_t top_k, int64_t activation,
                                int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile,
                                int64_t cache) {
  TORCH_CHECK(x.dim() == 2, "sonicmoe: argument 'x': expected a (T, d) tensor, got shape ", x.sizes());
  TORCH_CHECK(w1.dim() == 3, "sonicmoe: argument 'w1': expected an (E, 2n or n, d) tensor, got shape ", w1.sizes());
  TORCH_CHECK(w2.dim() == 3, "sonicmoe: argument 'w2': expected an (E, d, n) tensor, got shape ", w2.sizes());
  sonicmoe::MoEProblem p;
  p.T = x.size(0), p.d = x.size(1), p.E = w1.size(0), p.n = w2.size(2), p.K = top_k;
  p.activation = static_cast<sonicmoe::Activation>(activation);
  p.weight_layout = static_cast<sonicmoe::WeightLayout>(weight_layout);
  p.score = static_cast<sonicmoe::ScoreVariant>(score);
  p.routing = static_cast<sonicmoe::RoutingMode>(routing);
  p.rounding = static_cast<sonicmoe::RoundingRule>(rounding);
  p.tile_m = tile;
  p.cache = static_cast<sonicmoe::CacheMode>(cache);
  p.has_b1 = b1 && b1->defined();
  p.has_b2 = b2 && b2->defined();
  if (p.routing == sonicmoe::RoutingMode::kCallerSupplied && token_index) p.num_pairs = token_index->size(0);
  return p;
}

void* stream_for(const Tensor& x) {
  return x.is_cuda() ? static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.get_device()).stream()) : nullptr;
}

sonicmoe::LayerWeights weights_of(const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
                                  const Tensor& w2, const OptTensor& b2) {
  sonicmoe::LayerWeights w;
  w.router_weight = view(router_weight);
  w.w1 = view(w1), w.b1 = view(b1), w.w2 = view(w2), w.b2 = view(b2);
  return w;
}

sonicmoe::RoutingTriples triples_of(bool caller, const OptTensor& token_index, const OptTensor& expert_index,
                                    const OptTensor& scores) {
  sonicmoe::RoutingTriples r;
  if (!caller) return r;
  TORCH_CHECK(token_index && expert_index && scores,
              "sonicmoe: routing 'caller' needs token_index, expert_index and scores");
  r.token_index = view(*token_index), r.expert_index = view(*expert_index), r.score = view(*scores);
  return r;
}

at::ScalarType score_type(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

sonicmoe::Device library_device(const Tensor& x) {
  return x.is_cuda() ? sonicmoe::Device::cuda(x.get_device()) : sonicmoe::Device::cpu();
}

Tensor byte_buffer(const Tensor& x, std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_forward(
    const Tensor& x, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
    const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index, const OptTensor& scores,
    int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding,
    int64_t tile, int64_t cache) {
  const sonicmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  sonicmoe::validate_problem(p, "forward");
  const bool caller = p.routing == sonicmoe::RoutingMode::kCallerSupplied;
  const sonicmoe::DType dt = to_dtype(x.scalar_type());
  Tensor out = at::empty({p.T, p.d}, x.options());
  Tensor logits = caller ? at::empty({0}, x.options()) : at::empty({p.T, p.E}, x.options());
  Tensor counts = at::empty({p.E}, x.options().dtype(at::kInt));
  Tensor saved = byte_buffer(x, sonicmoe::saved_layout(p, dt).total_bytes);
  Tensor workspace = byte_buffer(x, sonicmoe::forward_workspace_bytes(p, dt, library_device(x)));
  const sonicmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  sonicmoe::ForwardOutputs fo;
  fo.out = view(out);
  if (!caller) fo.router_logits = view(logits);
  fo.expert_counts = view(counts);
  sonicmoe::forward(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr, fo,
                    {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                     static_cast<std::size_t>(workspace.numel())},
                    stream_for(x));
  return {out, logits, counts, saved};
}

/// Upstream gradients and the input-gradient outputs of a backward (kept alive while the views are used).
struct InputGrads {
  Tensor go, dx, dwr, dscores;
  OptTensor gl;
  sonicmoe::BackwardInputs inputs;

  InputGrads(const sonicmoe::MoEProblem& p, const Tensor& x, const Tensor& grad_out, const OptTensor& grad_logits) {
    const bool caller = p.routing == sonicmoe::RoutingMode::kCallerSupplied;
    go = grad_out.contiguous();
    if (grad_logits && grad_logits->defined() && !caller) gl = grad_logits->contiguous();
    dx = at::empty({p.T, p.d}, x.options());
    dwr = caller ? at::empty({0}, x.options()) : at::empty({p.E, p.d}, x.options());
    dscores = caller ? at::empty({p.num_pairs}, x.options().dtype(score_type(x))) : at::empty({0}, x.options());
    inputs.grad_out = view(go);
    inputs.grad_router_logits = view(gl);
  }
  void attach(const sonicmoe::MoEProblem& p, sonicmoe::BackwardOutputs& bo) const {
    bo.grad_x = view(dx);
    if (p.routing == sonicmoe::RoutingMode::kCallerSupplied) bo.grad_scores = view(dscores);
    else bo.grad_weights.router_weight = view(dwr);
  }
};

/// The expert weight-gradient outputs of a backward.
struct WeightGrads {
  Tensor dw1, db1, dw2, db2;

  WeightGrads(const sonicmoe::MoEProblem& p, const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
              const OptTensor& b2) {
    dw1 = at::empty(w1.sizes(), x.options()), dw2 = at::empty(w2.sizes(), x.options());
    db1 = p.has_b1 ? at::empty(b1->sizes(), x.options()) : at::empty({0}, x.options());
    db2 = p.has_b2 ? at::empty(b2->sizes(), x.options()) : at::empty({0}, x.options());
  }
  void attach(const sonicmoe::MoEProblem& p, sonicmoe::BackwardOutputs& bo) const {
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
  const sonicmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  sonicmoe::validate_problem(p, "backward");
  const bool caller = p.routing == sonicmoe::RoutingMode::kCallerSupplied;
  Tensor workspace = byte_buffer(x, sonicmoe::backward_workspace_bytes(p, to_dtype(x.scalar_type()), library_device(x)));
  const InputGrads ig(p, x, grad_out, grad_logits);
  const WeightGrads wg(p, x, w1, b1, w2, b2);
  sonicmoe::BackwardOutputs bo;
  ig.attach(p, bo);
  wg.attach(p, bo);
  const sonicmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  sonicmoe::backward(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr, ig.inputs,
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
  const sonicmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  sonicmoe::validate_problem(p, "backward_input");
  const bool caller = p.routing == sonicmoe::RoutingMode::kCallerSupplied;
  const sonicmoe::DType dt = to_dtype(x.scalar_type());
  Tensor workspace = byte_buffer(x, sonicmoe::backward_input_workspace_bytes(p, dt, library_device(x)));
  Tensor deferred = byte_buffer(x, sonicmoe::deferred_layout(p, dt).total_bytes);
  const InputGrads ig(p, x, grad_out, grad_logits);
  sonicmoe::BackwardOutputs bo;
  ig.attach(p, bo);
  const sonicmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  sonicmoe::backward_input(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr,
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
  const sonicmoe::MoEProblem p = problem_of(x, w1, w2, b1, b2, token_index, top_k, activation, weight_layout, score,
                                            routing, rounding, tile, cache);
  sonicmoe::validate_problem(p, "backward_weight");
  const bool caller = p.routing == sonicmoe::RoutingMode::kCallerSupplied;
  const Tensor go = grad_out.contiguous();
  const WeightGrads wg(p, x, w1, b1, w2, b2);
  sonicmoe::BackwardOutputs bo;
  wg.attach(p, bo);
  const sonicmoe::RoutingTriples triples = triples_of(caller, token_index, expert_index, scores);
  sonicmoe::backward_weight(p, view(x), weights_of(router_weight, w1, b1, w2, b2), caller ? &triples : nullptr,
                            view(go), bo, saved.data_ptr(), static_cast<std::size_t>(saved.numel()),
                            {deferred.data_ptr(), static_cast<std::size_t>(deferred.numel())}, stream_for(x));
  return {wg.dw1, wg.db1, wg.dw2, wg.db2};
}

/// Size of the saved buffer, for the fake (meta) implementation used by torch.compile.
int64_t saved_nbytes(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, int64_t num_pairs, int64_t activation,
                     int64_t score, int64_t routing, int64_t tile, int64_t cache, int64_t elem_size) {
  sonicmoe::MoEProblem p;
  p.T = T, p.d = d, p.n = n, p.E = E, p.K = K, p.num_pairs = num_pairs, p.tile_m = tile;
  p.activation = static_cast<sonicmoe::Activation>(activation);
  p.score = static_cast<sonicmoe::ScoreVariant>(score);
  p.routing = static_cast<sonicmoe::RoutingMode>(routing);
  p.cache = static_cast<sonicmoe::CacheMode>(cache);
  const sonicmoe::DType dt = elem_size == 8 ? sonicmoe::DType::kFP64
                             : elem_size == 4 ? sonicmoe::DType::kFP32
                                              : sonicmoe::DType::kBF16;
  return static_cast<int64_t>(sonicmoe::saved_layout(p, dt).total_bytes);
}

}  // namespace

TORCH_LIBRARY(sonicmoe, m) {
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
}

TORCH_LIBRARY_IMPL(sonicmoe, CPU, m) {
  m.impl("layer_forward", &layer_forward);
  m.impl("layer_backward", &layer_backward);
  m.impl("layer_backward_input", &layer_backward_input);
  m.impl("layer_backward_weight", &layer_backward_weight);
}

TORCH_LIBRARY_IMPL(sonicmoe, CUDA, m) {
  m.impl("layer_forward", &layer_forward);
  m.impl("layer_backward", &layer_backward);
  m.impl("layer_backward_input", &layer_backward_input);
  m.impl("layer_backward_weight", &layer_backward_weight);
}
