#include "reference/router.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "reference/parallel.hpp"

namespace machmoe::ref {

template <class R>
std::vector<R> router_logits(const R* x, const R* router_weight, std::int64_t T, std::int64_t d, std::int64_t E) {
  std::vector<R> z(static_cast<std::size_t>(T * E));
  parallel_for(T, E * d, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t)
      for (std::int64_t e = 0; e < E; ++e) {
        R acc = 0;
        for (std::int64_t k = 0; k < d; ++k) acc += x[t * d + k] * router_weight[e * d + k];
        z[t * E + e] = acc;
      }
  });
  return z;
}

template <class R>
std::vector<R> softmax_rows(const R* logits, std::int64_t T, std::int64_t E) {
  std::vector<R> p(static_cast<std::size_t>(T * E));
  for (std::int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    const R m = *std::max_element(z, z + E);
    R sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += (p[t * E + e] = std::exp(z[e] - m));
    for (std::int64_t e = 0; e < E; ++e) p[t * E + e] /= sum;
  }
  return p;
}

template <class R>
std::vector<std::int64_t> topk_experts(const R* logits, std::int64_t T, std::int64_t E, std::int64_t K) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(T * K));
  std::vector<std::int64_t> order(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    std::iota(order.begin(), order.end(), 0);
    // Stable partial order: larger logit first, lower expert index on ties (NaN ranks last, deterministically).
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [z](std::int64_t a, std::int64_t b) {
      const bool an = std::isnan(z[a]), bn = std::isnan(z[b]);
      if (an != bn) return bn;
      if (!an && z[a] != z[b]) return z[a] > z[b];
      return a < b;
    });
    std::copy(order.begin(), order.begin() + K, idx.begin() + t * K);
  }
  return idx;
}

template <class R>
std::vector<R> topk_scores(ScoreVariant variant, const R* logits, const std::int64_t* topk, std::int64_t T,
                           std::int64_t E, std::int64_t K) {
  std::vector<R> s(static_cast<std::size_t>(T * K));
  for (std::int64_t t = 0; t < T; ++t) {
    const R* z = logits + t * E;
    const std::int64_t* sel = topk + t * K;
    // The renormalised variant is the same function as the softmax over the selected logits (docs/SPEC.md §2.1); it is
    // computed that way because then it depends only on the selected logits: tokens whose selected logits are
    // equal up to a shift get bitwise-equal scores, so token rounding breaks their ties by token index on every
    // backend rather than by rounding noise of a full-row softmax.
    if (variant != ScoreVariant::kTopKOfSoftmax) {
      R m = z[sel[0]];
      for (std::int64_t k = 1; k < K; ++k) m = std::max(m, z[sel[k]]);
      R sum = 0;
      for (std::int64_t k = 0; k < K; ++k) sum += (s[t * K + k] = std::exp(z[sel[k]] - m));
      for (std::int64_t k = 0; k < K; ++k) s[t * K + k] /= sum;
    } else {
      const std::vector<R> p = softmax_rows(z, 1, E);
      for (std::int64_t k = 0; k < K; ++k) s[t * K + k] = p[sel[k]];
    }
  }
  return s;
}

template <class R>
void softmax_backward_accumulate(const R* probs, const R* grad_p, std::int64_t T, std::int64_t E, R* grad_logits) {
  for (std::int64_t t = 0; t < T; ++t) {
    R dot = 0;
    for (std::int64_t e = 0; e < E; ++e) dot += grad_p[t * E + e] * probs[t * E + e];
    for (std::int64_t e = 0; e < E; ++e) grad_logits[t * E + e] += probs[t * E + e] * (grad_p[t * E + e] - dot);
  }
}

template <class R>
std::vector<R> topk_scores_backward(ScoreVariant variant, const R* logits, const std::int64_t* topk,
                                    const R* scores, const R* grad_scores, std::int64_t T, std::int64_t E,
                                    std::int64_t K) {
  std::vector<R> dz(static_cast<std::size_t>(T * E), R(0));
  if (variant != ScoreVariant::kTopKOfSoftmax) {
    for (std::int64_t t = 0; t < T; ++t) {
      const R* s = scores + t * K;
      const R* g = grad_scores + t * K;
      R gs = 0;
      for (std::int64_t k = 0; k < K; ++k) gs += g[k] * s[k];
      for (std::int64_t k = 0; k < K; ++k) dz[t * E + topk[t * K + k]] += s[k] * (g[k] - gs);
    }
    return dz;
  }
  // s_k = p_{i_k} with p the softmax over all E: dL/dp is g at the selected experts; the softmax backward then
  // spreads it over every expert (dense gradient).
  const std::vector<R> p = softmax_rows(logits, T, E);
  std::vector<R> dp(static_cast<std::size_t>(T * E), R(0));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) dp[t * E + topk[t * K + k]] += grad_scores[t * K + k];
  softmax_backward_accumulate(p.data(), dp.data(), T, E, dz.data());
  return dz;
}

template <class R>
void router_gemm_backward(const R* x, const R* router_weight, const R* grad_logits, std::int64_t T, std::int64_t d,
                          std::int64_t E, R* grad_x_accumulate, R* grad_router_weight) {
  parallel_for(T, d * E, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t)
      for (std::int64_t k = 0; k < d; ++k) {
        R acc = 0;
        for (std::int64_t e = 0; e < E; ++e) acc += grad_logits[t * E + e] * router_weight[e * d + k];
        grad_x_accumulate[t * d + k] += acc;
      }
  });
  parallel_for(E, d * T, [&](std::int64_t e0, std::int64_t e1) {
    for (std::int64_t e = e0; e < e1; ++e)
      for (std::int64_t k = 0; k < d; ++k) {
        R acc = 0;
        for (std::int64_t t = 0; t < T; ++t) acc += grad_logits[t * E + e] * x[t * d + k];
        grad_router_weight[e * d + k] = acc;
      }
  });
}

#define MACHMOE_INSTANTIATE(R)                                                                                    \
  template std::vector<R> router_logits<R>(const R*, const R*, std::int64_t, std::int64_t, std::int64_t);          \
  template std::vector<R> softmax_rows<R>(const R*, std::int64_t, std::int64_t);                                   \
  template std::vector<std::int64_t> topk_experts<R>(const R*, std::int64_t, std::int64_t, std::int64_t);          \
  template std::vector<R> topk_scores<R>(ScoreVariant, const R*, const std::int64_t*, std::int64_t, std::int64_t,  \
                                         std::int64_t);                                                            \
  template std::vector<R> topk_scores_backward<R>(ScoreVariant, const R*, const std::int64_t*, const R*, const R*, \
                                                  std::int64_t, std::int64_t, std::int64_t);                       \
  template void softmax_backward_accumulate<R>(const R*, const R*, std::int64_t, std::int64_t, R*);                \
  template void router_gemm_backward<R>(const R*, const R*, const R*, std::int64_t, std::int64_t, std::int64_t,    \
                                        R*, R*);
MACHMOE_INSTANTIATE(float)
MACHMOE_INSTANTIATE(double)
#undef MACHMOE_INSTANTIATE

}  // namespace machmoe::ref
