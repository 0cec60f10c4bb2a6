// Expert computation of the CPU reference: the up-projection with activation, the down-projection, the
// per-token weighted aggregation (docs/SPEC.md §2.3-§2.5) and their backward (docs/SPEC.md §3). Grouped-order tensors are
// (P, ·) row-major; pair-order vectors are (P).
//
// H is always stored with gate/up *interleaved* columns (H[:, 2j] = gate_j, H[:, 2j+1] = up_j), whatever the
// weight layout: the layout only says which W1 row feeds each H column. So both layouts give bitwise-identical
// results, as the GPU kernels must.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/routing_metadata.hpp"
#include "machmoe/problem.hpp"

namespace machmoe::ref {

struct ExpertShape {
  std::int64_t d = 0, n = 0;
  Activation activation = Activation::kSwiGLU;
  WeightLayout layout = WeightLayout::kInterleaved;
  double swiglu_alpha = kGptOssSwiGLUAlpha, swiglu_limit = kGptOssSwiGLULimit;  // gptoss_swiglu's parameters
  std::int64_t w1_rows() const { return is_glu(activation) ? 2 * n : n; }
};

/// Contiguous expert parameters: w1 (E, w1_rows, d), b1 (E, w1_rows) or null, w2 (E, d, n), b2 (E, d) or null.
template <class R>
struct ExpertParams {
  const R* w1 = nullptr;
  const R* b1 = nullptr;
  const R* w2 = nullptr;
  const R* b2 = nullptr;
};

/// The W1 row (within an expert) that produces interleaved H column c.
std::int64_t w1_row_of_column(const ExpertShape& shape, std::int64_t c);

/// H = gather(X) W1_e^T + b1_e, grouped order (P, w1_rows).
template <class R>
std::vector<R> up_projection(const ExpertShape& shape, const R* x, const ExpertParams<R>& params,
                             const RoutingMetadata& meta);

/// A = act(H): (P, n).
template <class R>
std::vector<R> activation_forward(const ExpertShape& shape, const R* h, std::int64_t num_rows);

/// Y = A W2_e^T + b2_e, grouped order (P, d).
template <class R>
std::vector<R> down_projection(const ExpertShape& shape, const R* a, const ExpertParams<R>& params,
                               const RoutingMetadata& meta);

/// O_t = sum over the pairs p of token t (in pair order) of weight_p * rows[inverse[p]]; weight == nullptr means
/// an unweighted sum (the dX gather-sum). Tokens with no pairs get zeros. (T, width).
template <class R>
std::vector<R> gather_sum(const R* rows, std::int64_t width, const R* weight, const RoutingMetadata& meta);

template <class R>
struct ExpertGrads {
  std::vector<R> dx;           // (T, d): gather-sum of dx_expanded
  std::vector<R> dw1, db1;     // like w1, b1 (db1 empty without b1)
  std::vector<R> dw2, db2;     // like w2, b2 (db2 empty without b2)
  std::vector<R> ds;           // (P) pair order: <dA', A> (+ <dO_t, b2_e> with b2)
  // Transients the GPU backward also produces, kept for tests.
  std::vector<R> da_prime;     // (P, n): dO_t W2_e
  std::vector<R> dh;           // (P, w1_rows)
  std::vector<R> a_prime;      // (P, n): s * A
  std::vector<R> dx_expanded;  // (P, d): dH W1_e
};

/// Expert weight gradients from dH and A' (the deferred half of the backward): dW2_e = sum_g dO_t^T A'_g,
/// db2_e = sum_g s dO_t, dW1_e = sum_g dH_g^T X_t, db1_e = sum_g dH_g; sums in ascending grouped order.
/// Fills g.dw1, g.db1 (with b1), g.dw2, g.db2 (with b2).
template <class R>
void experts_weight_grads(const ExpertShape& shape, std::int64_t E, const R* x, const RoutingMetadata& meta,
                          const R* scores, const R* dh, const R* a_prime, const R* grad_out, bool has_b1, bool has_b2,
                          ExpertGrads<R>& g);

/// Backward of the experts given the saved H (grouped order), the scores (pair order) and dO (T, d).
/// A is recomputed from H, and dS comes from <dA', A>, never from a cached Y (docs/SPEC.md §3.3).
template <class R>
ExpertGrads<R> experts_backward(const ExpertShape& shape, std::int64_t E, const R* x, const ExpertParams<R>& params,
                                const RoutingMetadata& meta, const R* scores, const R* h, const R* grad_out);

}  // namespace machmoe::ref
