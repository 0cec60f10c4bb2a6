// The host side of the combine step (include/machmoe/combine.hpp): argument checks, then the CPU reference or the
// CUDA kernels.
#include "machmoe/combine.hpp"

#include <string>
#include <vector>

#include "core/checks.hpp"
#include "core/host_io.hpp"
#include "machmoe/problem.hpp"
#include "reference/combine.hpp"

#ifdef MACHMOE_WITH_CUDA
#include "gpu/layer_cuda.hpp"
#endif

namespace machmoe {

namespace {

using detail::ArgChecker;

struct CombineShape {
  std::int64_t R = 0, d = 0, P = 0, T = 0;
  DType dt = DType::kFP32, score_dt = DType::kFP32;
  Device device{};
};

/// After ArgChecker::tensor. A view with no elements addresses nothing and may have any strides, as everywhere else
/// (autograd's (0, d) gradients come with strides (0, 0)).
void contiguous(const ArgChecker& c, const TensorView& t, const std::string& name) {
  if (!t.empty() && t.numel() != 0 && !t.is_contiguous())
    c.fail(name, "a contiguous tensor", "strides " + t.stride_string());
}

/// Everything but the index values; T is the rows of `tokens` (out or grad_out). scores_optional: an empty scores
/// view means every score 1 (the forward).
CombineShape check_common(const ArgChecker& c, const TensorView& rows, const TensorView& scores,
                          const TensorView& row_of_pair, const TensorView& token_offsets, std::int64_t top_k,
                          const TensorView& tokens, const char* tokens_name, bool scores_optional, void* stream) {
  CombineShape s;
  c.ranked(rows, "rows", 2, "an (R, d) tensor");
  s.R = rows.shape[0], s.d = rows.shape[1], s.dt = rows.dtype, s.device = rows.device;
  if (s.device.type == DeviceType::kCUDA) {
#ifndef MACHMOE_WITH_CUDA
    c.fail("rows", "a tensor on cpu (this build has no CUDA support: nvcc was not found at configure time)",
           device_name(s.device));
#endif
    if (s.dt != DType::kBF16 && s.dt != DType::kFP16 && s.dt != DType::kFP32)
      c.fail("rows", "dtype bf16, fp16 or fp32 on cuda", dtype_name(s.dt));
    c.device(s.device, "rows");
  } else {
    c.device(s.device, "rows");
    if (s.dt != DType::kFP32 && s.dt != DType::kFP64)
      c.fail("rows", "dtype fp32 or fp64 on cpu (bf16 and fp16 run on cuda)", dtype_name(s.dt));
    if (stream != nullptr) c.fail("stream", "nullptr for cpu tensors", "a non-null stream");
  }
  s.score_dt = s.dt == DType::kFP64 ? DType::kFP64 : DType::kFP32;
  c.tensor(rows, "rows", {s.R, s.d}, s.dt, s.device);
  contiguous(c, rows, "rows");
  if (s.R > Limits::kMaxPairs)
    c.fail("rows", "at most 2^31 - 1 rows (int32 row indices)", std::to_string(s.R) + " rows");
  c.ranked(row_of_pair, "row_of_pair", 1, "a (P,) tensor");
  s.P = row_of_pair.shape[0];
  if (s.P > Limits::kMaxPairs) c.fail("row_of_pair", "at most 2^31 - 1 pairs", std::to_string(s.P) + " pairs");
  c.tensor(row_of_pair, "row_of_pair", {s.P}, DType::kInt32, s.device);
  if (!scores.empty() || !scores_optional) c.tensor(scores, "scores", {s.P}, s.score_dt, s.device);
  c.ranked(tokens, tokens_name, 2, "a (T, d) tensor");
  s.T = tokens.shape[0];
  if (s.T > Limits::kMaxTokens)
    c.fail(tokens_name, "at most 2^31 - 1 tokens", std::to_string(s.T) + " rows");
  c.tensor(tokens, tokens_name, {s.T, s.d}, s.dt, s.device);
  contiguous(c, tokens, tokens_name);
  if (token_offsets.empty()) {
    if (top_k < 1 || top_k > Limits::kMaxPairs)
      c.fail("top_k", "K in [1, 2^31 - 1] pairs per token (token_offsets is empty)", std::to_string(top_k));
    if (s.T * top_k != s.P)  // both below 2^31: no overflow
      c.fail("row_of_pair", "T * top_k = " + std::to_string(s.T) + " * " + std::to_string(top_k) + " pairs",
             std::to_string(s.P) + " pairs");
  } else {
    if (top_k != 0) c.fail("top_k", "0 with token_offsets (the offsets give each token's pairs)", std::to_string(top_k));
    c.tensor(token_offsets, "token_offsets", {s.T + 1}, DType::kInt32, s.device);
  }
  return s;
}

/// The index values, on the cpu: offsets from 0, non-decreasing, at most P; the rows of the routed pairs (before
/// the last token's end: padding pairs are ignored) in [-1, R); with `injective`, no row read by two of them.
void check_cpu_indices(const ArgChecker& c, const CombineShape& s, const TensorView& row_of_pair,
                       const TensorView& token_offsets, bool injective) {
  const auto* rp = static_cast<const std::int32_t*>(row_of_pair.data);
  if (!token_offsets.empty()) {
    const auto* off = static_cast<const std::int32_t*>(token_offsets.data);
    if (off[0] != 0) c.fail("token_offsets[0]", "0", std::to_string(off[0]));
    for (std::int64_t t = 0; t < s.T; ++t)
      if (off[t + 1] < off[t] || off[t + 1] > s.P)
        c.fail("token_offsets[" + std::to_string(t + 1) + "]",
               "an offset in [token_offsets[" + std::to_string(t) + "] = " + std::to_string(off[t]) + ", P = " +
                   std::to_string(s.P) + "]",
               std::to_string(off[t + 1]));
  }
  const std::int64_t routed =
      token_offsets.empty() ? s.P : static_cast<const std::int32_t*>(token_offsets.data)[s.T];
  std::vector<std::int64_t> reader;
  if (injective) reader.assign(static_cast<std::size_t>(s.R), -1);
  for (std::int64_t p = 0; p < routed; ++p) {
    const std::int64_t r = rp[p];
    if (r < -1 || r >= s.R)
      c.fail("row_of_pair[" + std::to_string(p) + "]", "a row in [0, " + std::to_string(s.R) + ") or -1 (no row)",
             std::to_string(r));
    if (!injective || r < 0) continue;
    if (reader[r] >= 0)
      c.fail("row_of_pair[" + std::to_string(p) + "]",
             "a row no other pair reads (the backward writes each row's gradient once)",
             "row " + std::to_string(r) + ", also read by pair " + std::to_string(reader[r]));
    reader[r] = p;
  }
}

}  // namespace

void combine_rows(const TensorView& rows, const TensorView& scores, const TensorView& row_of_pair,
                  const TensorView& token_offsets, std::int64_t top_k, const TensorView& out, void* stream) {
  const ArgChecker c("combine_rows", "rows");
  const CombineShape s = check_common(c, rows, scores, row_of_pair, token_offsets, top_k, out, "out", true, stream);
  if (s.device.type == DeviceType::kCUDA) {
#ifdef MACHMOE_WITH_CUDA
    gpu::combine_rows_cuda(rows, scores, row_of_pair, token_offsets, top_k, out, stream);
#endif
    return;
  }
  check_cpu_indices(c, s, row_of_pair, token_offsets, false);
  const auto* rp = static_cast<const std::int32_t*>(row_of_pair.data);
  const auto* off = static_cast<const std::int32_t*>(token_offsets.data);
  if (s.dt == DType::kFP64)
    ref::combine_rows(static_cast<const double*>(rows.data), s.d, static_cast<const double*>(scores.data), rp, off,
                      top_k, s.T, static_cast<double*>(out.data));
  else
    ref::combine_rows(static_cast<const float*>(rows.data), s.d, static_cast<const float*>(scores.data), rp, off,
                      top_k, s.T, static_cast<float*>(out.data));
}

void combine_rows_backward(const TensorView& grad_out, const TensorView& rows, const TensorView& scores,
                           const TensorView& row_of_pair, const TensorView& token_offsets, std::int64_t top_k,
                           const TensorView& grad_rows, const TensorView& grad_scores, void* stream) {
  const ArgChecker c("combine_rows_backward", "rows");
  const CombineShape s =
      check_common(c, rows, scores, row_of_pair, token_offsets, top_k, grad_out, "grad_out", false, stream);
  if (!grad_rows.empty()) {
    c.tensor(grad_rows, "grad_rows", {s.R, s.d}, s.dt, s.device);
    contiguous(c, grad_rows, "grad_rows");
  }
  if (!grad_scores.empty()) c.tensor(grad_scores, "grad_scores", {s.P}, s.score_dt, s.device);
  if (s.device.type == DeviceType::kCUDA) {
#ifdef MACHMOE_WITH_CUDA
    gpu::combine_rows_backward_cuda(grad_out, rows, scores, row_of_pair, token_offsets, top_k, grad_rows,
                                    grad_scores, stream);
#endif
    return;
  }
  check_cpu_indices(c, s, row_of_pair, token_offsets, !grad_rows.empty());
  const auto* rp = static_cast<const std::int32_t*>(row_of_pair.data);
  const auto* off = static_cast<const std::int32_t*>(token_offsets.data);
  if (s.dt == DType::kFP64)
    ref::combine_rows_backward(static_cast<const double*>(grad_out.data), static_cast<const double*>(rows.data), s.d,
                               static_cast<const double*>(scores.data), rp, off, top_k, s.T, s.P,
                               static_cast<double*>(grad_rows.data), static_cast<double*>(grad_scores.data));
  else
    ref::combine_rows_backward(static_cast<const float*>(grad_out.data), static_cast<const float*>(rows.data), s.d,
                               static_cast<const float*>(scores.data), rp, off, top_k, s.T, s.P,
                               static_cast<float*>(grad_rows.data), static_cast<float*>(grad_scores.data));
}

}  // namespace machmoe
