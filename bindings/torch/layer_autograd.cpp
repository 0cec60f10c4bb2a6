// The Autograd kernel of machmoe::layer_forward, in C++ (target T14: host time before the first kernel).
//
// A Python Autograd kernel costs a Python frame per layer, an autograd.Function node built in Python, and a round
// trip of the 24 arguments from IValues to Python objects and back before the operator reaches its CPU or CUDA
// kernel. Here the forward stays in C++ from the dispatcher to the library: a torch::autograd::Function node that
// saves what the backward reads.
//
// The backward runs in C++ in the common case: an eager backward that does not build a graph of its own. Three
// cases need the Python form (python/machmoe/_ops.py, `_autograd_backward`), which this kernel calls through the
// operator machmoe::_layer_autograd_backward that Python implements:
//   * create_graph=True: the gradients are wrapped so that differentiating them again raises;
//   * inside machmoe.defer_weight_grads: the deferral stack lives in Python, stashed in torch's thread-local Python
//     objects (which autograd carries into its worker threads); the object there says whether one is open;
//   * tracing (torch.compile / AOTAutograd, any Python dispatch mode or tensor subclass): the traced backward must
//     not consume the saved buffer, since the operator's schema does not declare that write.
// The common case is the Python form with none of those active, translated (both map gradients the same way; the
// tests compare them bitwise).
#include <ATen/ATen.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>

#include "machmoe/error.hpp"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kCallerRouting = 2;  // machmoe::RoutingMode::kCallerSupplied
// The key python/machmoe/_ops.py stashes a thread's defer_weight_grads stack under (_STACK_KEY), and the address
// of the object it stashes there while the thread has no active context (_NO_STACK; 0 until machmoe is imported).
constexpr const char* kDeferralStackKey = "machmoe.defer_weight_grads";
std::atomic<std::uintptr_t> g_no_deferral_marker{0};

void set_no_deferral_marker(int64_t address) {
  g_no_deferral_marker.store(static_cast<std::uintptr_t>(address), std::memory_order_relaxed);
}

/// Whether the thread that started this backward has a defer_weight_grads context open: the object stashed under
/// its key is not the no-context marker (only addresses are compared; no Python is called).
bool deferral_active() {
  if (!at::impl::ThreadLocalPythonObjects::contains(kDeferralStackKey)) return false;
  const std::shared_ptr<c10::SafePyObject>& stashed = at::impl::ThreadLocalPythonObjects::get(kDeferralStackKey);
  if (!stashed) return false;
  const auto address = reinterpret_cast<std::uintptr_t>(stashed->ptr(&stashed->pyinterpreter()));
  return address != g_no_deferral_marker.load(std::memory_order_relaxed);
}

// The forward's tensor inputs, in the operator's order; the backward returns one gradient per forward argument.
enum Input : int { kX, kRouterWeight, kW1, kB1, kW2, kB2, kTokenIndex, kExpertIndex, kScores, kNumTensorInputs };
// top_k, activation, weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit
constexpr int kNumOptions = 10;
constexpr int kNumInto = 5;  // into_router_weight, into_w1, into_b1, into_w2, into_b2
constexpr std::array<const char*, kNumInto> kIntoKeys{"into_router_weight", "into_w1", "into_b1", "into_w2",
                                                      "into_b2"};
constexpr int kNumForwardArgs = kNumTensorInputs + kNumOptions + kNumInto;

/// The integer options and the activation's parameters, as the operators take them.
struct Options {
  std::array<int64_t, 8> ints;  // top_k, activation, weight_layout, score, routing, rounding, tile, cache
  double swiglu_alpha, swiglu_limit;
};

using ForwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
// The operators' C++ signatures (bindings/torch/machmoe_ops.cpp registers their kernels with these).
using ForwardSignature = ForwardResult(const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const Tensor&,
                                       const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t,
                                       int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,
                                       const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                       const OptTensor&);
using BackwardSignature = BackwardResult(const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                         const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&, int64_t,
                                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                                         double, const OptTensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&, bool);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("machmoe::layer_forward", "").typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("machmoe::layer_backward", "").typed<BackwardSignature>();
  return op;
}

const c10::OperatorHandle& python_backward_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("machmoe::_layer_autograd_backward", "");
  return op;
}

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor def(const OptTensor& t) { return t ? *t : Tensor(); }

/// Whether the backward runs under a tracer or a Python tensor subclass: a Python dispatch mode is active (fake
/// tensors, proxy tracing, functionalization) or a tensor it reads carries the Python or Functionalize key.
bool traced(std::initializer_list<const Tensor*> tensors) {
  if (c10::impl::dispatch_mode_enabled()) return true;
  const c10::DispatchKeySet python_keys{c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                        c10::DispatchKey::Functionalize};
  for (const Tensor* t : tensors)
    if (t->defined() && t->key_set().has_any(python_keys)) return true;
  return false;
}

struct LayerFunction : torch::autograd::Function<LayerFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& router_weight,
                               const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                               const OptTensor& token_index, const OptTensor& expert_index, const OptTensor& scores,
                               int64_t top_k, int64_t activation, int64_t weight_layout, int64_t score,
                               int64_t routing, int64_t rounding, int64_t tile, int64_t cache, double swiglu_alpha,
                               double swiglu_limit, const OptTensor& into_router_weight, const OptTensor& into_w1,
                               const OptTensor& into_b1, const OptTensor& into_w2, const OptTensor& into_b2) {
    Tensor out, logits, counts, saved;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, logits, counts, saved) = forward_op().call(
          x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation, weight_layout,
          score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit, into_router_weight, into_w1, into_b1,
          into_w2, into_b2);
    }
    // The gradients of outputs the loss does not use (logits, counts, saved) arrive undefined instead of as zeros:
    // materialising them would allocate and zero-fill the whole saved buffer in every backward.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, def(router_weight), w1, def(b1), w2, def(b2), def(token_index), def(expert_index),
                            def(scores), saved});
    ctx->saved_data["options"] = c10::List<int64_t>({top_k, activation, weight_layout, score, routing, rounding,
                                                     tile, cache});
    ctx->saved_data["swiglu_alpha"] = swiglu_alpha;
    ctx->saved_data["swiglu_limit"] = swiglu_limit;
    // The buffers the backward adds weight gradients into (accumulation mode), kept by reference rather than as
    // saved tensors: another micro-batch's backward may add into them between this forward and its backward, which
    // a saved tensor's version check would refuse. One entry each, a tensor or None: compiled autograd swaps a
    // tensor entry of saved_data for its proxy while it traces the backward, but not the tensors inside a list
    // (a list held them once, and its trace then met the real buffers and failed).
    const std::array<const OptTensor*, kNumInto> into{&into_router_weight, &into_w1, &into_b1, &into_w2, &into_b2};
    for (int i = 0; i < kNumInto; ++i)
      ctx->saved_data[kIntoKeys[i]] = *into[i] ? c10::IValue(**into[i]) : c10::IValue();
    return {out, logits, counts, saved};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor &x = s[kX], &router_weight = s[kRouterWeight], &w1 = s[kW1], &b1 = s[kB1], &w2 = s[kW2],
                 &b2 = s[kB2], &token_index = s[kTokenIndex], &expert_index = s[kExpertIndex], &scores = s[kScores],
                 &saved = s[kNumTensorInputs];
    const c10::List<int64_t> o = ctx->saved_data["options"].toIntList();
    const Options opts{{o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]},
                       ctx->saved_data["swiglu_alpha"].toDouble(),
                       ctx->saved_data["swiglu_limit"].toDouble()};
    std::array<OptTensor, kNumInto> into;
    for (int i = 0; i < kNumInto; ++i) {
      const c10::IValue& v = ctx->saved_data[kIntoKeys[i]];
      if (v.isTensor()) into[i] = v.toTensor();
    }

    // Whether autograd wants each tensor input's gradient (its edge index counts only the inputs present).
    std::array<bool, kNumTensorInputs> needs{};
    for (int i = 0, edge = 0; i < kNumTensorInputs; ++i)
      if (s[i].defined()) needs[i] = ctx->needs_input_grad(edge++);

    const Tensor& grad_out = grads[0];
    const Tensor& grad_logits = grads[1];
    variable_list result(kNumForwardArgs);
    if (at::GradMode::is_enabled() || deferral_active() || traced({&grad_out, &grad_logits, &x, &w1, &w2, &saved})) {
      python_backward(grad_out, grad_logits, s, opts, into, needs, result);
      return result;
    }

    const bool caller = opts.ints[4] == kCallerRouting;
    // A buffer receives its weight's gradient only when autograd wants that gradient.
    for (int i = 0; i < kNumInto; ++i)
      if (into[i] && !needs[kRouterWeight + i]) into[i] = std::nullopt;
    const Tensor go = grad_out.defined() ? grad_out : at::zeros_like(x);  // a loss on the router logits alone
    const OptTensor gl =
        caller || !grad_logits.defined() || grad_logits.numel() == 0 ? std::nullopt : OptTensor(grad_logits);
    // consume_saved: nothing reads the saved buffer after this backward unless the graph is retained, which the
    // operator checks; it then writes dH over the saved H (docs/MEMORY.md).
    // A refused argument (machmoe::Error, a std::invalid_argument) leaves here through autograd's engine, which
    // raises what is not a c10::Error as RuntimeError; rethrown as c10::ValueError it reaches Python as the
    // ValueError the same refusal gives outside autograd (docs/VALIDATION.md).
    auto [dx, dwr, dw1, db1, dw2, db2, dscores] = [&] {
      try {
        return backward_op().call(go, gl, x, opt(router_weight), w1, opt(b1), w2, opt(b2), opt(token_index),
                                  opt(expert_index), opt(scores), saved, opts.ints[0], opts.ints[1], opts.ints[2],
                                  opts.ints[3], opts.ints[4], opts.ints[5], opts.ints[6], opts.ints[7],
                                  opts.swiglu_alpha, opts.swiglu_limit, into[0], into[1], into[2], into[3], into[4],
                                  /*consume_saved=*/true);
      } catch (const machmoe::Error& e) {
        C10_THROW_ERROR(ValueError, e.what());
      }
    }();
    // Gradients added into caller buffers are not returned: those weights' .grad stays as it was.
    result[kX] = dx;
    if (!caller && router_weight.defined() && !into[0]) result[kRouterWeight] = dwr;
    if (!into[1]) result[kW1] = dw1;
    if (b1.defined() && !into[2]) result[kB1] = db1;
    if (!into[3]) result[kW2] = dw2;
    if (b2.defined() && !into[4]) result[kB2] = db2;
    if (caller) result[kScores] = dscores;
    return result;
  }

  /// The backward's general form, implemented in Python (python/machmoe/_ops.py, _autograd_backward).
  static void python_backward(const Tensor& grad_out, const Tensor& grad_logits, const variable_list& s,
                              const Options& opts, const std::array<OptTensor, kNumInto>& into,
                              const std::array<bool, kNumTensorInputs>& needs, variable_list& result) {
    const c10::OperatorHandle& op = python_backward_op();
    TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                "machmoe: this backward (create_graph=True, defer_weight_grads or a traced graph) is implemented "
                "in Python: import machmoe in this process.");
    torch::jit::Stack stack;
    stack.reserve(12 + kNumOptions + kNumInto + 1);
    stack.emplace_back(opt(grad_out));
    stack.emplace_back(opt(grad_logits));
    for (int i = 0; i < kNumTensorInputs; ++i) stack.emplace_back(opt(s[i]));
    stack.emplace_back(s[kNumTensorInputs]);  // saved
    for (int64_t v : opts.ints) stack.emplace_back(v);
    stack.emplace_back(opts.swiglu_alpha);
    stack.emplace_back(opts.swiglu_limit);
    for (const OptTensor& t : into) stack.emplace_back(t);
    c10::List<bool> needs_list;
    needs_list.reserve(kNumTensorInputs);
    for (bool b : needs) needs_list.push_back(b);
    stack.emplace_back(std::move(needs_list));
    op.callBoxed(stack);
    const c10::List<OptTensor> grads = stack.back().toOptionalTensorList();
    TORCH_CHECK(grads.size() == kNumTensorInputs, "machmoe: _layer_autograd_backward returned ", grads.size(),
                " gradients, expected ", static_cast<int>(kNumTensorInputs));
    for (int i = 0; i < kNumTensorInputs; ++i) result[i] = def(grads.get(i));
  }
};

bool requires_grad(const Tensor& t) { return t.requires_grad(); }
bool requires_grad(const OptTensor& t) { return t && t->defined() && t->requires_grad(); }

ForwardResult layer_forward_autograd(const Tensor& x, const OptTensor& router_weight, const Tensor& w1,
                                     const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                                     const OptTensor& token_index, const OptTensor& expert_index,
                                     const OptTensor& scores, int64_t top_k, int64_t activation,
                                     int64_t weight_layout, int64_t score, int64_t routing, int64_t rounding,
                                     int64_t tile, int64_t cache, double swiglu_alpha, double swiglu_limit,
                                     const OptTensor& into_router_weight, const OptTensor& into_w1,
                                     const OptTensor& into_b1, const OptTensor& into_w2, const OptTensor& into_b2) {
  if (at::GradMode::is_enabled() &&
      (requires_grad(x) || requires_grad(router_weight) || requires_grad(w1) || requires_grad(b1) ||
       requires_grad(w2) || requires_grad(b2) || requires_grad(scores))) {
    const variable_list r = LayerFunction::apply(
        x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation, weight_layout, score,
        routing, rounding, tile, cache, swiglu_alpha, swiglu_limit, into_router_weight, into_w1, into_b1, into_w2,
        into_b2);
    return {r[0], r[1], r[2], r[3]};
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return forward_op().call(x, router_weight, w1, b1, w2, b2, token_index, expert_index, scores, top_k, activation,
                           weight_layout, score, routing, rounding, tile, cache, swiglu_alpha, swiglu_limit,
                           into_router_weight, into_w1, into_b1, into_w2, into_b2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  // The autograd backward's general form (create_graph, defer_weight_grads, tracing), implemented in Python as a
  // CompositeImplicitAutograd kernel: `needs_input_grad` has one entry per tensor input of layer_forward (x ...
  // scores); the result one gradient (or None) per tensor input.
  m.def(
      "_layer_autograd_backward(Tensor? grad_out, Tensor? grad_logits, Tensor x, Tensor? router_weight, Tensor w1, "
      "Tensor? b1, Tensor w2, Tensor? b2, Tensor? token_index, Tensor? expert_index, Tensor? scores, Tensor saved, "
      "int top_k, int activation, int weight_layout, int score, int routing, int rounding, int tile, int cache, "
      "float swiglu_alpha, float swiglu_limit, Tensor? into_router_weight, Tensor? into_w1, Tensor? into_b1, "
      "Tensor? into_w2, Tensor? into_b2, bool[] needs_input_grad) -> Tensor?[]");
  // python/machmoe/_ops.py registers the address of its no-context marker once, at import.
  m.def("_set_no_deferral_marker(int address) -> ()");
  m.impl("_set_no_deferral_marker", &set_no_deferral_marker);
}

TORCH_LIBRARY_IMPL(machmoe, Autograd, m) { m.impl("layer_forward", &layer_forward_autograd); }
