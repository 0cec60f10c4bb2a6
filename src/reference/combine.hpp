// The combine step's CPU reference (include/machmoe/combine.hpp): sums and dot products in fp64, rounded once.
#pragma once

#include <cstdint>

namespace machmoe::ref {

/// Contiguous host arrays; token_offsets null: top_k pairs per token; scores null: every score 1. R is float or
/// double.
template <class R>
void combine_rows(const R* rows, std::int64_t d, const R* scores, const std::int32_t* row_of_pair,
                  const std::int32_t* token_offsets, std::int64_t top_k, std::int64_t T, R* out);

/// grad_rows / grad_scores may be null (not wanted). Pairs at and after the last token's end get grad_scores 0.
template <class R>
void combine_rows_backward(const R* grad_out, const R* rows, std::int64_t d, const R* scores,
                           const std::int32_t* row_of_pair, const std::int32_t* token_offsets, std::int64_t top_k,
                           std::int64_t T, std::int64_t P, R* grad_rows, R* grad_scores);

}  // namespace machmoe::ref
