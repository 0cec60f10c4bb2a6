#include "reference/layer.hpp"

#include <utility>

#include "reference/router.hpp"
#include "reference/token_rounding.hpp"

namespace machmoe::ref {

ExpertShape expert_shape(const MoEProblem& problem) {
  ExpertShape s;
  s.d = problem.d;
  s.n = problem.n;
  s.activation = problem.activation;
  s.layout = problem.weight_layout;
  s.swiglu_alpha = problem.swiglu_alpha, s.swiglu_limit = problem.swiglu_limit;
  return s;
}

template <class R>
ForwardResult<R> layer_forward(const MoEProblem& pb, const LayerInputs<R>& in) {
  const std::int64_t T = pb.T, d = pb.d, E = pb.E, K = pb.K;
  ForwardResult<R> res;
  ForwardSaved<R>& saved = res.saved;

  // Router and routing.
  auto logits = [&] {
    return in.router_logits ? std::vector<R>(in.router_logits, in.router_logits + T * E)
                            : router_logits(in.x, in.router_weight, T, d, E);
  };
  switch (pb.routing) {
    case RoutingMode::kTopK: {
      res.router_logits = logits();
      const std::vector<std::int64_t> topk = topk_experts(res.router_logits.data(), T, E, K);
      saved.scores = topk_scores(pb.score, res.router_logits.data(), topk.data(), T, E, K);
      saved.meta = topk_routing_metadata(topk.data(), T, E, K);
      break;
    }
    case RoutingMode::kTokenRounding: {
      res.router_logits = logits();
      TokenRoundingResult<R> tr =
          token_rounding(pb.score, pb.rounding, pb.tile_m, res.router_logits.data(), T, E, K);
      saved.scores = std::move(tr.score);
      saved.meta = build_routing_metadata(T, E, std::move(tr.token), std::move(tr.expert));
      break;
    }
    case RoutingMode::kCallerSupplied: {
      const std::int64_t P = pb.num_pairs;
      saved.scores.assign(in.pair_score, in.pair_score + P);
      saved.meta = build_routing_metadata(T, E, std::vector<std::int64_t>(in.pair_token, in.pair_token + P),
                                          std::vector<std::int64_t>(in.pair_expert, in.pair_expert + P));
      break;
    }
  }
  if (pb.keeps_router_logits()) saved.router_logits = res.router_logits;
  res.expert_counts = saved.meta.expert_counts;

  // Experts.
  const ExpertShape shape = expert_shape(pb);
  std::vector<R> h = up_projection(shape, in.x, in.experts, saved.meta);
  res.a = activation_forward(shape, h.data(), saved.meta.num_pairs());
  res.y = down_projection(shape, res.a.data(), in.experts, saved.meta);
  res.out = gather_sum(res.y.data(), d, saved.scores.data(), saved.meta);
  if (pb.cache == CacheMode::kPreActivation) saved.h = std::move(h);
  return res;
}

template <class R>
BackwardResult<R> layer_backward(const MoEProblem& pb, const LayerInputs<R>& in, const ForwardSaved<R>& saved,
                                 const R* grad_out, const typename ForwardSaved<R>::value_type* grad_logits) {
  const std::int64_t T = pb.T, d = pb.d, E = pb.E, K = pb.K;
  const ExpertShape shape = expert_shape(pb);
  const RoutingMetadata& meta = saved.meta;

  // Input-only mode recomputes H, with the same arithmetic as the forward (so results are identical).
  std::vector<R> h_recomputed;
  const R* h = saved.h.data();
  if (pb.cache == CacheMode::kInputOnly) {
    h_recomputed = up_projection(shape, in.x, in.experts, meta);
    h = h_recomputed.data();
  }
  ExpertGrads<R> eg = experts_backward(shape, E, in.x, in.experts, meta, saved.scores.data(), h, grad_out);

  BackwardResult<R> res;
  res.dx = std::move(eg.dx);
  res.dw1 = std::move(eg.dw1);
  res.db1 = std::move(eg.db1);
  res.dw2 = std::move(eg.dw2);
  res.db2 = std::move(eg.db2);
  res.ds = std::move(eg.ds);
  res.dh = std::move(eg.dh);
  res.a_prime = std::move(eg.a_prime);

  if (pb.routing == RoutingMode::kCallerSupplied) {
    res.dscores = res.ds;
    return res;
  }
  if (pb.routing == RoutingMode::kTopK) {
    // Pair p = t*K + k: its expert is the top-K index.
    const std::vector<std::int64_t>& topk = meta.pair_expert;
    res.dlogits = topk_scores_backward(pb.score, saved.router_logits.empty() ? nullptr : saved.router_logits.data(),
                                       topk.data(), saved.scores.data(), res.ds.data(), T, E, K);
  } else {
    res.dlogits = token_rounding_backward(pb.score, saved.router_logits.data(), T, E, K, meta.pair_token.data(),
                                          meta.pair_expert.data(), meta.num_pairs(), res.ds.data());
  }
  if (grad_logits)
    for (std::int64_t i = 0; i < T * E; ++i) res.dlogits[i] += grad_logits[i];
  res.drouter_weight.assign(static_cast<std::size_t>(E * d), R(0));
  router_gemm_backward(in.x, in.router_weight, res.dlogits.data(), T, d, E, res.dx.data(),
                       res.drouter_weight.data());
  return res;
}

template ForwardResult<float> layer_forward<float>(const MoEProblem&, const LayerInputs<float>&);
template ForwardResult<double> layer_forward<double>(const MoEProblem&, const LayerInputs<double>&);
template BackwardResult<float> layer_backward<float>(const MoEProblem&, const LayerInputs<float>&,
                                                     const ForwardSaved<float>&, const float*, const float*);
template BackwardResult<double> layer_backward<double>(const MoEProblem&, const LayerInputs<double>&,
                                                       const ForwardSaved<double>&, const double*, const double*);

}  // namespace machmoe::ref
