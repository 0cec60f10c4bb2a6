// Router of the CPU reference (docs/SPEC.md §2.1): logits, top-K with ties to the lower expert index, the three score
// variants and their exact backward. Row-major contiguous arrays; logits are (T, E), selections (T, K).
#pragma once

#include <cstdint>
#include <vector>

#include "machmoe/problem.hpp"

namespace machmoe::ref {

/// z = x * Wr^T: x (T, d), router_weight (E, d) -> (T, E).
template <class R>
std::vector<R> router_logits(const R* x, const R* router_weight, std::int64_t T, std::int64_t d, std::int64_t E);

/// Row-wise softmax over all E columns (max-subtracted).
template <class R>
std::vector<R> softmax_rows(const R* logits, std::int64_t T, std::int64_t E);

/// Top-K expert indices per token, in descending logit order; equal logits rank the lower expert index first.
template <class R>
std::vector<std::int64_t> topk_experts(const R* logits, std::int64_t T, std::int64_t E, std::int64_t K);

/// Scores (T, K) of the selected experts for a score variant.
template <class R>
std::vector<R> topk_scores(ScoreVariant variant, const R* logits, const std::int64_t* topk, std::int64_t T,
                           std::int64_t E, std::int64_t K);

/// Exact gradient w.r.t. the logits (T, E) of the scores, given the forward's scores and dL/dscores (T, K).
/// kSoftmaxOverTopK: dz_{i_k} = s_k (g_k - sum_j g_j s_j), zero elsewhere; needs only the scores.
/// kTopKOfSoftmax: dz = softmax backward of dp (dp_{i_k} = g_k): dense over all E; needs the logits.
/// kTopKOfSoftmaxRenorm: its dense formula dz_i = p_i (dp_i - sum_k dp_k p_{i_k}), dp_{i_k} = (g_k - sum_j g_j s_j)/S,
/// equals the kSoftmaxOverTopK formula exactly (the dense part vanishes, docs/SPEC.md §2.1), so it is computed from the
/// scores alone and the logits need not be kept; tests check the identity against the dense formula.
/// `logits` may be nullptr unless variant == kTopKOfSoftmax.
template <class R>
std::vector<R> topk_scores_backward(ScoreVariant variant, const R* logits, const std::int64_t* topk,
                                    const R* scores, const R* grad_scores, std::int64_t T, std::int64_t E,
                                    std::int64_t K);

/// Gradient of scores defined as raw softmax probabilities p_t[e] of chosen (token, expert) entries: adds
/// d/dz of sum_i grad_p[i] * p[i] over full rows to grad_logits. grad_p is (T, E), zero where unused.
template <class R>
void softmax_backward_accumulate(const R* probs, const R* grad_p, std::int64_t T, std::int64_t E, R* grad_logits);

/// dx += dlogits * Wr and dWr = dlogits^T * x (the router GEMM's backward).
template <class R>
void router_gemm_backward(const R* x, const R* router_weight, const R* grad_logits, std::int64_t T, std::int64_t d,
                          std::int64_t E, R* grad_x_accumulate, R* grad_router_weight);

}  // namespace machmoe::ref
