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

}  // namespace machmoe::gpu
