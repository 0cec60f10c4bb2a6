#include "core/checks.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "machmoe/device.hpp"
#include "machmoe/error.hpp"

namespace machmoe::detail {

std::string shape_string(std::initializer_list<std::int64_t> shape) {
  std::string s = "(";
  int i = 0;
  for (std::int64_t v : shape) s += (i++ ? ", " : "") + std::to_string(v);
  return s + (shape.size() == 1 ? ",)" : ")");
}

void ArgChecker::fail(const std::string& name, const std::string& expected, const std::string& got) const {
  throw_argument_error(where_, name, expected, got);
}

void ArgChecker::well_formed(const TensorView& t, const std::string& name) const {
  // The rank first: shape_string() and numel() read rank entries of fixed arrays of kMaxRank.
  if (t.rank < 0 || t.rank > kMaxRank)
    fail(name, "a view of rank 0 to " + std::to_string(kMaxRank) + " (TensorView::rank)",
         "rank " + std::to_string(t.rank));
  bool any_zero = false;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0)
      fail(name, "a shape of non-negative extents", "shape " + t.shape_string() + " (dimension " +
                                                        std::to_string(i) + " is " + std::to_string(t.shape[i]) + ")");
    any_zero = any_zero || t.shape[i] == 0;
  }
  // numel() must not wrap (to 0, say, which would pass a null pointer as "addresses nothing").
  if (any_zero) return;
  std::int64_t n = 1;
  for (int i = 0; i < t.rank; ++i) {
    if (n > std::numeric_limits<std::int64_t>::max() / t.shape[i])
      fail(name, "a shape whose element count fits in 64 bits", "shape " + t.shape_string());
    n *= t.shape[i];
  }
}

void ArgChecker::ranked(const TensorView& t, const std::string& name, int rank, const std::string& expected) const {
  if (t.empty()) fail(name, expected, "an empty view");
  well_formed(t, name);
  if (t.rank != rank) fail(name, expected, t.shape_string());
}

void ArgChecker::device(const Device& d, const std::string& name) const {
  if (d.type == DeviceType::kCPU) {
    if (d.index != 0) fail(name, "index 0 on the cpu (Device::cpu())", "cpu device index " + std::to_string(d.index));
    return;
  }
  if (d.type != DeviceType::kCUDA)
    fail(name, "a device of type cpu or cuda", "device type code " + std::to_string(static_cast<int>(d.type)));
  const int count = cuda_device_count();
  if (d.index < 0 || d.index >= count)
    fail(name,
         count == 0 ? std::string("a usable CUDA device (this process sees none: cuda_device_count() = 0)")
                    : "a CUDA device ordinal in [0, " + std::to_string(count) + ") (cuda_device_count() = " +
                          std::to_string(count) + ")",
         device_name(d));
  // The CUDA build's kernels are sm_90a only (CMakeLists.txt): on another GPU the first launch would fail with
  // CUDA's "no kernel image" deep inside the layer. Said here, at the argument, instead.
  const int cc = cuda_compute_capability(d.index);
  if (cc != kCudaComputeCapability)
    fail(name,
         "a Hopper GPU (compute capability 9.0: H100, H200; the CUDA build has kernels for sm_90a only; CPU tensors "
         "run the reference)",
         device_name(d) + ", " + cuda_device_description(d.index) + ", compute capability " + std::to_string(cc / 10) +
             "." + std::to_string(cc % 10));
}

void ArgChecker::int32_row_stride(const TensorView& t, const std::string& name, const std::string& why) const {
  if (t.empty() || t.rank < 2 || t.numel() == 0) return;
  // The layout checks bound the row stride below by the row's length only where there are two rows or more; cuBLAS
  // wants that bound (ld >= max(1, rows of the column-major operand)) for a single row too.
  const std::int64_t ld = t.stride[t.rank - 2], lo = std::max<std::int64_t>(1, t.shape[t.rank - 1]);
  const std::int64_t hi = std::numeric_limits<std::int32_t>::max();
  if (ld < lo || ld > hi)
    fail(name + ".stride",
         "a row stride in [" + std::to_string(lo) + ", 2^31 - 1] elements on cuda (" + why +
             ": cuBLAS takes it as an int leading dimension)",
         t.stride_string());
}

void ArgChecker::layout(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                        const Device& device) const {
  if (t.empty()) fail(name, "a tensor of shape " + shape_string(shape), "an empty view (absent)");
  well_formed(t, name);
  bool same = t.rank == static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) same = same && t.shape[i++] == s;
  if (!same) fail(name, "shape " + shape_string(shape), t.shape_string());
  if (t.device != device)
    fail(name, "a tensor on " + device_name(device) + " (the device of " + reference_ + ")",
         "a tensor on " + device_name(t.device));
  if (t.numel() == 0) return;  // addresses nothing: any pointer and strides (autograd's (0, 0) expands) will do
  if (t.data == nullptr) fail(name, "a non-null data pointer", "nullptr");
  // Row-major, unit inner stride, rows may be padded but never overlap: each dimension's stride must step past the
  // whole block of the dimensions inside it, whose span is 1 + the sum of (shape - 1) * stride over them. The next
  // dimension's stride * shape is not that span where that dimension has size 1 (its stride can be anything: (T, 1)
  // with strides (0, 0) would pass). A size-1 dimension never moves, so its stride is free (torch leaves it
  // arbitrary) and adds nothing to the span.
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  std::int64_t span = 1;  // of the dimensions after d: elements from the block's first to its last, inclusive
  for (int d = t.rank - 1; d >= 0; --d) {
    if (t.shape[d] <= 1) continue;
    const bool inner = d == t.rank - 1;
    if (inner ? t.stride[d] != 1 : t.stride[d] < span)
      fail(name + ".stride",
           "row-major strides with unit inner stride, non-overlapping rows (dimension " + std::to_string(d) +
               " needs stride " + (inner ? std::string("1") : ">= " + std::to_string(span)) + ")",
           t.stride_string());
    // stride >= span >= 1 here; a stride this large addresses more than 2^63 elements (and would wrap the span).
    if (t.stride[d] > (max - span) / (t.shape[d] - 1))
      fail(name + ".stride", "strides that address fewer than 2^63 elements (dimension " + std::to_string(d) + ")",
           t.stride_string() + " for shape " + t.shape_string());
    span += (t.shape[d] - 1) * t.stride[d];
  }
}

void ArgChecker::tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                        DType dtype, const Device& device) const {
  layout(t, name, shape, device);
  if (t.dtype != dtype) fail(name, std::string("dtype ") + dtype_name(dtype), dtype_name(t.dtype));
}

void ArgChecker::grad_tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                             DType data_dtype, const Device& device) const {
  layout(t, name, shape, device);
  if (t.dtype == data_dtype || t.dtype == DType::kFP32) return;
  std::string expected = std::string("dtype ") + dtype_name(data_dtype) + " (the data dtype of " + reference_ + ")";
  if (data_dtype != DType::kFP32) expected += " or fp32 (fp32 gradients, e.g. an fp32 main_grad to accumulate into)";
  fail(name, expected, dtype_name(t.dtype));
}

void ArgChecker::index_tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                              const Device& device) const {
  layout(t, name, shape, device);
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64)
    fail(name, "dtype int32 or int64", dtype_name(t.dtype));
}

void ArgChecker::absent(const TensorView& t, const std::string& name, const std::string& why) const {
  if (!t.empty()) fail(name, "an empty view (" + why + ")", "a tensor of shape " + t.shape_string());
}

}  // namespace machmoe::detail
