// Argument checks shared by the public entry points. Each failure throws machmoe::Error naming the function, the
// argument, what was expected and what was given.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "machmoe/tensor.hpp"

namespace machmoe::detail {

std::string shape_string(std::initializer_list<std::int64_t> shape);

class ArgChecker {
 public:
  explicit ArgChecker(std::string where) : where_(std::move(where)) {}

  /// A present tensor of exactly this shape and dtype, on `device`, row-major with unit inner stride (outer
  /// strides may pad rows), and a non-null pointer; a tensor with no elements may have any pointer and strides.
  void tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape, DType dtype,
              const Device& device) const;
  /// A gradient of a weight: as tensor(), but its dtype may be the layer's data dtype `data_dtype` or fp32.
  void grad_tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                   DType data_dtype, const Device& device) const;
  /// Same, but the dtype may be int32 or int64.
  void index_tensor(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
                    const Device& device) const;
  /// The tensor must be absent (an empty view) because the problem does not use it.
  void absent(const TensorView& t, const std::string& name, const std::string& why) const;
  [[noreturn]] void fail(const std::string& name, const std::string& expected, const std::string& got) const;
  const std::string& where() const { return where_; }

 private:
  void layout(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
              const Device& device) const;
  std::string where_;
};

}  // namespace machmoe::detail
