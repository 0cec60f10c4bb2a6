// Router losses, computed from the logits and the per-expert counts the forward returns. These C++ functions run on
// the CPU only (fp32 or fp64 logits); on a GPU, Python's machmoe.load_balancing_loss and machmoe.router_z_loss compute
// the same losses with torch ops, with no host round trip. Their gradients w.r.t. the logits are handed back to
// backward() through BackwardInputs::grad_router_logits.
#pragma once

#include "machmoe/tensor.hpp"

namespace machmoe {

/// Switch-style load-balancing loss: aux = E * sum_e (P_e / sum P) * (f_e / sum f) with P_e = sum_t softmax(z_t)_e
/// over all E experts and f_e = expert_counts[e] (int32, not differentiated).
/// router_logits: (T, E), E >= 1, fp32 or fp64 on the CPU; stream: nullptr. loss: (1) of the logits' dtype.
/// grad_logits: (T, E) of that dtype or empty;
/// receives grad_scale * d aux / d z, added to its contents when accumulate is true, else overwritten.
void load_balancing_loss(const TensorView& router_logits, const TensorView& expert_counts, const TensorView& loss,
                         const TensorView& grad_logits, double grad_scale = 1.0, bool accumulate = false,
                         void* stream = nullptr);

/// Router z-loss: z = (1/T) sum_t logsumexp(z_t)^2 (ST-MoE). Same conventions as load_balancing_loss.
void router_z_loss(const TensorView& router_logits, const TensorView& loss, const TensorView& grad_logits,
                   double grad_scale = 1.0, bool accumulate = false, void* stream = nullptr);

}  // namespace machmoe
