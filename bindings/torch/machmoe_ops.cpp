// PyTorch operators over the torch-free C++ API, registered with TORCH_LIBRARY so one shared library serves every
// Python version (loaded by torch.ops.load_library). CPU tensors (fp32/fp64) run the float reference, CUDA tensors
// (bf16/fp16/fp32) the GPU runtime on the current stream. Workspaces come from torch's caching allocator; the forward
// returns its `saved` buffer as a uint8 tensor that autograd keeps for the backward (python/machmoe/_ops.py).
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "machmoe/machmoe.hpp"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Every operator checks each of its arguments where it enters, before converting it: the integer options are
// 64-bit here and the library's enums are int, so an unchecked code would be narrowed (2^32 -> 0, a valid value)
// or become an enum value no switch handles. Failures use the library's format, "machmoe::<op>: argument '<arg>':
// expected ..., got ...", and are machmoe::Error (std::invalid_argument), which torch raises as ValueError.

[[noreturn]] void fail(const char* op, const std::string& arg, const std::string& expected, const std::string& got) {
  machmoe::throw_argument_error(op, arg, expected, got);
}

std::string shape_of(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

/// An integer argument in [lo, hi].
int64_t in_range(const char* op, const char* arg, int64_t v, int64_t lo, int64_t hi, const std::string& why = "") {
  if (v < lo || v > hi)
    fail(op, arg, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" + why, std::to_string(v));
  return v;
}

/// The token-rounding tile: checked whatever the routing, since the operators always carry it and a value the
/// routing ignores today is still a caller's mistake.
int64_t tile_arg(const char* op, int64_t tile) {
  if (tile < 8 || tile > machmoe::Limits::kMaxTileM || tile % 8 != 0)
    fail(op, "tile",
         "a multiple of 8 in [8, " + std::to_string(machmoe::Limits::kMaxTileM) +
             "] (the token-rounding tile M; checked for every routing)",
         std::to_string(tile));
  return tile;
}

machmoe::DType to_dtype(const char* op, const std::string& arg, const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return machmoe::DType::kBF16;
    case at::kHalf: return machmoe::DType::kFP16;
    case at::kFloat: return machmoe::DType::kFP32;
    case at::kDouble: return machmoe::DType::kFP64;
    case at::kInt: return machmoe::DType::kInt32;
    case at::kLong: return machmoe::DType::kInt64;
    default:
      fail(op, arg, "dtype bfloat16, float16, float32, float64, int32 or int64", c10::toString(t.scalar_type()));
  }
}

/// A required tensor that is present (C++ callers can pass an undefined one). Sparse and other layouts, and devices
/// other than cpu and cuda, never reach these kernels: the dispatcher has no kernel of ours for their keys.
void check_defined(const char* op, const std::string& arg, const Tensor& t) {
  if (!t.defined()) fail(op, arg, "a tensor", "an undefined tensor");
}

machmoe::TensorView view(const char* op, const std::string& arg, const Tensor& t) {
  check_defined(op, arg, t);
  if (t.dim() > machmoe::kMaxRank)
    fail(op, arg, "a tensor of rank <= " + std::to_string(machmoe::kMaxRank), "rank " + std::to_string(t.dim()));
  machmoe::TensorView v;
  v.dtype = to_dtype(op, arg, t);
  v.data = t.data_ptr();
  v.device = t.is_cuda() ? machmoe::Device::cuda(t.get_device()) : machmoe::Device::cpu();
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) v.shape[i] = t.size(i), v.stride[i] = t.stride(i);
  // A dimension of size 1 is never stepped along, so its stride says nothing, and PyTorch leaves it arbitrary (a
  // (1, d) row sliced from a transposed (d, 1) tensor has strides (1, 1) and is "contiguous"). The library's layout
  // rules (a row stride of at least the row's length, which cuBLAS also needs) read it, so it is given the value of
  // the contiguous layout: no element moves.
  for (int i = v.rank - 1; i >= 0; --i)
    if (v.shape[i] == 1) v.stride[i] = i + 1 < v.rank ? v.shape[i + 1] * v.stride[i + 1] : 1;
  return v;
}

bool present(const OptTensor& t) { return t && t->defined(); }

machmoe::TensorView view(const char* op, const std::string& arg, const OptTensor& t) {
  return present(t) ? view(op, arg, *t) : machmoe::TensorView();
}

void check_rank(const char* op, const char* arg, const Tensor& t, int64_t rank, const char* what) {
  check_defined(op, arg, t);
  if (t.dim() != rank) fail(op, arg, what, "shape " + shape_of(t));
}

/// A raw byte buffer the library reads through a pointer (saved, deferred): the library cannot see its device or
/// layout, so a buffer on another device or with a wider dtype would be read as the wrong memory or size.
void check_byte_buffer(const char* op, const char* arg, const Tensor& buf, const Tensor& x, const char* from) {
  check_defined(op, arg, buf);
  if (buf.scalar_type() != at::kByte)
    fail(op, arg, std::string("a uint8 tensor (the buffer ") + from + " returned)", c10::toString(buf.scalar_type()));
  if (buf.dim() != 1) fail(op, arg, std::string("a 1-D tensor (the buffer ") + from + " returned)", "shape " + shape_of(buf));
  if (buf.device() != x.device())
    fail(op, arg, "a tensor on " + x.device().str() + " (the device of x)", "a tensor on " + buf.device().str());
  if (!buf.is_contiguous()) fail(op, arg, "a contiguous tensor", "stride " + std::to_string(buf.stride(0)));
}

/// Bumps the version counter of each caller buffer (into_*) that an operator has just written. The schema declares
/// them written (Tensor(a!)), but the kernel writes through raw pointers, which autograd does not see: without the
/// bump, a graph that saved one of these tensors (a main_grad read by another computation) would not notice that
/// its value changed and would compute its backward from the new values instead of raising its in-place error.
void bump_versions(std::initializer_list<const OptTensor*> buffers) {
  for (const OptTensor* t : buffers)
    if (t->has_value() && (*t)->defined()) (*t)->unsafeGetTensorImpl()->bump_version();
}

/// The problem from the operands and the integer options (enum codes of machmoe/problem.hpp), every integer
/// checked before it is converted.
machmoe::MoEProblem problem_of(const char* op, const Tensor& x, const Tensor& w1, const Tensor& w2,
                                const OptTensor& b1, const OptTensor& b2, const OptTensor& token_index,
                                const OptTensor& expert_index, const OptTensor& scores, int64_t top_k,
                                int64_t activation, int64_t weight_layout, int64_t score, int64_t routing,
                                int64_t rounding, int64_t tile, int64_t cache, double swiglu_alpha,
                                double swiglu_limit) {
  check_rank(op, "x", x, 2, "a (T, d) tensor");
  check_defined(op, "w1", w1);
  check_rank(op, "w2", w2, 3, "an (E, d, n) tensor");
  machmoe::MoEProblem p;
  p.activation = machmoe::activation_from_code(activation, op, "activation");
  p.weight_layout = machmoe::weight_layout_from_code(weight_layout, op, "weight_layout");
  // (E, 2, n, d): the concatenated layout's gate and up halves, which may lie apart (_w1_halves_view).
  const bool halves = machmoe::is_glu(p.activation) && p.weight_layout == machmoe::WeightLayout::kConcatenated;
  if (w1.dim() != 3 && !(halves && w1.dim() == 4))
    fail(op, "w1",
         halves ? "an (E, 2n, d) tensor or an (E, 2, n, d) view of its gate and up halves" : "an (E, 2n or n, d) tensor",
         "shape " + shape_of(w1));
  p.score = machmoe::score_variant_from_code(score, op, "score");
  p.routing = machmoe::routing_mode_from_code(routing, op, "routing");
  p.rounding = machmoe::rounding_rule_from_code(rounding, op, "rounding");
  p.cache = machmoe::cache_mode_from_code(cache, op, "cache");
  p.swiglu_alpha = swiglu_alpha, p.swiglu_limit = swiglu_limit;  // validate_problem checks them against the activation
  p.tile_m = tile_arg(op, tile);
  p.T = x.size(0), p.d = x.size(1), p.E = w1.size(0), p.n = w2.size(2);
  if (p.E < 1 || p.E > machmoe::Limits::kMaxExperts)
    fail(op, "w1", "(E, 2n or n, d) with E in [1, " + std::to_string(machmoe::Limits::kMaxExperts) + "] experts",
         "shape " + shape_of(w1));
  p.K = in_range(op, "top_k", top_k, 1, p.E, " (at most E = w1.size(0) experts per token)");
  p.has_b1 = present(b1);
  p.has_b2 = present(b2);
  const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
  const std::pair<const OptTensor*, const char*> triples[] = {
      {&token_index, "token_index"}, {&expert_index, "expert_index"}, {&scores, "scores"}};
  for (const auto& [t, name] : triples) {
    if (caller && !present(*t)) fail(op, name, "a (P,) tensor for routing 'caller'", "None");
    if (!caller && present(*t))
      fail(op, name,
           std::string("None for routing '") + machmoe::routing_mode_name(p.routing) +
               "' (the router picks the pairs; caller-supplied triples need routing 'caller')",
           "a tensor of shape " + shape_of(**t));
    if (caller) check_rank(op, name, **t, 1, "a 1-D (P,) tensor, one entry per pair");
  }
  if (caller) p.num_pairs = token_index->size(0);
  machmoe::validate_problem(p, op);
  return p;
}

void* stream_for(const Tensor& x) {
  return x.is_cuda() ? static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.get_device()).stream()) : nullptr;
}

machmoe::LayerWeights weights_of(const char* op, const OptTensor& router_weight, const Tensor& w1,
                                  const OptTensor& b1, const Tensor& w2, const OptTensor& b2) {
  machmoe::LayerWeights w;
  w.router_weight = view(op, "router_weight", router_weight);
  w.w1 = view(op, "w1", w1), w.b1 = view(op, "b1", b1), w.w2 = view(op, "w2", w2), w.b2 = view(op, "b2", b2);
  return w;
}

/// The caller's triples (problem_of has checked that they are present exactly for routing 'caller').
machmoe::RoutingTriples triples_of(const char* op, const machmoe::MoEProblem& p, const OptTensor& token_index,
                                    const OptTensor& expert_index, const OptTensor& scores) {
  machmoe::RoutingTriples r;
  if (p.routing != machmoe::RoutingMode::kCallerSupplied) return r;
  r.token_index = view(op, "token_index", token_index);
  r.expert_index = view(op, "expert_index", expert_index);
  r.score = view(op, "scores", scores);
  return r;
}

at::ScalarType score_type(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

machmoe::Device library_device(const Tensor& x) {
  return x.is_cuda() ? machmoe::Device::cuda(x.get_device()) : machmoe::Device::cpu();
}

Tensor byte_buffer(const Tensor& x, std::size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
}

/// Whether `w` is a master weight of x: float32 with a bfloat16 or float16 x. The layer computes in x's dtype and
/// gives that weight's gradient in float32 (mixed precision, e.g. float32 parameters under torch.autocast).
bool master_weight(const Tensor& w, const Tensor& x) {
  return w.defined() && w.scalar_type() == at::kFloat &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

/// A weight as the library computes with it: a master weight cast to x's dtype for this call (the copy lives as long
/// as the operator runs; nothing keeps it between the forward and the backward, which casts again), or left as it
/// is where the call reads no weight (`cast` false: LayerArgs then describes it in x's dtype); anything else as it
/// is, for the library to check against x.
OptTensor compute_weight(const char* op, const char* arg, const OptTensor& w, const Tensor& x, bool cast) {
  if (!present(w) || w->scalar_type() == x.scalar_type()) return w;
  if (master_weight(*w, x)) return cast ? OptTensor(w->to(x.scalar_type())) : w;
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  fail(op, arg,
       std::string("dtype ") + c10::toString(x.scalar_type()) + " (the dtype of x)" +
           (half ? " or Float (float32 master weights: the layer computes in x's dtype)" : ""),
       c10::toString(w->scalar_type()));
}

/// The dtype of a weight's gradient: float32 for a master weight, x's dtype otherwise (and for an absent weight).
at::ScalarType grad_dtype(const OptTensor& w, const Tensor& x) {
  return present(w) && master_weight(*w, x) ? at::kFloat : x.scalar_type();
}

/// Whether an operator's library call reads the weights' values, or only their shapes (layer_backward_weight: the
/// weight gradients come from dO, X, dH and A').
enum class WeightUse { kValues, kShapes };

/// The operands every layer operator shares, checked and viewed before anything is allocated. Master weights
/// (master_weight) are cast to x's dtype here, where the call reads them: the library takes weights in x's dtype
/// only.
struct LayerArgs {
  machmoe::MoEProblem p;
  machmoe::DType dtype;
  machmoe::TensorView x;
  OptTensor router_weight_c, w1_c, b1_c, w2_c, b2_c;  // the weights as computed with (compute_weight)
  machmoe::LayerWeights weights;
  machmoe::RoutingTriples triples;
  bool caller;

  LayerArgs(const char* op, const Tensor& x_, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
            const Tensor& w2, const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index,
            const OptTensor& scores, int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score,
            int64_t routing, int64_t rounding, int64_t tile, int64_t cache, double swiglu_alpha, double swiglu_limit,
            WeightUse use = WeightUse::kValues)
      : p(problem_of(op, x_, w1, w2, b1, b2, token_index, expert_index, scores, top_k, activation, weight_layout,
                     score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit)),
        dtype(to_dtype(op, "x", x_)),
        x(view(op, "x", x_)),
        router_weight_c(compute_weight(op, "router_weight", router_weight, x_, use == WeightUse::kValues)),
        w1_c(compute_weight(op, "w1", w1, x_, use == WeightUse::kValues)),
        b1_c(compute_weight(op, "b1", b1, x_, use == WeightUse::kValues)),
        w2_c(compute_weight(op, "w2", w2, x_, use == WeightUse::kValues)),
        b2_c(compute_weight(op, "b2", b2, x_, use == WeightUse::kValues)),
        weights(weights_of(op, router_weight_c, *w1_c, b1_c, *w2_c, b2_c)),
        triples(triples_of(op, p, token_index, expert_index, scores)),
        caller(p.routing == machmoe::RoutingMode::kCallerSupplied) {
    if (use == WeightUse::kShapes) describe_weights_in_x_dtype();
  }
  const machmoe::RoutingTriples* routing() const { return caller ? &triples : nullptr; }

  /// Gives every weight view x's dtype: master weights then appear as the library takes them, for a call that reads
  /// no weight value (it checks their shapes and that its outputs overlap none of them). Views of x's dtype are
  /// unchanged.
  void describe_weights_in_x_dtype() {
    for (machmoe::TensorView* v : {&weights.router_weight, &weights.w1, &weights.b1, &weights.w2, &weights.b2})
      if (!v->empty()) v->dtype = dtype;
  }

  /// Frees the casts of master weights once every kernel that reads them is queued (the caching allocator hands
  /// their blocks out again only to work queued after those kernels on this stream), for a call that reads no
  /// weight afterwards: finish_backward_w1 only checks the weights' shapes and that its outputs overlap none of
  /// them. The views then describe the master weights' own memory, in x's dtype, rather than a freed cast, whose
  /// block W1's gradient may take next.
  void release_weight_casts(const char* op, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
                            const Tensor& w2, const OptTensor& b2) {
    weights = weights_of(op, router_weight, w1, b1, w2, b2);
    describe_weights_in_x_dtype();
    router_weight_c = w1_c = b1_c = w2_c = b2_c = std::nullopt;
  }
};

/// A caller buffer (into_*) that a backward adds a weight's gradient into: present only for a weight the layer has,
/// on x's device, in x's dtype or fp32, of the weight's shape, contiguous. Returns whether the buffer is given. The
/// forward checks its buffers with this too (it only hands them to its backward), so that a wrong buffer fails at the
/// call that passed it, not later in backward().
/// `grad`: the dtype of the weight's gradient (grad_dtype): a buffer holds it or float32, as the Python layer's
/// accumulate_grads_into check says (the weight's dtype or float32; a master weight's buffer is float32).
bool check_into(const char* op, const char* arg, const OptTensor& into, bool present_weight, const char* absent_why,
                at::IntArrayRef sizes, const Tensor& x, at::ScalarType grad) {
  if (!present(into)) return false;
  const Tensor& t = *into;
  if (!present_weight) fail(op, arg, std::string("None (") + absent_why + ")", "a tensor of shape " + shape_of(t));
  if (t.device() != x.device())
    fail(op, arg, "a tensor on " + x.device().str() + " (the device of x)", "a tensor on " + t.device().str());
  if (t.scalar_type() != grad && t.scalar_type() != at::kFloat)
    fail(op, arg,
         grad == x.scalar_type()
             ? std::string("dtype ") + c10::toString(x.scalar_type()) + " (the dtype of x) or Float (fp32 gradients)"
             : std::string("dtype Float (the gradient of a float32 master weight)"),
         c10::toString(t.scalar_type()));
  if (t.sizes() != sizes)
    fail(op, arg, "shape " + shape_of(at::empty(sizes, at::TensorOptions().device(at::kMeta))) +
                      " (the weight's shape)", "shape " + shape_of(t));
  // Contiguous, as the Python layer asks of its buffers: the library would refuse another layout only inside the
  // backward, naming its own argument (outputs.grad_weights...) rather than this one.
  if (!t.is_contiguous()) {
    std::string strides;
    for (const auto s : t.strides()) strides += (strides.empty() ? "(" : ", ") + std::to_string(s);
    fail(op, arg, "a contiguous tensor", "strides " + strides + ")");
  }
  // The backward bumps the buffer's version once it has written it (bump_versions), and torch refuses that bump
  // for a tensor without a version counter (an inference tensor, e.g. a main_grad created under
  // torch.inference_mode()) only then: the buffer would be changed and the backward fail. Refused before any work,
  // as torch refuses an in-place op on it (which inference mode allows).
  if (!t.unsafeGetTensorImpl()->version_counter().enabled() && !c10::InferenceMode::is_enabled())
    fail(op, arg, "a tensor with a version counter (not an inference tensor: create the buffer outside "
                  "torch.inference_mode(), or clone it)", "an inference tensor");
  return true;
}

/// The forward's `saved` buffer. The library writes its regions but not the alignment padding between them, so two
/// identical forwards would return different bytes there (torch.library.opcheck compares them). On the CPU the
/// padding is zeroed: under 256 bytes per region, before the regions are written. Token rounding's pair count is
/// only a bound, so the per-pair regions have unwritten tails (and the CPU forward leaves token_selection to the
/// GPU): on the CPU its buffer is zeroed whole, one pass over bytes that the reference forward spends far more work
/// on. On CUDA either would take a memset launch per forward; nothing reads those bytes, so they are left as they
/// were allocated.
Tensor saved_buffer(const Tensor& x, const machmoe::MoEProblem& p, machmoe::DType dtype) {
  const machmoe::SavedLayout l = machmoe::saved_layout(p, dtype);
  Tensor saved = byte_buffer(x, l.total_bytes);
  if (x.is_cuda()) return saved;
  if (p.routing == machmoe::RoutingMode::kTokenRounding) return saved.zero_();
  auto* base = static_cast<unsigned char*>(saved.data_ptr());
  std::size_t end = 0;  // of the regions so far (guarded: an unexpected order leaves a gap as it is, never overruns)
  for (const machmoe::BufferRegion* r : {&l.h, &l.router_logits, &l.scores, &l.scatter, &l.inverse, &l.gather,
                                         &l.expert_offsets, &l.token_offsets, &l.token_selection}) {
    if (!r->present()) continue;
    if (r->offset > end) std::memset(base + end, 0, r->offset - end);
    end = std::max(end, r->offset + r->bytes);
  }
  if (l.total_bytes > end) std::memset(base + end, 0, l.total_bytes - end);
  return saved;
}

/// The forward. The into_* buffers are not read here: they are the forward's operands only so that autograd (and
/// torch.compile's traced backward) hands them to the backward, which adds the weight gradients into them. They are
/// checked here as the backward checks them, so that a wrong buffer (or one for a weight the layer does not have,
/// which the backward would otherwise ignore) fails at the call that passed it.
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_forward(
    const Tensor& x, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
    const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index, const OptTensor& scores,
    int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding,
    int64_t tile, int64_t cache, double swiglu_alpha, double swiglu_limit, const OptTensor& into_router_weight,
    const OptTensor& into_w1, const OptTensor& into_b1, const OptTensor& into_w2, const OptTensor& into_b2) {
  const char* op = "layer_forward";
  const LayerArgs a(op, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                    weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit);
  const machmoe::MoEProblem& p = a.p;
  const char* no_router = "routing 'caller' has no router";
  check_into(op, "into_router_weight", into_router_weight, !a.caller, no_router, {p.E, p.d}, x,
             grad_dtype(router_weight, x));
  check_into(op, "into_w1", into_w1, true, "", w1.sizes(), x, grad_dtype(w1, x));
  check_into(op, "into_b1", into_b1, p.has_b1, "the layer has no b1", p.has_b1 ? b1->sizes() : at::IntArrayRef{}, x,
             grad_dtype(b1, x));
  check_into(op, "into_w2", into_w2, true, "", w2.sizes(), x, grad_dtype(w2, x));
  check_into(op, "into_b2", into_b2, p.has_b2, "the layer has no b2", p.has_b2 ? b2->sizes() : at::IntArrayRef{}, x,
             grad_dtype(b2, x));
  Tensor out = at::empty({p.T, p.d}, x.options());
  Tensor logits = a.caller ? at::empty({0}, x.options()) : at::empty({p.T, p.E}, x.options());
  Tensor counts = at::empty({p.E}, x.options().dtype(at::kInt));
  Tensor saved = saved_buffer(x, p, a.dtype);
  Tensor workspace = byte_buffer(x, machmoe::forward_workspace_bytes(p, a.dtype, library_device(x)));
  machmoe::ForwardOutputs fo;
  fo.out = view(op, "out", out);
  if (!a.caller) fo.router_logits = view(op, "router_logits", logits);
  fo.expert_counts = view(op, "expert_counts", counts);
  machmoe::forward(p, a.x, a.weights, a.routing(), fo,
                    {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                     static_cast<std::size_t>(workspace.numel())},
                    stream_for(x));
  return {out, logits, counts, saved};
}

/// A new weight gradient of `sizes`: contiguous, except W1's as an (E, 2, n, d) view of its halves
/// (_w1_halves_view), whose gradient is laid out (2, E, n, d), so that each half's gradient, [:, 0] and [:, 1], is a
/// contiguous tensor of its own (torchtitan's w1 and w3 take them without a copy).
Tensor new_weight_grad(at::IntArrayRef sizes, const at::TensorOptions& o, bool zeros) {
  if (sizes.size() != 4) return zeros ? at::zeros(sizes, o) : at::empty(sizes, o);
  const std::vector<int64_t> halves_first{sizes[1], sizes[0], sizes[2], sizes[3]};
  return (zeros ? at::zeros(halves_first, o) : at::empty(halves_first, o)).permute({1, 0, 2, 3});
}

/// Where one weight's gradient goes. Given `into` (accumulation mode), the library adds the gradient into it and the
/// operator returns an empty tensor in its place. Otherwise the operator returns a new tensor; in a call that
/// accumulates (the library adds into every weight gradient of the call), that tensor starts at zero.
struct GradTarget {
  Tensor buffer;    // what the library writes (adds) into
  Tensor returned;  // what the operator returns for this gradient

  GradTarget() = default;
  /// `dtype`: of the returned gradient (grad_dtype).
  GradTarget(const char* op, const char* arg, const OptTensor& into, bool present_weight, const char* absent_why,
             bool accumulate, at::IntArrayRef sizes, const Tensor& x, at::ScalarType dtype) {
    const bool given = check_into(op, arg, into, present_weight, absent_why, sizes, x, dtype);  // (none: no weight)
    if (given) buffer = *into;
    if (given || !present_weight) {
      returned = at::empty({0}, x.options());
    } else {
      buffer = new_weight_grad(sizes, x.options().dtype(dtype), accumulate);
      returned = buffer;
    }
  }
};

bool any_present(std::initializer_list<const OptTensor*> ts) {
  for (const OptTensor* t : ts)
    if (present(*t)) return true;
  return false;
}

/// Upstream gradients and the input-gradient outputs of a backward (kept alive while the views are used).
struct InputGrads {
  Tensor go, dx, dscores;
  GradTarget dwr;
  OptTensor gl;
  machmoe::BackwardInputs inputs;

  InputGrads(const char* op, const machmoe::MoEProblem& p, const Tensor& x, const Tensor& grad_out,
             const OptTensor& grad_logits, const OptTensor& router_weight, const OptTensor& into_router_weight,
             bool accumulate) {
    const bool caller = p.routing == machmoe::RoutingMode::kCallerSupplied;
    check_defined(op, "grad_out", grad_out);
    // Routing 'caller' has no router logits: the forward returned an empty tensor for them, whose gradient
    // autograd may pass back empty; anything else would be silently dropped.
    if (caller && present(grad_logits) && grad_logits->numel() != 0)
      fail(op, "grad_logits", "None or an empty tensor (routing 'caller' has no router logits)",
           "a tensor of shape " + shape_of(*grad_logits));
    go = grad_out.contiguous();
    if (present(grad_logits) && !caller) gl = grad_logits->contiguous();
    dx = at::empty({p.T, p.d}, x.options());
    dwr = GradTarget(op, "into_router_weight", into_router_weight, !caller, "routing 'caller' has no router",
                     accumulate, {p.E, p.d}, x, grad_dtype(router_weight, x));
    dscores = caller ? at::empty({p.num_pairs}, x.options().dtype(score_type(x))) : at::empty({0}, x.options());
    inputs.grad_out = view(op, "grad_out", go);
    inputs.grad_router_logits = view(op, "grad_logits", gl);
  }
  void attach(const char* op, const machmoe::MoEProblem& p, machmoe::BackwardOutputs& bo) const {
    bo.grad_x = view(op, "grad_x", dx);
    if (p.routing == machmoe::RoutingMode::kCallerSupplied) bo.grad_scores = view(op, "grad_scores", dscores);
    else bo.grad_weights.router_weight = view(op, "into_router_weight", dwr.buffer);
  }
};

/// The gradient outputs of one projection's weight and bias (w1 and b1, or w2 and b2).
struct ProjectionGrads {
  struct Names {
    const char *into_weight, *into_bias, *no_bias;
  };
  static constexpr Names kW1{"into_w1", "into_b1", "the layer has no b1"};
  static constexpr Names kW2{"into_w2", "into_b2", "the layer has no b2"};

  GradTarget weight, bias;
  const Names* names = nullptr;
  bool has_bias = false;

  ProjectionGrads() = default;
  ProjectionGrads(const char* op, const Names& n, bool has_bias_, const Tensor& x, const Tensor& w,
                  const OptTensor& b, const OptTensor& into_w, const OptTensor& into_b, bool accumulate)
      : weight(op, n.into_weight, into_w, true, "", accumulate, w.sizes(), x, grad_dtype(w, x)),
        bias(op, n.into_bias, into_b, has_bias_, n.no_bias, accumulate, has_bias_ ? b->sizes() : at::IntArrayRef{}, x,
             grad_dtype(b, x)),
        names(&n),
        has_bias(has_bias_) {}
  void attach(const char* op, machmoe::TensorView& weight_view, machmoe::TensorView& bias_view) const {
    weight_view = view(op, names->into_weight, weight.buffer);
    if (has_bias) bias_view = view(op, names->into_bias, bias.buffer);
  }
};

/// The expert weight-gradient outputs of a backward.
struct WeightGrads {
  ProjectionGrads w1, w2;

  WeightGrads(const char* op, const machmoe::MoEProblem& p, const Tensor& x, const Tensor& w1_, const OptTensor& b1,
              const Tensor& w2_, const OptTensor& b2, const OptTensor& into_w1, const OptTensor& into_b1,
              const OptTensor& into_w2, const OptTensor& into_b2, bool accumulate)
      : w1(op, ProjectionGrads::kW1, p.has_b1, x, w1_, b1, into_w1, into_b1, accumulate),
        w2(op, ProjectionGrads::kW2, p.has_b2, x, w2_, b2, into_w2, into_b2, accumulate) {}
  void attach(const char* op, machmoe::BackwardOutputs& bo) const {
    w1.attach(op, bo.grad_weights.w1, bo.grad_weights.b1);
    w2.attach(op, bo.grad_weights.w2, bo.grad_weights.b2);
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layer_backward(
    const Tensor& grad_out, const OptTensor& grad_logits, const Tensor& x, const OptTensor& router_weight,
    const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2, const OptTensor& token_index,
    const OptTensor& expert_index, const OptTensor& scores, const Tensor& saved, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache,
    double swiglu_alpha, double swiglu_limit,
    const OptTensor& into_router_weight, const OptTensor& into_w1, const OptTensor& into_b1,
    const OptTensor& into_w2, const OptTensor& into_b2, bool consume_saved) {
  const char* op = "layer_backward";
  LayerArgs a(op, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                    weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit);
  check_byte_buffer(op, "saved", saved, x, "layer_forward");
  const machmoe::MoEProblem& p = a.p;
  const bool accumulate = any_present({&into_router_weight, &into_w1, &into_b1, &into_w2, &into_b2});
  const InputGrads ig(op, p, x, grad_out, grad_logits, router_weight, into_router_weight, accumulate);
  // The autograd backward hands `saved` over (consume_saved) when nothing can read it again: a backward that does
  // not retain its graph frees its saved tensors afterwards. dH then overwrites the saved H instead of taking a
  // workspace region of its size (layer.hpp, BackwardBuffers::consume_saved). Outside a backward (no graph task),
  // or with retain_graph / create_graph, the buffer is only read. Its version is bumped, so anything else that
  // saved it for a later backward gets autograd's in-place error instead of dH.
  const bool consume = consume_saved && x.is_cuda() && saved.numel() > 0 &&
                       !torch::autograd::get_current_graph_task_keep_graph();
  // A consumed buffer of the default cache mode keeps dH after the call, so W1's gradient (E x w1_rows x d, the
  // largest weight gradient) can be allocated once the workspace is freed: finish_backward_w1() computes it then
  // (docs/MEMORY.md). Not when it accumulates into the caller's buffers: nothing is allocated for them then, and
  // they are validated before anything runs.
  const bool w1_later =
      consume && p.cache == machmoe::CacheMode::kPreActivation && !present(into_w1) && !present(into_b1);
  Tensor workspace = byte_buffer(x, machmoe::backward_workspace_bytes(p, a.dtype, library_device(x), consume));
  const ProjectionGrads w2g(op, ProjectionGrads::kW2, p.has_b2, x, w2, b2, into_w2, into_b2, accumulate);
  ProjectionGrads w1g;
  if (!w1_later) w1g = ProjectionGrads(op, ProjectionGrads::kW1, p.has_b1, x, w1, b1, into_w1, into_b1, accumulate);
  machmoe::BackwardOutputs bo;
  ig.attach(op, p, bo);
  w2g.attach(op, bo.grad_weights.w2, bo.grad_weights.b2);
  if (!w1_later) w1g.attach(op, bo.grad_weights.w1, bo.grad_weights.b1);
  bo.grad_weights.accumulate = accumulate;
  bo.w1_grads_later = w1_later;
  const machmoe::BackwardBuffers buffers{saved.data_ptr(), static_cast<std::size_t>(saved.numel()),
                                         workspace.data_ptr(), static_cast<std::size_t>(workspace.numel()), consume};
  machmoe::backward(p, a.x, a.weights, a.routing(), ig.inputs, bo, buffers, stream_for(x));
  if (consume) saved.unsafeGetTensorImpl()->bump_version();  // written from here on, whatever follows
  // (finish_backward_w1 below writes no caller buffer: w1_later requires into_w1 and into_b1 absent.)
  bump_versions({&into_router_weight, &into_w1, &into_b1, &into_w2, &into_b2});
  if (w1_later) {
    // Stream-ordered: the caching allocator hands the workspace's block out again only to work queued after the
    // backward's kernels on this stream. So for the casts of master weights, which dH and dX~ have read.
    workspace = Tensor();
    a.release_weight_casts(op, router_weight, w1, b1, w2, b2);
    w1g = ProjectionGrads(op, ProjectionGrads::kW1, p.has_b1, x, w1, b1, into_w1, into_b1, accumulate);
    machmoe::BackwardOutputs w1_out;
    w1g.attach(op, w1_out.grad_weights.w1, w1_out.grad_weights.b1);
    w1_out.grad_weights.accumulate = accumulate;
    machmoe::finish_backward_w1(p, a.x, a.weights, a.routing(), w1_out, saved.data_ptr(),
                                static_cast<std::size_t>(saved.numel()), stream_for(x));
  }
  return {ig.dx,  ig.dwr.returned, w1g.weight.returned, w1g.bias.returned, w2g.weight.returned, w2g.bias.returned,
          ig.dscores};
}

/// The split backward's input half: (grad_x, grad_router_weight, grad_scores, deferred).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_backward_input(
    const Tensor& grad_out, const OptTensor& grad_logits, const Tensor& x, const OptTensor& router_weight,
    const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2, const OptTensor& token_index,
    const OptTensor& expert_index, const OptTensor& scores, const Tensor& saved, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache,
    double swiglu_alpha, double swiglu_limit,
    const OptTensor& into_router_weight) {
  const char* op = "layer_backward_input";
  const LayerArgs a(op, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                    weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit);
  check_byte_buffer(op, "saved", saved, x, "layer_forward");
  const machmoe::MoEProblem& p = a.p;
  const bool accumulate = present(into_router_weight);
  const InputGrads ig(op, p, x, grad_out, grad_logits, router_weight, into_router_weight, accumulate);
  Tensor workspace = byte_buffer(x, machmoe::backward_input_workspace_bytes(p, a.dtype, library_device(x)));
  Tensor deferred = byte_buffer(x, machmoe::deferred_layout(p, a.dtype).total_bytes);
  machmoe::BackwardOutputs bo;
  ig.attach(op, p, bo);
  bo.grad_weights.accumulate = accumulate;
  machmoe::backward_input(p, a.x, a.weights, a.routing(), ig.inputs, bo,
                           {saved.data_ptr(), static_cast<std::size_t>(saved.numel()), workspace.data_ptr(),
                            static_cast<std::size_t>(workspace.numel())},
                           {deferred.data_ptr(), static_cast<std::size_t>(deferred.numel())}, stream_for(x));
  bump_versions({&into_router_weight});
  return {ig.dx, ig.dwr.returned, ig.dscores, deferred};
}

/// The split backward's weight half: (grad_w1, grad_b1, grad_w2, grad_b2).
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_backward_weight(
    const Tensor& grad_out, const Tensor& x, const OptTensor& router_weight, const Tensor& w1, const OptTensor& b1,
    const Tensor& w2, const OptTensor& b2, const OptTensor& token_index, const OptTensor& expert_index,
    const OptTensor& scores, const Tensor& saved, const Tensor& deferred, int64_t top_k, int64_t activation,
    int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding, int64_t tile, int64_t cache,
    double swiglu_alpha, double swiglu_limit,
    const OptTensor& into_w1, const OptTensor& into_b1, const OptTensor& into_w2, const OptTensor& into_b2) {
  const char* op = "layer_backward_weight";
  const LayerArgs a(op, x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                    weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit,
                    WeightUse::kShapes);
  check_byte_buffer(op, "saved", saved, x, "layer_forward");
  check_byte_buffer(op, "deferred", deferred, x, "layer_backward_input");
  check_defined(op, "grad_out", grad_out);
  const machmoe::MoEProblem& p = a.p;
  const Tensor go = grad_out.contiguous();
  const machmoe::TensorView gov = view(op, "grad_out", go);
  const bool accumulate = any_present({&into_w1, &into_b1, &into_w2, &into_b2});
  const WeightGrads wg(op, p, x, w1, b1, w2, b2, into_w1, into_b1, into_w2, into_b2, accumulate);
  machmoe::BackwardOutputs bo;
  wg.attach(op, bo);
  bo.grad_weights.accumulate = accumulate;
  machmoe::backward_weight(p, a.x, a.weights, a.routing(), gov, bo, saved.data_ptr(),
                            static_cast<std::size_t>(saved.numel()),
                            {deferred.data_ptr(), static_cast<std::size_t>(deferred.numel())}, stream_for(x));
  bump_versions({&into_w1, &into_b1, &into_w2, &into_b2});
  return {wg.w1.weight.returned, wg.w1.bias.returned, wg.w2.weight.returned, wg.w2.bias.returned};
}

/// Size of the saved buffer, for the fake (meta) implementation used by torch.compile. Every argument is checked
/// here under its own name; validate_problem then checks how they combine (K <= E, T*K pairs, ...). T is left to
/// validate_problem alone, which owns the rule for empty inputs.
int64_t saved_nbytes(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, int64_t num_pairs, int64_t activation,
                     int64_t score, int64_t routing, int64_t tile, int64_t cache, int64_t elem_size, int64_t rounding) {
  const char* op = "saved_nbytes";
  using machmoe::Limits;
  machmoe::MoEProblem p;
  p.T = in_range(op, "T", T, 0, Limits::kMaxTokens);
  p.d = in_range(op, "d", d, 1, Limits::kMaxDim);
  p.n = in_range(op, "n", n, 1, Limits::kMaxDim);
  p.E = in_range(op, "E", E, 1, Limits::kMaxExperts);
  p.K = in_range(op, "K", K, 1, E, " (1 <= K <= E)");
  p.num_pairs = in_range(op, "num_pairs", num_pairs, 0, Limits::kMaxPairs);
  p.activation = machmoe::activation_from_code(activation, op, "activation");
  p.score = machmoe::score_variant_from_code(score, op, "score");
  p.routing = machmoe::routing_mode_from_code(routing, op, "routing");
  // The rounding rule bounds token rounding's pairs (nearest, up and down reserve differently: max_pairs()).
  p.rounding = machmoe::rounding_rule_from_code(rounding, op, "rounding");
  p.tile_m = tile_arg(op, tile);
  p.cache = machmoe::cache_mode_from_code(cache, op, "cache");
  machmoe::DType dt = machmoe::DType::kBF16;  // bf16 and fp16 keep the same bytes
  if (elem_size == 8) dt = machmoe::DType::kFP64;
  else if (elem_size == 4) dt = machmoe::DType::kFP32;
  else if (elem_size != 2)
    fail(op, "elem_size", "2, 4 or 8 (bytes per element of x: bf16/fp16, fp32, fp64)", std::to_string(elem_size));
  machmoe::validate_problem(p, op);
  return static_cast<int64_t>(machmoe::saved_layout(p, dt).total_bytes);
}

// ---- index checking (machmoe/index_checking.hpp) -----------------------------------------------------------------

void set_index_checking(bool enabled) { machmoe::set_index_checking(enabled); }

bool index_checking_enabled() { return machmoe::index_checking_enabled(); }

// ---- fallback policy (machmoe/fallback.hpp) ----------------------------------------------------------------------

/// "warn" or "error" (machmoe.set_fallback_policy checks the value first; this repeats it for direct op calls).
void set_fallback_policy(const std::string& policy) {
  if (policy == "warn")
    machmoe::set_fallback_policy(machmoe::FallbackPolicy::kWarn);
  else if (policy == "error")
    machmoe::set_fallback_policy(machmoe::FallbackPolicy::kError);
  else
    machmoe::throw_argument_error("set_fallback_policy", "policy", "'warn' or 'error'", "'" + policy + "'");
}

std::string fallback_policy() { return machmoe::fallback_policy_name(machmoe::fallback_policy()); }

// ---- SM margin (machmoe/sm_margin.hpp) ----------------------------------------------------------------------------

void set_sm_margin(int64_t sms) {
  // Checked before it is narrowed (a value past int's range would wrap into a valid margin).
  machmoe::set_sm_margin(static_cast<int>(
      in_range("set_sm_margin", "sms", sms, 0, std::numeric_limits<int>::max(), " (SMs left to other streams)")));
}

int64_t sm_margin() { return machmoe::sm_margin(); }

/// Waits for the current stream of CUDA device `device` and raises a recorded index violation (ValueError).
void check_device_errors(int64_t device) {
  const char* op = "check_device_errors";
  // Checked before it is narrowed (torch's device index is 8-bit: 2^32 would become device 0).
  const auto ordinal = static_cast<c10::DeviceIndex>(
      in_range(op, "device", device, 0, std::numeric_limits<c10::DeviceIndex>::max(), " (a CUDA device ordinal)"));
  const machmoe::Device d = machmoe::Device::cuda(ordinal);
  // A device the library cannot use (a build without CUDA, an ordinal this process does not see) gets the library's
  // message: the stream lookup below would raise torch's raw CUDA error first. The call throws before it reads the
  // stream.
  if (!machmoe::built_with_cuda() || ordinal >= machmoe::cuda_device_count()) machmoe::check_device_errors(d, nullptr);
  machmoe::check_device_errors(d, static_cast<void*>(c10::cuda::getCurrentCUDAStream(ordinal).stream()));
}

/// The expert of each of `rows` pre-dispatched rows from per-expert counts (int32 when rows fit, else int64).
Tensor grouped_expert_index(const Tensor& counts, int64_t rows) {
  if (rows < 0) machmoe::throw_argument_error("grouped_expert_index", "rows", "a count >= 0", std::to_string(rows));
  const at::ScalarType type = rows <= machmoe::Limits::kMaxPairs ? at::kInt : at::kLong;
  Tensor index = at::empty({rows}, counts.options().dtype(type));
  machmoe::grouped_expert_index(view("grouped_expert_index", "counts", counts),
                                view("grouped_expert_index", "index", index), stream_for(counts));
  return index;
}

// ---- the combine step (machmoe/combine.hpp) ----------------------------------------------------------------------

/// out (num_tokens, d) = each token's score-weighted sum of its pairs' rows (machmoe.parallel's combine; without
/// scores the plain sum: the gradient of its dispatch).
Tensor combine_rows(const Tensor& rows, const OptTensor& scores, const Tensor& row_of_pair,
                    const OptTensor& token_offsets, int64_t top_k, int64_t num_tokens) {
  const char* op = "combine_rows";
  check_rank(op, "rows", rows, 2, "an (R, d) tensor");
  in_range(op, "num_tokens", num_tokens, 0, machmoe::Limits::kMaxTokens);
  Tensor out = at::empty({num_tokens, rows.size(1)}, rows.options());
  machmoe::combine_rows(view(op, "rows", rows), view(op, "scores", scores), view(op, "row_of_pair", row_of_pair),
                        view(op, "token_offsets", token_offsets), top_k, view(op, "out", out), stream_for(rows));
  return out;
}

/// (grad_rows, grad_scores) of combine_rows; either is an empty (0,) tensor when not wanted. zero_rows: grad_rows
/// starts as zeros (some rows are read by no pair), else uninitialised (every row is read by one pair).
std::tuple<Tensor, Tensor> combine_rows_backward(const Tensor& grad_out, const Tensor& rows, const Tensor& scores,
                                                 const Tensor& row_of_pair, const OptTensor& token_offsets,
                                                 int64_t top_k, bool want_rows, bool want_scores, bool zero_rows) {
  const char* op = "combine_rows_backward";
  check_rank(op, "rows", rows, 2, "an (R, d) tensor");
  check_rank(op, "row_of_pair", row_of_pair, 1, "a (P,) tensor");
  check_defined(op, "scores", scores);
  Tensor grad_rows = !want_rows ? rows.new_empty({0}) : zero_rows ? at::zeros_like(rows) : at::empty_like(rows);
  Tensor grad_scores = want_scores ? at::empty({row_of_pair.size(0)}, scores.options()) : scores.new_empty({0});
  machmoe::combine_rows_backward(view(op, "grad_out", grad_out), view(op, "rows", rows), view(op, "scores", scores),
                                 view(op, "row_of_pair", row_of_pair), view(op, "token_offsets", token_offsets),
                                 top_k, want_rows ? view(op, "grad_rows", grad_rows) : machmoe::TensorView(),
                                 want_scores ? view(op, "grad_scores", grad_scores) : machmoe::TensorView(),
                                 stream_for(rows));
  return {grad_rows, grad_scores};
}

// ---- benchmark helper: the C++ layer timed in the caller's process ------------------------------------------

/// Times machmoe::forward and machmoe::backward themselves, as machmoe-bench does (benchmarks/gpu_bench.cu): every
/// output, gradient, saved buffer and workspace allocated once before the loop, CUDA events on the current stream,
/// no autograd, no Python. python -m machmoe.benchmark.overhead compares MoE.forward with it on the same weights.
/// Each repetition first draws fresh x and grad_out in place (normal_, outside the timed region), then times one
/// forward and, separately, one forward followed by one backward (a training step's layer work). `isolated`:
/// the stream is synchronised before each timed region, so host latency before the first kernel counts, as in
/// machmoe-bench's median_ms; otherwise the host queues every repetition ahead and only GPU time counts. Returns a
/// (iters, 2) float64 CPU tensor of milliseconds: forward, forward + backward.
Tensor time_layer(Tensor& x, const Tensor& router_weight, const Tensor& w1, const Tensor& w2, Tensor& grad_out,
                  int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score, int64_t routing,
                  int64_t rounding, int64_t tile, int64_t cache, int64_t warmup, int64_t iters, bool isolated,
                  double swiglu_alpha, double swiglu_limit) {
  const char* op = "time_layer";
  check_defined(op, "x", x);
  if (!x.is_cuda()) fail(op, "x", "a CUDA tensor (this op times the GPU layer)", "a tensor on " + x.device().str());
  in_range(op, "warmup", warmup, 0, 100000);
  in_range(op, "iters", iters, 1, 100000);
  const OptTensor none;
  const LayerArgs a(op, x, router_weight, w1, none, w2, none, none, none, none, top_k, activation, weight_layout,
                    score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit);
  const machmoe::MoEProblem& p = a.p;
  if (a.caller) fail(op, "routing", "topk or token_rounding (the router picks the pairs)", "caller");
  check_defined(op, "grad_out", grad_out);
  if (grad_out.sizes() != x.sizes() || grad_out.scalar_type() != x.scalar_type() || grad_out.device() != x.device())
    fail(op, "grad_out",
         "a tensor of x's shape, dtype and device (" + shape_of(x) + ", " + c10::toString(x.scalar_type()) + ", " +
             x.device().str() + ")",
         shape_of(grad_out) + ", " + c10::toString(grad_out.scalar_type()) + ", " + grad_out.device().str());
  // Both are refilled in place each repetition: plain contiguous storage the library reads as given.
  if (!x.is_contiguous()) fail(op, "x", "a contiguous tensor", "a non-contiguous one");
  if (!grad_out.is_contiguous()) fail(op, "grad_out", "a contiguous tensor", "a non-contiguous one");

  const auto o = x.options();
  Tensor out = at::empty({p.T, p.d}, o), logits = at::empty({p.T, p.E}, o), counts = at::empty({p.E}, o.dtype(at::kInt));
  Tensor saved = byte_buffer(x, machmoe::saved_layout(p, a.dtype).total_bytes);
  Tensor fws = byte_buffer(x, machmoe::forward_workspace_bytes(p, a.dtype, library_device(x)));
  Tensor bws = byte_buffer(x, machmoe::backward_workspace_bytes(p, a.dtype, library_device(x)));
  Tensor dx = at::empty_like(x), dwr = at::empty_like(router_weight), dw1 = at::empty_like(w1), dw2 = at::empty_like(w2);
  machmoe::ForwardOutputs fo;
  fo.out = view(op, "out", out), fo.router_logits = view(op, "router_logits", logits);
  fo.expert_counts = view(op, "expert_counts", counts);
  machmoe::BackwardInputs bi;
  bi.grad_out = view(op, "grad_out", grad_out);
  machmoe::BackwardOutputs bo;
  bo.grad_x = view(op, "grad_x", dx);
  bo.grad_weights.router_weight = view(op, "grad_router_weight", dwr);
  bo.grad_weights.w1 = view(op, "grad_w1", dw1), bo.grad_weights.w2 = view(op, "grad_w2", dw2);
  const machmoe::ForwardBuffers fb{saved.data_ptr(), static_cast<std::size_t>(saved.numel()), fws.data_ptr(),
                                   static_cast<std::size_t>(fws.numel())};
  const machmoe::BackwardBuffers bb{saved.data_ptr(), static_cast<std::size_t>(saved.numel()), bws.data_ptr(),
                                    static_cast<std::size_t>(bws.numel())};
  void* s = stream_for(x);
  const c10::Stream stream = c10::cuda::getCurrentCUDAStream(x.get_device());
  const auto forward = [&] { machmoe::forward(p, a.x, a.weights, nullptr, fo, fb, s); };
  const auto backward = [&] { machmoe::backward(p, a.x, a.weights, nullptr, bi, bo, bb, s); };

  // Four events per timed repetition (c10's device-generic events: no CUDA runtime symbol in this library).
  std::vector<c10::Event> ev;
  ev.reserve(static_cast<std::size_t>(4 * iters));
  for (int64_t i = 0; i < 4 * iters; ++i) ev.emplace_back(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  for (int64_t i = -warmup; i < iters; ++i) {
    {
      const at::NoGradGuard no_grad;
      x.normal_();
      grad_out.normal_();
    }
    c10::Event* e = i >= 0 ? &ev[static_cast<std::size_t>(4 * i)] : nullptr;
    if (isolated) stream.synchronize();
    if (e) e[0].record(stream);
    forward();
    if (e) e[1].record(stream);
    if (isolated) stream.synchronize();
    if (e) e[2].record(stream);
    forward();
    backward();
    if (e) e[3].record(stream);
  }
  stream.synchronize();
  Tensor times = at::empty({iters, 2}, at::TensorOptions().dtype(at::kDouble));
  double* t = times.data_ptr<double>();
  for (int64_t i = 0; i < iters; ++i) {
    const c10::Event* e = &ev[static_cast<std::size_t>(4 * i)];
    t[2 * i] = e[0].elapsedTime(e[1]);
    t[2 * i + 1] = e[2].elapsedTime(e[3]);
  }
  return times;
}

/// W1 of the concatenated layout as an (E, 2, n, d) view of two tensors, the gate weights `gate` and the up weights
/// `up` (torchtitan's w1 and w3, each (E, n, d)), without a copy: dimension 1 steps from gate row j to up row j,
/// across the two allocations. The library reads such a view in place (layer.hpp, LayerWeights::w1). The view keeps
/// both tensors' storages alive; it is valid while they stay where they are (a tensor whose storage is freed and
/// allocated again, as FSDP2 does between forward and backward, must be viewed again). Both must have the same
/// shape, dtype, device and strides, unit stride along d, and `up` must start after `gate` by a whole number of
/// elements (a view has one stride per dimension, and the GPU kernels' tensor maps take positive strides only).
Tensor w1_halves_view(const Tensor& gate, const Tensor& up) {
  const char* op = "_w1_halves_view";
  check_rank(op, "gate", gate, 3, "an (E, n, d) tensor");
  check_rank(op, "up", up, 3, "an (E, n, d) tensor");
  if (up.sizes() != gate.sizes() || up.strides() != gate.strides() || up.scalar_type() != gate.scalar_type() ||
      up.device() != gate.device())
    fail(op, "up", "the shape, strides, dtype and device of gate (" + shape_of(gate) + ")",
         "shape " + shape_of(up) + ", " + c10::toString(up.scalar_type()) + " on " + up.device().str());
  if (gate.stride(2) != 1 && gate.size(2) > 1) fail(op, "gate", "unit stride along d", std::to_string(gate.stride(2)));
  const auto el = static_cast<std::intptr_t>(gate.element_size());
  const std::intptr_t apart = reinterpret_cast<std::intptr_t>(up.data_ptr()) -
                              reinterpret_cast<std::intptr_t>(gate.data_ptr());
  if (apart <= 0 || apart % el != 0)
    fail(op, "up", "data starting a whole number of elements after gate's",
         std::to_string(apart) + " bytes after it");
  c10::Storage gate_storage = gate.storage(), up_storage = up.storage();
  return at::from_blob(
      gate.data_ptr(), {gate.size(0), 2, gate.size(1), gate.size(2)},
      {gate.stride(0), static_cast<int64_t>(apart / el), gate.stride(1), gate.stride(2)},
      [gate_storage, up_storage](void*) {}, gate.options());
}

}  // namespace

TORCH_LIBRARY(machmoe, m) {
  m.def(
      "layer_forward(Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "Tensor? token_index, Tensor? expert_index, Tensor? scores, int top_k, int activation, int weight_layout, "
      "int score, int routing, int rounding, int tile, int cache, float swiglu_alpha=1.702, float swiglu_limit=7.0, "
      "Tensor? into_router_weight=None, Tensor? into_w1=None, Tensor? into_b1=None, Tensor? into_w2=None, "
      "Tensor? into_b2=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward(Tensor grad_out, Tensor? grad_logits, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, "
      "Tensor w2, Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, int top_k, "
      "int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache, "
      "float swiglu_alpha=1.702, float swiglu_limit=7.0, Tensor(a!)? into_router_weight=None, "
      "Tensor(b!)? into_w1=None, Tensor(c!)? into_b1=None, Tensor(d!)? into_w2=None, Tensor(e!)? into_b2=None, "
      "bool consume_saved=False) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward_input(Tensor grad_out, Tensor? grad_logits, Tensor x, Tensor? router_weight, Tensor w1, "
      "Tensor? b1, Tensor w2, Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, "
      "int top_k, int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache, "
      "float swiglu_alpha=1.702, float swiglu_limit=7.0, Tensor(a!)? into_router_weight=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_backward_weight(Tensor grad_out, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, "
      "Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, Tensor deferred, "
      "int top_k, int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache, "
      "float swiglu_alpha=1.702, float swiglu_limit=7.0, Tensor(a!)? into_w1=None, Tensor(b!)? into_b1=None, "
      "Tensor(c!)? into_w2=None, Tensor(d!)? into_b2=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "saved_nbytes(int T, int d, int n, int E, int K, int num_pairs, int activation, int score, int routing, "
      "int tile, int cache, int elem_size, int rounding=0) -> int");
  m.impl("saved_nbytes", &saved_nbytes);
  m.def("set_index_checking(bool enabled) -> ()");
  m.impl("set_index_checking", &set_index_checking);
  m.def("index_checking_enabled() -> bool");
  m.impl("index_checking_enabled", &index_checking_enabled);
  m.def("set_fallback_policy(str policy) -> ()");
  m.impl("set_fallback_policy", &set_fallback_policy);
  m.def("fallback_policy() -> str");
  m.impl("fallback_policy", &fallback_policy);
  m.def("set_sm_margin(int sms) -> ()");
  m.impl("set_sm_margin", &set_sm_margin);
  m.def("sm_margin() -> int");
  m.impl("sm_margin", &sm_margin);
  m.def("check_device_errors(int device) -> ()");
  m.impl("check_device_errors", &check_device_errors);
  // SymInt: under torch.compile the row count is the (possibly dynamic) size of the grouped input; an int argument
  // would guard it to the traced value. The kernel takes it as int64_t (the dispatcher converts a concrete SymInt).
  m.def("grouped_expert_index(Tensor counts, SymInt rows) -> Tensor");
  m.def("combine_rows(Tensor rows, Tensor? scores, Tensor row_of_pair, Tensor? token_offsets, int top_k, "
        "int num_tokens) -> Tensor");
  m.def("combine_rows_backward(Tensor grad_out, Tensor rows, Tensor scores, Tensor row_of_pair, "
        "Tensor? token_offsets, int top_k, bool want_rows, bool want_scores, bool zero_rows) -> (Tensor, Tensor)");
  m.def("_w1_halves_view(Tensor gate, Tensor up) -> Tensor");
}

namespace {
/// The tensor operators' kernels, the same functions for CPU and CUDA tensors (each dispatches on its inputs' device).
/// Not CompositeExplicitAutograd: that key would also take Meta tensors, which have the fake implementations instead.
void register_tensor_kernels(torch::Library& m) {
  m.impl("grouped_expert_index", &grouped_expert_index);
  m.impl("combine_rows", &combine_rows);
  m.impl("combine_rows_backward", &combine_rows_backward);
  m.impl("layer_forward", &layer_forward);
  m.impl("layer_backward", &layer_backward);
  m.impl("layer_backward_input", &layer_backward_input);
  m.impl("layer_backward_weight", &layer_backward_weight);
  m.impl("_w1_halves_view", &w1_halves_view);
}
}  // namespace

TORCH_LIBRARY_IMPL(machmoe, CPU, m) { register_tensor_kernels(m); }

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) { register_tensor_kernels(m); }

// The benchmark helper, apart from the layer's operators (python/machmoe/benchmark/overhead.py uses it).
TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def(
      "time_layer(Tensor(a!) x, Tensor router_weight, Tensor w1, Tensor w2, Tensor(b!) grad_out, int top_k, "
      "int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache, int warmup, "
      "int iters, bool isolated, float swiglu_alpha=1.702, float swiglu_limit=7.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(machmoe, CPU, m) { m.impl("time_layer", &time_layer); }  // (fails clearly: GPU only)

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) { m.impl("time_layer", &time_layer); }
