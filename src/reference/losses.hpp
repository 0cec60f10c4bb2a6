// Router losses of the CPU reference: Switch load-balancing loss and router z-loss, with exact gradients.
#pragma once

#include <cstdint>
#include <vector>

namespace machmoe::ref {

template <class R>
struct LossAndGrad {
  R loss = 0;
  std::vector<R> grad_logits;  // (T, E): d loss / d logits
};

/// aux = E * sum_e (P_e / sum P) (f_e / sum f), P_e = sum_t softmax(z_t)_e; f = per-expert counts (constants).
/// With no routed pairs (sum f = 0) the loss is 0.
template <class R>
LossAndGrad<R> load_balancing_loss(const R* logits, const std::int64_t* counts, std::int64_t T, std::int64_t E);

/// z = (1/T) sum_t logsumexp(z_t)^2.
template <class R>
LossAndGrad<R> router_z_loss(const R* logits, std::int64_t T, std::int64_t E);

}  // namespace machmoe::ref
