#include "reference/combine.hpp"

#include <vector>

#include "reference/parallel.hpp"

namespace machmoe::ref {

namespace {
inline std::int64_t pair_begin(const std::int32_t* offsets, std::int64_t top_k, std::int64_t t) {
  return offsets ? offsets[t] : t * top_k;
}
}  // namespace

template <class R>
void combine_rows(const R* rows, std::int64_t d, const R* scores, const std::int32_t* row_of_pair,
                  const std::int32_t* token_offsets, std::int64_t top_k, std::int64_t T, R* out) {
  parallel_for(T, (token_offsets ? 1 : top_k) * d, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<double> acc(static_cast<std::size_t>(d));
    for (std::int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t p = pair_begin(token_offsets, top_k, t); p < pair_begin(token_offsets, top_k, t + 1); ++p) {
        if (row_of_pair[p] < 0) continue;
        const R* row = rows + static_cast<std::int64_t>(row_of_pair[p]) * d;
        const double s = scores ? static_cast<double>(scores[p]) : 1.0;
        for (std::int64_t c = 0; c < d; ++c) acc[c] += s * static_cast<double>(row[c]);
      }
      for (std::int64_t c = 0; c < d; ++c) out[t * d + c] = static_cast<R>(acc[c]);
    }
  });
}

template <class R>
void combine_rows_backward(const R* grad_out, const R* rows, std::int64_t d, const R* scores,
                           const std::int32_t* row_of_pair, const std::int32_t* token_offsets, std::int64_t top_k,
                           std::int64_t T, std::int64_t P, R* grad_rows, R* grad_scores) {
  const std::int64_t routed_end = pair_begin(token_offsets, top_k, T);
  if (grad_scores)
    for (std::int64_t p = routed_end; p < P; ++p) grad_scores[p] = R(0);
  parallel_for(T, (token_offsets ? 1 : top_k) * d, [&](std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      const R* g = grad_out + t * d;
      for (std::int64_t p = pair_begin(token_offsets, top_k, t); p < pair_begin(token_offsets, top_k, t + 1); ++p) {
        const std::int32_t r = row_of_pair[p];
        if (r < 0) {
          if (grad_scores) grad_scores[p] = R(0);
          continue;
        }
        const R* row = rows + static_cast<std::int64_t>(r) * d;
        if (grad_scores) {
          double dot = 0;
          for (std::int64_t c = 0; c < d; ++c) dot += static_cast<double>(g[c]) * static_cast<double>(row[c]);
          grad_scores[p] = static_cast<R>(dot);
        }
        if (grad_rows) {
          const double s = static_cast<double>(scores[p]);
          R* dst = grad_rows + static_cast<std::int64_t>(r) * d;
          for (std::int64_t c = 0; c < d; ++c) dst[c] = static_cast<R>(s * static_cast<double>(g[c]));
        }
      }
    }
  });
}

#define MACHMOE_INSTANTIATE_COMBINE(R)                                                                              \
  template void combine_rows<R>(const R*, std::int64_t, const R*, const std::int32_t*, const std::int32_t*,       \
                                std::int64_t, std::int64_t, R*);                                                  \
  template void combine_rows_backward<R>(const R*, const R*, std::int64_t, const R*, const std::int32_t*,         \
                                         const std::int32_t*, std::int64_t, std::int64_t, std::int64_t, R*, R*);
MACHMOE_INSTANTIATE_COMBINE(float)
MACHMOE_INSTANTIATE_COMBINE(double)
#undef MACHMOE_INSTANTIATE_COMBINE

}  // namespace machmoe::ref
