// Copies between (possibly row-padded) host tensor views and contiguous std::vectors, for the CPU backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "machmoe/tensor.hpp"

namespace machmoe::detail {

/// Calls f(element_offset, linear_index) for every element of a row-major view of rank <= 4.
template <class F>
void for_each_element(const TensorView& t, F&& f) {
  std::int64_t shape[kMaxRank] = {1, 1, 1, 1}, stride[kMaxRank] = {0, 0, 0, 0};
  const int pad = kMaxRank - t.rank;
  for (int i = 0; i < t.rank; ++i) {
    shape[pad + i] = t.shape[i];
    stride[pad + i] = t.stride[i];
  }
  std::int64_t linear = 0;
  for (std::int64_t a = 0; a < shape[0]; ++a)
    for (std::int64_t b = 0; b < shape[1]; ++b)
      for (std::int64_t c = 0; c < shape[2]; ++c)
        for (std::int64_t d = 0; d < shape[3]; ++d)
          f(a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3], linear++);
}

template <class R>
std::vector<R> read_real(const TensorView& t) {
  std::vector<R> out(static_cast<std::size_t>(t.numel()));
  const R* src = static_cast<const R*>(t.data);
  for_each_element(t, [&](std::int64_t off, std::int64_t i) { out[i] = src[off]; });
  return out;
}

template <class R>
void write_real(const TensorView& t, const R* values) {
  R* dst = static_cast<R*>(t.data);
  for_each_element(t, [&](std::int64_t off, std::int64_t i) { dst[off] = values[i]; });
}

/// A weight gradient into a view of dtype fp32 or fp64 (the data dtype, or fp32 gradients of fp64 data):
/// dst = values, or with `accumulate` dst = dst + values, the sum in the wider of the two types, rounded once to the
/// view's dtype.
///
/// Accumulating leaves the slices along the first dimension (one expert's gradient) whose `slice_pairs` entry is 0
/// as they are, bit for bit: layer.hpp (LayerWeightGrads) promises that the buffers of experts that receive no pair
/// stay unchanged, as on the GPU (which writes nothing there), and adding their zeros would turn -0.0 into +0.0.
/// Every other slice is added into, a zero gradient included, as the GPU does. With `slice_pairs` null every slice
/// is added into (the router's gradient, which every token reaches; a call with no pairs does not write it at all).
template <class R>
void write_grad(const TensorView& t, const R* values, bool accumulate, const std::int64_t* slice_pairs = nullptr) {
  const std::int64_t n = t.numel(), slices = t.rank > 0 ? t.shape[0] : 1;
  const std::int64_t per_slice = slices > 0 ? n / slices : 0;
  auto put = [&](auto* dst) {
    using O = std::remove_pointer_t<decltype(dst)>;
    using S = decltype(R{} + O{});
    for_each_element(t, [&](std::int64_t off, std::int64_t i) {  // per_slice > 0: the view has elements
      if (!accumulate) {
        dst[off] = static_cast<O>(static_cast<S>(values[i]));
      } else if (slice_pairs == nullptr || slice_pairs[i / per_slice] != 0) {
        dst[off] = static_cast<O>(static_cast<S>(dst[off]) + static_cast<S>(values[i]));
      }
    });
  };
  if (t.dtype == DType::kFP64) put(static_cast<double*>(t.data));
  else put(static_cast<float*>(t.data));
}

inline std::vector<std::int64_t> read_index(const TensorView& t) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(t.numel()));
  for_each_element(t, [&](std::int64_t off, std::int64_t i) {
    out[i] = t.dtype == DType::kInt32 ? static_cast<const std::int32_t*>(t.data)[off]
                                      : static_cast<const std::int64_t*>(t.data)[off];
  });
  return out;
}

inline void write_int32(const TensorView& t, const std::int64_t* values) {
  std::int32_t* dst = static_cast<std::int32_t*>(t.data);
  for_each_element(t, [&](std::int64_t off, std::int64_t i) { dst[off] = static_cast<std::int32_t>(values[i]); });
}

}  // namespace machmoe::detail
