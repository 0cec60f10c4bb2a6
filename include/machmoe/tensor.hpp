// Non-owning tensor views: pointer, shape, strides (in elements), dtype and device. The library never owns or
// allocates caller memory; these views describe it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace machmoe {

enum class DType : int { kBF16, kFP16, kFP32, kFP64, kInt32, kInt64 };

/// Size of one element in bytes.
std::size_t dtype_size(DType dtype);
/// "bf16", "fp16", "fp32", "fp64", "int32", "int64".
const char* dtype_name(DType dtype);
bool is_floating(DType dtype);

enum class DeviceType : int { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int ordinal = 0) { return {DeviceType::kCUDA, ordinal}; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_name(const Device& device);  // "cpu", "cuda:0"

inline constexpr int kMaxRank = 4;

/// A view of caller memory. An empty view (data == nullptr and rank == 0) means "absent" for optional
/// arguments (biases, optional outputs).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  Device device{};
  int rank = 0;
  std::int64_t shape[kMaxRank] = {0, 0, 0, 0};
  std::int64_t stride[kMaxRank] = {0, 0, 0, 0};  // in elements, not bytes

  /// Row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu());
  /// View with explicit strides (elements).
  static TensorView strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> stride, Device device = Device::cpu());

  bool empty() const { return data == nullptr && rank == 0; }
  /// These read the first `rank` extents, with rank clamped to [0, kMaxRank] (never past the arrays); the entry
  /// points reject a view whose rank is outside that range, or with a negative extent, before using it.
  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;   // "(4, 8, 16)"
  std::string stride_string() const;  // "(128, 16, 1)"
};

}  // namespace machmoe
