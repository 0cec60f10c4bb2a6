#include "machmoe/tensor.hpp"

#include <cstdint>
#include <limits>

#include "machmoe/error.hpp"

namespace machmoe {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32:
    case DType::kInt32: return 4;
    case DType::kFP64:
    case DType::kInt64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kFP64: return "fp64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

bool is_floating(DType dtype) { return dtype != DType::kInt32 && dtype != DType::kInt64; }

std::string device_name(const Device& device) {
  if (device.type == DeviceType::kCPU) return "cpu";
  if (device.type == DeviceType::kCUDA) return "cuda:" + std::to_string(device.index);
  // A Device filled from an unchecked integer: say what it holds rather than call it cuda.
  return "device of type code " + std::to_string(static_cast<int>(device.type)) + ":" + std::to_string(device.index);
}

static TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device) {
  if (shape.size() > static_cast<std::size_t>(kMaxRank))
    throw_argument_error("TensorView", "shape", "rank <= " + std::to_string(kMaxRank),
                         "rank " + std::to_string(shape.size()));
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) v.shape[i++] = s;
  return v;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  TensorView v = make_view(data, dtype, shape, device);
  std::int64_t s = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    v.stride[i] = s;
    // A shape whose element count does not fit in 64 bits saturates its strides instead of overflowing (undefined
    // behaviour); the entry points reject such a view by its element count.
    if (__builtin_mul_overflow(s, v.shape[i], &s)) s = std::numeric_limits<std::int64_t>::max();
  }
  return v;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> stride, Device device) {
  TensorView v = make_view(data, dtype, shape, device);
  if (stride.size() != shape.size())
    throw_argument_error("TensorView::strided", "stride", std::to_string(shape.size()) + " strides",
                         std::to_string(stride.size()));
  int i = 0;
  for (std::int64_t s : stride) v.stride[i++] = s;
  return v;
}

/// The dimensions a view's loops may visit: its rank clamped to [0, kMaxRank], so that a malformed rank (a view
/// filled by hand or by a binding) never reads past shape[] and stride[]. The public checks reject such a view.
static int dims(int rank) { return rank < 0 ? 0 : rank > kMaxRank ? kMaxRank : rank; }

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < dims(rank); ++i)  // saturated, not overflowed, for a shape the entry points reject
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::numeric_limits<std::int64_t>::max();
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t s = 1;
  for (int i = dims(rank) - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

static std::string join(const std::int64_t* v, int n) {
  std::string s = "(";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (n == 1 ? ",)" : ")");
}

std::string TensorView::shape_string() const { return join(shape, dims(rank)); }
std::string TensorView::stride_string() const { return join(stride, dims(rank)); }

}  // namespace machmoe
