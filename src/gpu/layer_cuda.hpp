// The layer on a CUDA stream: forward and backward orchestration of the GPU runtime's kernels. Called by the
// public API after it has validated every argument; allocates nothing and never synchronises with the host.
#pragma once

#include "machmoe/layer.hpp"

namespace machmoe::gpu {

void forward_cuda(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                  const RoutingTriples* routing, const ForwardOutputs& outputs, const ForwardBuffers& buffers,
                  void* stream);

void backward_cuda(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                   const RoutingTriples* routing, const BackwardInputs& inputs, const BackwardOutputs& outputs,
                   const BackwardBuffers& buffers, void* stream);

void backward_input_cuda(const MoEProblem& problem, const TensorView& x, const LayerWeights& weights,
                         const BackwardInputs& inputs, const BackwardOutputs& outputs, const BackwardBuffers& buffers,
                         const DeferredBuffer& deferred, void* stream);

void backward_weight_cuda(const MoEProblem& problem, const TensorView& x, const TensorView& grad_out,
                          const BackwardOutputs& outputs, const void* saved, const DeferredBuffer& deferred,
                          void* stream);

/// finish_backward_w1(): dW1 and db1 from the dH a consuming backward left over the saved H.
void finish_backward_w1_cuda(const MoEProblem& problem, const TensorView& x, const BackwardOutputs& outputs,
                             const void* saved, void* stream);

// ---- index checking (include/machmoe/index_checking.hpp) ---------------------------------------------------------

/// At the entry of a public call on `ordinal`: throws machmoe::Error (from `where`) for a violation that an earlier,
/// already completed checked launch recorded, and clears it. Reads pinned host memory only: never waits.
void raise_recorded_index_violation(int ordinal, const char* where, void* stream);

/// check_device_errors() on a CUDA device: synchronises the stream, then raise_recorded_index_violation.
void check_device_errors_cuda(int ordinal, void* stream);

/// grouped_expert_index() on CUDA views (validated by the caller).
void grouped_expert_index_cuda(const TensorView& counts, const TensorView& expert_index, void* stream);

/// combine_rows() / combine_rows_backward() (include/machmoe/combine.hpp) on CUDA views validated by the caller.
void combine_rows_cuda(const TensorView& rows, const TensorView& scores, const TensorView& row_of_pair,
                       const TensorView& token_offsets, std::int64_t top_k, const TensorView& out, void* stream);
void combine_rows_backward_cuda(const TensorView& grad_out, const TensorView& rows, const TensorView& scores,
                                const TensorView& row_of_pair, const TensorView& token_offsets, std::int64_t top_k,
                                const TensorView& grad_rows, const TensorView& grad_scores, void* stream);

}  // namespace machmoe::gpu
