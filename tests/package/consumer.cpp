// Runs one tiny MoE layer forward on the CPU through the installed package and checks that the output is finite
// and that every routed pair is counted.
#include <machmoe/machmoe.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using namespace machmoe;
  MoEProblem p;
  p.T = 6; p.d = 8; p.n = 4; p.E = 4; p.K = 2;
  const auto count = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  std::vector<float> x(count(p.T * p.d)), wr(count(p.E * p.d)), w1(count(p.E * p.w1_rows() * p.d)),
      w2(count(p.E * p.d * p.n)), out(count(p.T * p.d)), logits(count(p.T * p.E));
  std::vector<std::int32_t> counts(count(p.E));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * float(i));
  for (std::size_t i = 0; i < wr.size(); ++i) wr[i] = 0.3f * std::cos(1.3f * float(i));
  for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.3f * std::sin(0.9f * float(i) + 1.f);
  for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = 0.3f * std::cos(0.5f * float(i) + 2.f);
  LayerWeights w;
  w.router_weight = TensorView::contiguous(wr.data(), DType::kFP32, {p.E, p.d});
  w.w1 = TensorView::contiguous(w1.data(), DType::kFP32, {p.E, p.w1_rows(), p.d});
  w.w2 = TensorView::contiguous(w2.data(), DType::kFP32, {p.E, p.d, p.n});
  std::vector<unsigned char> saved(saved_layout(p, DType::kFP32).total_bytes);
  ForwardOutputs o{TensorView::contiguous(out.data(), DType::kFP32, {p.T, p.d}),
                   TensorView::contiguous(logits.data(), DType::kFP32, {p.T, p.E}),
                   TensorView::contiguous(counts.data(), DType::kInt32, {p.E})};
  forward(p, TensorView::contiguous(x.data(), DType::kFP32, {p.T, p.d}), w, nullptr, o,
          ForwardBuffers{saved.data(), saved.size(), nullptr, 0});
  std::int64_t pairs = 0;
  for (std::int32_t c : counts) pairs += c;
  double sum = 0;
  for (float v : out) sum += std::fabs(v);
  if (pairs != p.T * p.K || !std::isfinite(sum) || sum == 0) {
    std::printf("consumer: wrong result (pairs %lld, |out| %g)\n", static_cast<long long>(pairs), sum);
    return 1;
  }
  std::printf("consumer: machmoe %s forward ok (pairs %lld, |out| %.6f)\n", kVersion,
              static_cast<long long>(pairs), sum);
  return 0;
}
