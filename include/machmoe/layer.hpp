// The MoE layer: forward and backward over caller memory. Torch-free.
//
// Row orders (docs/SPEC.md §1): "pair order" indexes routed (token, expert) pairs (p = t*K + k for top-K routing, the
// caller's triple order for caller-supplied routing, (token, expert)-sorted for token rounding); "grouped order"
// sorts pairs by expert, ascending pair order within an expert.
//
// Every function validates all of its arguments before touching any output, and throws machmoe::Error.
#pragma once

#include <cstddef>

#include "machmoe/memory.hpp"
#include "machmoe/problem.hpp"
#include "machmoe/tensor.hpp"

namespace machmoe {

/// Parameters, all of the layer's data dtype. W1 is (E, w1_rows, d) and W2 is (E, d, n): nn.Linear (out, in)
/// per expert. Biases are empty views unless problem.has_b1 / has_b2.
///
/// W1 of the concatenated layout of a GLU activation may also be an (E, 2, n, d) view, dimension 1 stepping from
/// gate row j to up row j: gate and up weights held apart (torchtitan's w1 and w3, two allocations) are then read in
/// place, without a concatenation. Each half must be a well-formed (E, n, d) view and the up half must lie after the
/// gate half (a positive stride along dimension 1); halves that interleave must form a row-major view, so that no
/// element is shared. The GPU kernels take it where that stride is a multiple of 16 bytes below 2^40 bytes (else the
/// reference GEMMs run, with the fallback notice). W1's gradient may be such a view too; b1 stays (E, 2n).
struct LayerWeights {
  TensorView router_weight;  // (E, d); unused (may be empty) for caller-supplied routing
  TensorView w1;             // (E, 2n, d) for GLU activations (or (E, 2, n, d): above), (E, n, d) otherwise
  TensorView b1;             // (E, 2n) / (E, n) or empty
  TensorView w2;             // (E, d, n)
  TensorView b2;             // (E, d) or empty
};

/// Gradients, same shapes as LayerWeights; every present weight needs its gradient. Each gradient's dtype is the
/// layer's data dtype or fp32 (e.g. fp32 gradients of bf16 weights: the GEMMs accumulate in fp32 and round once,
/// to the gradient's dtype).
///
/// `accumulate` (default false: overwrite) adds the weight gradients into the buffers instead, for gradient
/// accumulation across micro-batches (Megatron-style fp32 `main_grad`): grad = grad + dL/dW, the sum taken in fp32
/// (fp64 for fp64 data) and rounded once to the buffer's dtype, with no extra kernel, copy or workspace. It covers
/// every weight gradient of the call (router_weight, w1, b1, w2, b2); grad_x and the score gradients are always
/// overwritten. Experts that receive no pair leave their buffers unchanged, and so does a call with no pairs
/// (T = 0); with caller-supplied routing the router's gradient, which is zero, leaves it unchanged too. In the
/// split backward, backward_input() honours it for router_weight and backward_weight() for w1, b1, w2, b2.
struct LayerWeightGrads {
  TensorView router_weight, w1, b1, w2, b2;
  bool accumulate = false;
};

/// Caller-supplied routing: num_pairs triples, token indices ascending (pairs of one token are contiguous),
/// token in [0, T), expert in [0, E). Indices int32 or int64; scores of the score dtype (memory.hpp).
struct RoutingTriples {
  TensorView token_index;   // (P)
  TensorView expert_index;  // (P)
  TensorView score;         // (P)
};

struct ForwardOutputs {
  TensorView out;            // (T, d), data dtype
  TensorView router_logits;  // (T, E), data dtype; empty for caller-supplied routing
  TensorView expert_counts;  // (E), int32: pairs routed to each expert (after token rounding)
};

/// Caller memory for the forward. `saved` must hold saved_layout(...).total_bytes and stays untouched by the
/// caller until backward() returns; `workspace` must hold forward_workspace_bytes(...). Every caller buffer (these,
/// the backward's and the deferred one) starts at a multiple of kBufferAlignment (16) bytes (memory.hpp).
struct ForwardBuffers {
  void* saved = nullptr;
  std::size_t saved_bytes = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

struct BackwardBuffers {
  const void* saved = nullptr;  // filled by forward() for the same problem and inputs
  std::size_t saved_bytes = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  /// The caller hands the saved buffer over to this backward (backward() only; default false: `saved` is only
  /// read). The backward may then write into it: in kPreActivation mode on the GPU, dH overwrites the saved H (each
  /// element is read before it is overwritten), so the workspace shrinks to
  /// backward_workspace_bytes(..., consume_saved = true), P x w1_rows elements less. `saved` must then point to
  /// writable memory, and the buffer cannot serve a second backward. Results are bitwise those of a backward that
  /// does not consume it.
  bool consume_saved = false;
};

struct BackwardInputs {
  TensorView grad_out;            // (T, d): dL/d out
  TensorView grad_router_logits;  // (T, E) or empty: dL/d router_logits from losses on the logits (aux, z-loss)
};

struct BackwardOutputs {
  TensorView grad_x;        // (T, d)
  LayerWeightGrads grad_weights;
  TensorView grad_scores;   // (P), caller-supplied routing only: dL/d score in the caller's pair order
  /// backward() only, with BackwardBuffers::consume_saved in kPreActivation mode: grad_weights.w1 and b1 are left
  /// empty and computed afterwards by finish_backward_w1() from the dH this backward leaves over the saved H. The
  /// caller can then free the backward's workspace before it allocates W1's gradient, which lowers the peak where
  /// that gradient is large (docs/MEMORY.md). Results are bitwise those of one backward() call.
  bool w1_grads_later = false;
};

/// Runs the forward. `routing` is read only for RoutingMode::kCallerSupplied (pass nullptr otherwise).
/// `stream` is a cudaStream_t for CUDA tensors (nullptr: the default stream) and must be nullptr for CPU.
/// CPU tensors of fp32/fp64 run the CPU reference.
void forward(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
             const RoutingTriples* routing, const ForwardOutputs& outputs, const ForwardBuffers& buffers,
             void* stream = nullptr);

/// Runs the backward of the forward whose `saved` buffer is passed. x, weights and routing are the forward's.
void backward(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
              const RoutingTriples* routing, const BackwardInputs& inputs, const BackwardOutputs& outputs,
              const BackwardBuffers& buffers, void* stream = nullptr);

/// The rest of a backward() run with outputs.w1_grads_later: grad w1 (and b1) from the dH that backward left in the
/// consumed `saved` buffer, and x. outputs.grad_weights.accumulate applies as in backward(); every other output must
/// be empty. Needs no workspace. Call it once, after that backward and before `saved` is used for anything else.
void finish_backward_w1(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                        const RoutingTriples* routing, const BackwardOutputs& outputs, const void* saved,
                        std::size_t saved_bytes, void* stream = nullptr);

// ---- split backward (zero-bubble and deferred weight-gradient schedules) ----------------------------------------

/// Caller memory of the split backward: `deferred` holds deferred_layout(...).total_bytes and stays untouched by the
/// caller between backward_input() and backward_weight().
struct DeferredBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// The input-gradient half of backward(): grad_x, the router weight's gradient and (caller-supplied routing) the
/// score gradients; outputs.grad_weights.{w1, b1, w2, b2} must be empty. Leaves dH and A' in `deferred`.
/// buffers.workspace holds backward_input_workspace_bytes(...).
void backward_input(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                    const RoutingTriples* routing, const BackwardInputs& inputs, const BackwardOutputs& outputs,
                    const BackwardBuffers& buffers, const DeferredBuffer& deferred, void* stream = nullptr);

/// The weight-gradient half: grad w1, b1, w2, b2 from `deferred`, the forward's `saved` buffer, x and grad_out
/// (which the caller keeps until then). backward_input() then backward_weight() give bitwise the results of
/// backward(). outputs.grad_x, grad_scores and grad_weights.router_weight must be empty.
void backward_weight(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                     const RoutingTriples* routing, const TensorView& grad_out, const BackwardOutputs& outputs,
                     const void* saved, std::size_t saved_bytes, const DeferredBuffer& deferred,
                     void* stream = nullptr);

}  // namespace machmoe
