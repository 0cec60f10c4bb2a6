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
  /// `where`: the public function. `reference`: the argument the others take their device (and the layer its data
  /// dtype) from, named in those messages ("x" for the layer, "rows" for combine_rows, ...).
  ArgChecker(std::string where, std::string reference) : where_(std::move(where)), reference_(std::move(reference)) {}

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
  /// A view whose shape can be read: rank in [0, kMaxRank], no negative extent, and an element count that fits in
  /// 64 bits. Every check above starts with it; call it first where an entry point reads a caller's shape itself.
  void well_formed(const TensorView& t, const std::string& name) const;
  /// A present, well-formed view of rank `rank`, before an entry point takes its extents as the sizes of the
  /// problem; `expected` describes it ("an (R, d) tensor").
  void ranked(const TensorView& t, const std::string& name, int rank, const std::string& expected) const;
  /// The device of the reference argument, where it enters: a known type, index 0 for the cpu, and for CUDA an
  /// ordinal in [0, cuda_device_count()) (which does not synchronise). An entry point that cannot run on CUDA in
  /// this build says so first; this is the check after it.
  void device(const Device& device, const std::string& name) const;
  /// A view whose row stride (stride[rank - 2]) the GPU path hands to cuBLAS as a leading dimension, an int: at most
  /// 2^31 - 1 elements, and at least the row's length even for a single row (`why` names the GEMM). Views with no
  /// elements pass.
  void int32_row_stride(const TensorView& t, const std::string& name, const std::string& why) const;
  [[noreturn]] void fail(const std::string& name, const std::string& expected, const std::string& got) const;
  const std::string& where() const { return where_; }

 private:
  void layout(const TensorView& t, const std::string& name, std::initializer_list<std::int64_t> shape,
              const Device& device) const;
  std::string where_;
  std::string reference_;
};

}  // namespace machmoe::detail
