#include "reference/experts.hpp"

#include "math/activation.hpp"
#include "reference/parallel.hpp"

namespace machmoe::ref {
namespace {
template <class R>
math::ActParams<R> act_params(const ExpertShape& shape) {
  return {static_cast<R>(shape.swiglu_alpha), static_cast<R>(shape.swiglu_limit)};
}
}  // namespace

std::int64_t w1_row_of_column(const ExpertShape& shape, std::int64_t c) {
  if (!is_glu(shape.activation) || shape.layout == WeightLayout::kInterleaved) return c;
  return (c % 2) * shape.n + c / 2;  // concatenated: gate_j at row j, up_j at row n + j
}

template <class R>
std::vector<R> up_projection(const ExpertShape& shape, const R* x, const ExpertParams<R>& params,
                             const RoutingMetadata& meta) {
  const std::int64_t d = shape.d, rows = shape.w1_rows(), P = meta.num_pairs();
  std::vector<R> h(static_cast<std::size_t>(P * rows));
  parallel_for(P, rows * d, [&](std::int64_t g0, std::int64_t g1) {
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t e = meta.expert_of_row(g);
      const R* xt = x + meta.gather[g] * d;
      for (std::int64_t c = 0; c < rows; ++c) {
        const std::int64_t r = w1_row_of_column(shape, c);
        const R* w = params.w1 + (e * rows + r) * d;
        R acc = 0;
        for (std::int64_t k = 0; k < d; ++k) acc += xt[k] * w[k];
        if (params.b1) acc += params.b1[e * rows + r];
        h[g * rows + c] = acc;
      }
    }
  });
  return h;
}

template <class R>
std::vector<R> activation_forward(const ExpertShape& shape, const R* h, std::int64_t num_rows) {
  const std::int64_t n = shape.n, rows = shape.w1_rows();
  const bool glu = is_glu(shape.activation);
  const math::ActParams<R> ap = act_params<R>(shape);
  std::vector<R> a(static_cast<std::size_t>(num_rows * n));
  for (std::int64_t g = 0; g < num_rows; ++g)
    for (std::int64_t j = 0; j < n; ++j)
      a[g * n + j] = glu ? math::glu_forward(shape.activation, h[g * rows + 2 * j], h[g * rows + 2 * j + 1], ap)
                         : math::act_value_and_derivative(shape.activation, h[g * rows + j]).value;
  return a;
}

template <class R>
std::vector<R> down_projection(const ExpertShape& shape, const R* a, const ExpertParams<R>& params,
                               const RoutingMetadata& meta) {
  const std::int64_t d = shape.d, n = shape.n, P = meta.num_pairs();
  std::vector<R> y(static_cast<std::size_t>(P * d));
  parallel_for(P, d * n, [&](std::int64_t g0, std::int64_t g1) {
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t e = meta.expert_of_row(g);
      for (std::int64_t k = 0; k < d; ++k) {
        const R* w = params.w2 + (e * d + k) * n;
        R acc = 0;
        for (std::int64_t j = 0; j < n; ++j) acc += a[g * n + j] * w[j];
        if (params.b2) acc += params.b2[e * d + k];
        y[g * d + k] = acc;
      }
    }
  });
  return y;
}

template <class R>
std::vector<R> gather_sum(const R* rows, std::int64_t width, const R* weight, const RoutingMetadata& meta) {
  std::vector<R> out(static_cast<std::size_t>(meta.T * width), R(0));
  const std::int64_t pairs_per_token = meta.T > 0 ? meta.num_pairs() / meta.T + 1 : 1;
  parallel_for(meta.T, pairs_per_token * width, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      R* o = out.data() + t * width;
      for (std::int64_t p = meta.token_offsets[t]; p < meta.token_offsets[t + 1]; ++p) {
        const R w = weight ? weight[p] : R(1);
        const R* src = rows + meta.inverse[p] * width;
        for (std::int64_t k = 0; k < width; ++k) o[k] += w * src[k];
      }
    }
  });
  return out;
}

template <class R>
ExpertGrads<R> experts_backward(const ExpertShape& shape, std::int64_t E, const R* x, const ExpertParams<R>& params,
                                const RoutingMetadata& meta, const R* scores, const R* h, const R* grad_out) {
  const std::int64_t d = shape.d, n = shape.n, rows = shape.w1_rows(), P = meta.num_pairs();
  const bool glu = is_glu(shape.activation);
  const math::ActParams<R> ap = act_params<R>(shape);
  ExpertGrads<R> gr;
  gr.ds.assign(static_cast<std::size_t>(P), R(0));
  gr.da_prime.assign(static_cast<std::size_t>(P * n), R(0));
  gr.dh.assign(static_cast<std::size_t>(P * rows), R(0));
  gr.a_prime.assign(static_cast<std::size_t>(P * n), R(0));
  gr.dx_expanded.assign(static_cast<std::size_t>(P * d), R(0));

  // Each grouped row g writes only its own rows of dA', dH, A', dX~ and its pair's dS.
  parallel_for(P, n * d + rows * d, [&](std::int64_t g0, std::int64_t g1) {
    std::vector<R> a(static_cast<std::size_t>(n));
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t e = meta.expert_of_row(g), t = meta.gather[g], p = meta.scatter[g];
      const R s = scores[p];
      const R* dout = grad_out + t * d;
      const R* hg = h + g * rows;
      R* da_prime = gr.da_prime.data() + g * n;
      R* dh = gr.dh.data() + g * rows;
      R* a_prime = gr.a_prime.data() + g * n;

      // dA' = dO_t W2_e (the dH kernel's mainloop).
      for (std::int64_t j = 0; j < n; ++j) {
        R acc = 0;
        for (std::int64_t k = 0; k < d; ++k) acc += dout[k] * params.w2[(e * d + k) * n + j];
        da_prime[j] = acc;
      }
      // Epilogue: recompute A from H, dS = <dA', A> (+ <dO_t, b2_e>), A' = s A, dH = act'(H) (s dA').
      R ds = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        const R da = s * da_prime[j];
        if (glu) {
          const math::GluGrad<R> f = math::glu_backward(shape.activation, hg[2 * j], hg[2 * j + 1], da, ap);
          a[j] = f.value;
          dh[2 * j] = f.d_gate;
          dh[2 * j + 1] = f.d_up;
        } else {
          const math::ActValue<R> f = math::act_value_and_derivative(shape.activation, hg[j]);
          a[j] = f.value;
          dh[j] = da * f.derivative;
        }
        ds += da_prime[j] * a[j];
        a_prime[j] = s * a[j];
      }
      if (params.b2) {
        R bias_term = 0;
        for (std::int64_t k = 0; k < d; ++k) bias_term += dout[k] * params.b2[e * d + k];
        ds += bias_term;
      }
      gr.ds[p] = ds;
      // dX~_g = dH_g W1_e.
      R* dxe = gr.dx_expanded.data() + g * d;
      for (std::int64_t c = 0; c < rows; ++c) {
        const R* w = params.w1 + (e * rows + w1_row_of_column(shape, c)) * d;
        for (std::int64_t k = 0; k < d; ++k) dxe[k] += dh[c] * w[k];
      }
    }
  });

  gr.dx = gather_sum<R>(gr.dx_expanded.data(), d, nullptr, meta);
  experts_weight_grads(shape, E, x, meta, scores, gr.dh.data(), gr.a_prime.data(), grad_out, params.b1 != nullptr,
                       params.b2 != nullptr, gr);
  return gr;
}

template <class R>
void experts_weight_grads(const ExpertShape& shape, std::int64_t E, const R* x, const RoutingMetadata& meta,
                          const R* scores, const R* dh_all, const R* a_prime_all, const R* grad_out, bool has_b1,
                          bool has_b2, ExpertGrads<R>& gr) {
  const std::int64_t d = shape.d, n = shape.n, rows = shape.w1_rows(), P = meta.num_pairs();
  gr.dw1.assign(static_cast<std::size_t>(E * rows * d), R(0));
  gr.dw2.assign(static_cast<std::size_t>(E * d * n), R(0));
  gr.db1.assign(has_b1 ? static_cast<std::size_t>(E * rows) : 0, R(0));
  gr.db2.assign(has_b2 ? static_cast<std::size_t>(E * d) : 0, R(0));
  // Each output row (expert e, row k of dW2 / row r of dW1) is one thread's, summed over the expert's grouped rows in
  // ascending order, as the serial loop over all rows sums it.
  const std::int64_t rows_per_expert = E > 0 ? P / E + 1 : 1;
  const std::int64_t* off = meta.expert_offsets.data();
  parallel_for(E * d, rows_per_expert * n, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t e = i / d, k = i % d;
      R* dw = gr.dw2.data() + (e * d + k) * n;
      for (std::int64_t g = off[e]; g < off[e + 1]; ++g) {
        const R dout_k = grad_out[meta.gather[g] * d + k];
        if (has_b2) gr.db2[e * d + k] += scores[meta.scatter[g]] * dout_k;
        const R* a_prime = a_prime_all + g * n;
        for (std::int64_t j = 0; j < n; ++j) dw[j] += dout_k * a_prime[j];
      }
    }
  });
  std::vector<std::int64_t> column_of_row(static_cast<std::size_t>(rows));
  for (std::int64_t c = 0; c < rows; ++c) column_of_row[static_cast<std::size_t>(w1_row_of_column(shape, c))] = c;
  parallel_for(E * rows, rows_per_expert * d, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t e = i / rows, r = i % rows, c = column_of_row[static_cast<std::size_t>(r)];
      R* dw = gr.dw1.data() + (e * rows + r) * d;
      for (std::int64_t g = off[e]; g < off[e + 1]; ++g) {
        const R dh = dh_all[g * rows + c];
        const R* xt = x + meta.gather[g] * d;
        for (std::int64_t k = 0; k < d; ++k) dw[k] += dh * xt[k];
        if (has_b1) gr.db1[e * rows + r] += dh;
      }
    }
  });
}

#define MACHMOE_INSTANTIATE(R)                                                                                   \
  template std::vector<R> up_projection<R>(const ExpertShape&, const R*, const ExpertParams<R>&,                  \
                                           const RoutingMetadata&);                                               \
  template std::vector<R> activation_forward<R>(const ExpertShape&, const R*, std::int64_t);                      \
  template std::vector<R> down_projection<R>(const ExpertShape&, const R*, const ExpertParams<R>&,                \
                                             const RoutingMetadata&);                                             \
  template std::vector<R> gather_sum<R>(const R*, std::int64_t, const R*, const RoutingMetadata&);                \
  template ExpertGrads<R> experts_backward<R>(const ExpertShape&, std::int64_t, const R*, const ExpertParams<R>&, \
                                              const RoutingMetadata&, const R*, const R*, const R*);               \
  template void experts_weight_grads<R>(const ExpertShape&, std::int64_t, const R*, const RoutingMetadata&,       \
                                        const R*, const R*, const R*, const R*, bool, bool, ExpertGrads<R>&);
MACHMOE_INSTANTIATE(float)
MACHMOE_INSTANTIATE(double)
#undef MACHMOE_INSTANTIATE

}  // namespace machmoe::ref
