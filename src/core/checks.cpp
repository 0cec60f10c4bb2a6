#include "core/checks.hpp"

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

void ArgChecker::layout(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                        const Device& device) const {
  if (t.empty()) fail(name, "a tensor of shape " + shape_string(shape), "an empty view (absent)");
  bool same = t.rank == static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) same = same && t.shape[i++] == s;
  if (!same) fail(name, "shape " + shape_string(shape), t.shape_string());
  if (t.device != device)
    fail(name, "a tensor on " + device_name(device) + " (the device of x)", "a tensor on " + device_name(t.device));
  if (t.numel() == 0) return;  // addresses nothing: any pointer and strides (autograd's (0, 0) expands) will do
  if (t.data == nullptr) fail(name, "a non-null data pointer", "nullptr");
  // Row-major, unit inner stride, rows may be padded but never overlap.
  for (int d = t.rank - 1; d >= 0; --d) {
    const std::int64_t need = d == t.rank - 1 ? 1 : t.stride[d + 1] * t.shape[d + 1];
    const bool ok = t.shape[d] <= 1 || (d == t.rank - 1 ? t.stride[d] == 1 : t.stride[d] >= need);
    if (!ok)
      fail(name + ".stride",
           "row-major strides with unit inner stride, non-overlapping rows (dimension " + std::to_string(d) +
               " needs stride " + (d == t.rank - 1 ? std::string("1") : ">= " + std::to_string(need)) + ")",
           t.stride_string());
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
  std::string expected = std::string("dtype ") + dtype_name(data_dtype) + " (the data dtype of x)";
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
