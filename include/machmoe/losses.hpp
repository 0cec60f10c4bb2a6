// Router losses, computed from the logits and the device-side per-expert counts the forward returns (no host
// round trip needed on the GPU). Their gradients w.r.t. the logits are handed back to backward() through
// BackwardInputs::grad_router_logits.
#pragma once

#include "machmoe/tensor.hpp"

namespace machmoe {

/// Switch-style load-balancing loss: aux = E * sum_e (P_e / sum P) * (f_e / sum f) with P_e = sum_t softmax(z_t)_e
/// over all E experts and f_e = expert_counts[e] (int32, not differentiated).
/// loss: (1) of the logits' float dtype (fp32 for bf16/fp16 logits). grad_logits: (T, E) of that dtype or empty;
/// receives grad_scale * d aux / d z, added to its contents when accumulate is true, else overwritten.
void load_balancing_loss(const TensorView& router_logits, const TensorView& expert_counts, const TensorView& loss,
                         const TensorView& grad_logits, double grad_scale = 1.0, bool accumulate = false,
                         void* stream = nullptr);

/// Router z-loss: z = (1/T) sum_t logsumexp(z_t)^2 (ST-MoE). Same conventions as load_balancing_loss.
void router_z_loss(const TensorView& router_logits, const TensorView& loss, const TensorView& grad_logits,
                   double grad_scale = 1.0, bool accumulate = false, void* stream = nullptr);

}  // namespace machmoe
