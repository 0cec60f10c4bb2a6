// The whole MoE layer in the CPU reference: router, routing, experts, aggregation, and the full backward
// including the router's. Contiguous row-major arrays of one real type (float or double).
//
// The forward's result separates what the backward may read (ForwardSaved: exactly the regions of
// machmoe::SavedLayout) from transients (A, Y) that are returned only so tests can look at them; the backward
// takes ForwardSaved alone, so it cannot use a cached Y or A.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/experts.hpp"
#include "reference/routing_metadata.hpp"
#include "machmoe/problem.hpp"

namespace machmoe::ref {

template <class R>
struct LayerInputs {
  const R* x = nullptr;              // (T, d)
  const R* router_weight = nullptr;  // (E, d); unused for caller-supplied routing
  ExpertParams<R> experts;
  // Caller-supplied routing: problem.num_pairs triples, tokens ascending.
  const std::int64_t* pair_token = nullptr;
  const std::int64_t* pair_expert = nullptr;
  const R* pair_score = nullptr;
  // When set, used as the router logits (T, E) instead of x W_r^T. Lets a test pin the routing decisions to the
  // logits a lower-precision backend computed (near-ties may order differently after rounding); the router's
  // backward still goes through x and W_r.
  const R* router_logits = nullptr;
};

template <class R>
struct ForwardSaved {
  using value_type = R;
  RoutingMetadata meta;
  std::vector<R> scores;         // (P) pair order
  std::vector<R> h;              // (P, w1_rows) grouped order; empty in CacheMode::kInputOnly
  std::vector<R> router_logits;  // (T, E) when problem.keeps_router_logits(); else empty
};

template <class R>
struct ForwardResult {
  std::vector<R> out;                        // (T, d)
  std::vector<R> router_logits;              // (T, E); empty for caller-supplied routing
  std::vector<std::int64_t> expert_counts;   // (E)
  ForwardSaved<R> saved;
  std::vector<R> a, y;                       // transients (tests only)
};

template <class R>
struct BackwardResult {
  std::vector<R> dx, drouter_weight, dw1, db1, dw2, db2;
  std::vector<R> dscores;  // (P) caller-supplied routing only, caller's pair order
  std::vector<R> ds;       // (P) pair order, dL/dscore of every routed pair
  std::vector<R> dlogits;  // (T, E) total gradient reaching the logits (empty for caller-supplied routing)
  std::vector<R> dh, a_prime;  // what the split backward defers to its weight half (grouped order)
};

template <class R>
ForwardResult<R> layer_forward(const MoEProblem& problem, const LayerInputs<R>& in);

/// grad_logits (T, E) may be null: the upstream gradient of the returned logits (aux losses).
template <class R>
BackwardResult<R> layer_backward(const MoEProblem& problem, const LayerInputs<R>& in, const ForwardSaved<R>& saved,
                                 const R* grad_out, const typename ForwardSaved<R>::value_type* grad_logits);

ExpertShape expert_shape(const MoEProblem& problem);

}  // namespace machmoe::ref
