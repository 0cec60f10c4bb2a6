#include "machmoe/losses.hpp"

#include "core/checks.hpp"
#include "core/host_io.hpp"
#include "reference/losses.hpp"

namespace machmoe {

namespace {

using detail::ArgChecker;

DType validate_logits(const ArgChecker& c, const TensorView& logits, const TensorView& loss,
                      const TensorView& grad, void* stream) {
  c.ranked(logits, "router_logits", 2, "a (T, E) tensor");
  // E = 0 has no softmax to take (and no logsumexp): the losses are undefined, not 0. T = 0 is an empty batch.
  if (logits.shape[1] < 1)
    c.fail("router_logits", "a (T, E) tensor with E >= 1 experts", "shape " + logits.shape_string());
  const DType dt = logits.dtype;
  c.tensor(logits, "router_logits", {logits.shape[0], logits.shape[1]}, dt, logits.device);
  if (logits.device.type != DeviceType::kCPU)
    c.fail("router_logits", "a tensor on cpu (the C++ losses run on the CPU; on a GPU, machmoe.load_balancing_loss and "
                            "router_z_loss compute them with torch ops)", device_name(logits.device));
  c.device(logits.device, "router_logits");
  if (dt != DType::kFP32 && dt != DType::kFP64) c.fail("router_logits", "dtype fp32 or fp64 on cpu", dtype_name(dt));
  c.tensor(loss, "loss", {1}, dt, logits.device);
  if (!grad.empty()) c.tensor(grad, "grad_logits", {logits.shape[0], logits.shape[1]}, dt, logits.device);
  if (stream != nullptr) c.fail("stream", "nullptr for cpu tensors", "a non-null stream");
  return dt;
}

template <class R>
void emit(const ref::LossAndGrad<R>& r, const TensorView& loss, const TensorView& grad, double scale, bool accumulate) {
  detail::write_real(loss, &r.loss);
  if (grad.empty()) return;
  std::vector<R> g = accumulate ? detail::read_real<R>(grad) : std::vector<R>(r.grad_logits.size(), R(0));
  for (std::size_t i = 0; i < g.size(); ++i) g[i] += static_cast<R>(scale) * r.grad_logits[i];
  detail::write_real(grad, g.data());
}

}  // namespace

void load_balancing_loss(const TensorView& logits, const TensorView& counts, const TensorView& loss,
                         const TensorView& grad, double grad_scale, bool accumulate, void* stream) {
  const ArgChecker c("load_balancing_loss", "router_logits");
  const DType dt = validate_logits(c, logits, loss, grad, stream);
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  c.tensor(counts, "expert_counts", {E}, DType::kInt32, logits.device);
  const std::vector<std::int64_t> f = detail::read_index(counts);
  for (std::int64_t e = 0; e < E; ++e)
    if (f[e] < 0) c.fail("expert_counts[" + std::to_string(e) + "]", "a count >= 0", std::to_string(f[e]));
  if (dt == DType::kFP64)
    emit(ref::load_balancing_loss(detail::read_real<double>(logits).data(), f.data(), T, E), loss, grad, grad_scale,
         accumulate);
  else
    emit(ref::load_balancing_loss(detail::read_real<float>(logits).data(), f.data(), T, E), loss, grad, grad_scale,
         accumulate);
}

void router_z_loss(const TensorView& logits, const TensorView& loss, const TensorView& grad, double grad_scale,
                   bool accumulate, void* stream) {
  const ArgChecker c("router_z_loss", "router_logits");
  const DType dt = validate_logits(c, logits, loss, grad, stream);
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  if (dt == DType::kFP64)
    emit(ref::router_z_loss(detail::read_real<double>(logits).data(), T, E), loss, grad, grad_scale, accumulate);
  else
    emit(ref::router_z_loss(detail::read_real<float>(logits).data(), T, E), loss, grad, grad_scale, accumulate);
}

}  // namespace machmoe
