// The combine step of an expert-parallel layer: the experts' output rows (in whatever order they came back from
// the exchange) summed per token with the routing scores, and its backward. The single-GPU layer does the same sum
// inside forward(); this is that sum on its own, for rows the caller moved (machmoe.parallel's combine runs on it).
//
// Pairs: token t owns pairs [t * top_k, (t + 1) * top_k) (token_offsets empty, top_k >= 1), or
// [token_offsets[t], token_offsets[t + 1]) (a variable number per token, as token rounding gives; pairs at and after
// token_offsets[T] are padding and are ignored). With token_offsets, top_k must be 0: the offsets alone say how many
// pairs each token has, and any other value is refused (it would be a second count, possibly a contradicting one).
// Pair p reads row row_of_pair[p] of `rows`, or nothing when row_of_pair[p] = -1 (a pair that was not sent). Sums
// run in pair order with no atomics, in fp32 on cuda and in fp64 on the cpu (the reference), rounded once: the
// results are bitwise reproducible.
//
// Dtypes: rows, out, grad_out and grad_rows share one dtype: bf16, fp16 or fp32 on cuda, fp32 or fp64 on cpu. scores
// and grad_scores are fp32 (fp64 with fp64 rows). row_of_pair and token_offsets are int32. Every tensor is on one
// device and contiguous, except that a view with no elements may have any pointer and strides (autograd's (0, d)
// views come with strides (0, 0)); stream is the CUDA stream (nullptr: the default stream; must be nullptr on cpu).
// Neither call allocates or synchronises with the host.
//
// Index values: the cpu checks them (offsets from 0, non-decreasing, at most P; rows in [-1, R); in the backward no
// row read by two pairs) and raises before writing anything. On cuda they stay on the device and are not checked:
// a row outside [-1, R) reads and writes nothing and offsets are clamped to [0, P], so no index leaves the buffers,
// but a row read by two pairs makes the backward's write to that row's gradient a race.
#pragma once

#include <cstdint>

#include "machmoe/tensor.hpp"

namespace machmoe {

/// out[t] = sum over the pairs p of token t of scores[p] * rows[row_of_pair[p]], rounded once to the rows' dtype.
/// rows (R, d), scores (P,) or empty (every score 1: a plain sum, e.g. the gradient of a dispatch that sent a token's
/// row to its pairs), row_of_pair (P,), token_offsets (T + 1,) with top_k = 0, or empty with top_k >= 1 (then
/// P = T * top_k), out (T, d).
void combine_rows(const TensorView& rows, const TensorView& scores, const TensorView& row_of_pair,
                  const TensorView& token_offsets, std::int64_t top_k, const TensorView& out, void* stream = nullptr);

/// The gradients of combine_rows, in one pass over the pairs:
///   grad_rows[row_of_pair[p]] = scores[p] * grad_out[t]   (rounded once to the rows' dtype)
///   grad_scores[p] = <grad_out[t], rows[row_of_pair[p]]>   (0 for pairs that read no row, and for padding pairs)
/// scores is required here. Either output may be an empty view (not wanted). The rows that no pair reads are left as they are (zero the
/// buffer first where there are such rows, e.g. the empty slots of a fixed-capacity exchange), and each row may be
/// read by at most one pair (the row's gradient is written, not summed).
void combine_rows_backward(const TensorView& grad_out, const TensorView& rows, const TensorView& scores,
                           const TensorView& row_of_pair, const TensorView& token_offsets, std::int64_t top_k,
                           const TensorView& grad_rows, const TensorView& grad_scores, void* stream = nullptr);

}  // namespace machmoe
