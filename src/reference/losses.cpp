#include "reference/losses.hpp"

#include <algorithm>
#include <cmath>

#include "reference/router.hpp"

namespace machmoe::ref {

template <class R>
LossAndGrad<R> load_balancing_loss(const R* logits, const std::int64_t* counts, std::int64_t T, std::int64_t E) {
  LossAndGrad<R> out;
  out.grad_logits.assign(static_cast<std::size_t>(T * E), R(0));
  R f_sum = 0;
  for (std::int64_t e = 0; e < E; ++e) f_sum += static_cast<R>(counts[e]);
  if (f_sum == R(0) || T == 0 || E == 0) return out;
  const std::vector<R> p = softmax_rows(logits, T, E);
  std::vector<R> P(static_cast<std::size_t>(E), R(0));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) P[e] += p[t * E + e];
  R P_sum = 0, Pf = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    P_sum += P[e];
    Pf += P[e] * static_cast<R>(counts[e]);
  }
  const R scale = static_cast<R>(E) / f_sum;
  out.loss = scale * Pf / P_sum;
  // d aux / d P_e = scale (f_e / sum P - Pf / (sum P)^2); every P_e depends on softmax(z_t)_e of each token.
  std::vector<R> dP(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) dP[e] = scale * (static_cast<R>(counts[e]) / P_sum - Pf / (P_sum * P_sum));
  std::vector<R> dp(static_cast<std::size_t>(T * E));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) dp[t * E + e] = dP[e];
  softmax_backward_accumulate(p.data(), dp.data(), T, E, out.grad_logits.data());
  return out;
}

template <class R>
LossAndGrad<R> router_z_loss(const R* logits, std::int64_t T, std::int64_t E) {
  LossAndGrad<R> out;
  out.grad_logits.assign(static_cast<std::size_t>(T * E), R(0));
  // No experts: no logsumexp to take (the public entry rejects E = 0; this keeps max_element off an empty row).
  if (T == 0 || E == 0) return out;
  const std::vector<R> p = softmax_rows(logits, T, E);
  for (std::int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    const R m = *std::max_element(z, z + E);
    R sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(z[e] - m);
    const R lse = m + std::log(sum);
    out.loss += lse * lse;
    for (std::int64_t e = 0; e < E; ++e) out.grad_logits[t * E + e] = R(2) * lse * p[t * E + e] / static_cast<R>(T);
  }
  out.loss /= static_cast<R>(T);
  return out;
}

template LossAndGrad<float> load_balancing_loss<float>(const float*, const std::int64_t*, std::int64_t,
                                                       std::int64_t);
template LossAndGrad<double> load_balancing_loss<double>(const double*, const std::int64_t*, std::int64_t,
                                                         std::int64_t);
template LossAndGrad<float> router_z_loss<float>(const float*, std::int64_t, std::int64_t);
template LossAndGrad<double> router_z_loss<double>(const double*, std::int64_t, std::int64_t);

}  // namespace machmoe::ref
