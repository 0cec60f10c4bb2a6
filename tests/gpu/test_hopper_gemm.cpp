// The Hopper forward kernels (src/gpu/hopper) at the kernel level: the gather-fused up-projection with its
// activation epilogue and the down-projection, against a float64 host computation on the same bf16 inputs and
// against the GPU reference GEMM; every activation, both weight layouts, bias, inference (A only), strided
// weights, edge segments (empty experts, 1-row experts, lengths around the 128-row tile, > 32 experts), rows past
// the routed ones left untouched, determinism; and the dispatcher's fallback reasons.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "gpu/hopper/dispatch.hpp"
#include "gpu/kernels.hpp"
#include "math/activation.hpp"
#include "gpu_support.hpp"

namespace machmoe::test {
namespace {

using gpu::Epilogue;
using gpu::VarlenMArgs;

double act_ref(Activation a, double x) { return math::act_value_and_derivative(a, x).value; }

/// The tile for_each_tile forces now (0: the heuristic's), for the progress notes.
int g_tile_n = 0;

/// Leaves a progress note naming the GEMM about to run (the hang watchdog prints the last one).
void note_launch(const char* what, const VarlenMArgs& a, bool reference) {
  progress(std::string(what) + (reference ? " on the reference GEMM" : " on the Hopper kernel, tile N ") +
           (reference ? std::string() : (g_tile_n > 0 ? std::to_string(g_tile_n) : std::string("(heuristic)"))) +
           ": E " + std::to_string(a.E) + ", N " + std::to_string(a.N) + ", K " + std::to_string(a.K) + ", P_max " +
           std::to_string(a.P_max) + ", " + activation_name(a.activation) + ", B permute " +
           std::to_string(a.b.permute) + (a.bias ? ", bias" : ""));
}

/// Runs the grouped GEMM of `a` on the reference kernel or (asserting that it takes it) on the Hopper kernel, and
/// waits for it.
void launch_grouped(const char* what, const VarlenMArgs& a, bool reference) {
  note_launch(what, a, reference);
  if (reference) {
    gpu::launch_varlen_m_gemm(a, nullptr);
  } else {
    EXPECT_EQ(gpu::hopper_unsupported_reason(a), "") << "the case must take the Hopper kernel";
    gpu::launch_expert_gemm(a, (std::string("test/") + what).c_str(), nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  progress("the launch finished; checking its output on the host");
}

/// A host vector's bytes and 4 more (an empty vector still makes a buffer), for a DeviceBuffer.
template <class V>
std::vector<unsigned char> host_bytes(const std::vector<V>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(V) + 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * sizeof(V));
  return b;
}

/// 100 experts of 0 to 4 rows each: many empty experts and single-row tiles in one launch.
std::vector<int> many_short_segments() {
  std::vector<int> many(100, 0);
  for (std::size_t e = 0; e < many.size(); ++e) many[e] = static_cast<int>((e * 37) % 5);
  return many;
}

/// Grouped rows: segment lengths per expert, a random token per row, X (T x d), and per-expert weights.
struct Segments {
  std::vector<std::int32_t> offsets, tiles64, gather;
  std::int64_t rows() const { return offsets.back(); }
};

Segments make_segments(const std::vector<int>& lengths, std::int64_t T, std::mt19937& rng) {
  Segments s;
  s.offsets.push_back(0);
  s.tiles64.push_back(0);
  for (int f : lengths) {
    s.offsets.push_back(s.offsets.back() + f);
    s.tiles64.push_back(s.tiles64.back() + (f + gpu::kGemmTileM - 1) / gpu::kGemmTileM);
  }
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(T - 1));
  for (std::int32_t g = 0; g < s.offsets.back(); ++g) s.gather.push_back(tok(rng));
  if (T > 1) s.gather.back() = static_cast<std::int32_t>(T - 1);  // the last token row is read
  return s;
}

std::vector<double> normal(std::size_t n, double scale, std::mt19937& rng) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return quantize(v, DType::kBF16);
}

bool all_bytes(const std::vector<unsigned char>& v, std::size_t from, std::size_t to, unsigned char byte) {
  for (std::size_t i = from; i < to; ++i)
    if (v[i] != byte) return false;
  return true;
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// rows x cols values (compact) laid out with row stride ld >= cols; the ld - cols guard columns of every row hold
/// NaN: a kernel that read them (past a row's valid columns) would carry NaN into what it computes.
std::vector<double> with_nan_guard(const std::vector<double>& v, std::int64_t rows, std::int64_t cols,
                                   std::int64_t ld) {
  if (ld == cols) return v;
  std::vector<double> out(static_cast<std::size_t>(rows * ld), kNaN);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[r * ld + c] = v[r * cols + c];
  return out;
}

/// The first `cols` bf16 values of each of `rows` rows of row stride ld, decoded compactly.
std::vector<double> decode_rows(const std::vector<unsigned char>& raw, std::int64_t rows, std::int64_t cols,
                                std::int64_t ld) {
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::vector<double> row = decode(raw.data() + r * ld * 2, static_cast<std::size_t>(cols), DType::kBF16);
    std::copy(row.begin(), row.end(), out.begin() + r * cols);
  }
  return out;
}

/// Columns [cols, ld) of every row of a bf16 buffer still hold the 0xFF fill: nothing was written past the valid
/// columns (an edge tile's padding) on any row, routed or not.
bool guard_untouched(const std::vector<unsigned char>& raw, std::int64_t cols, std::int64_t ld) {
  const std::int64_t rows = static_cast<std::int64_t>(raw.size()) / (ld * 2);
  for (std::int64_t r = 0; r < rows; ++r)
    if (!all_bytes(raw, static_cast<std::size_t>((r * ld + cols) * 2), static_cast<std::size_t>((r + 1) * ld * 2),
                   0xFF))
      return false;
  return true;
}

struct UpCase {
  Activation act;
  WeightLayout layout;
  bool bias;
  bool store_h;
  double swiglu_limit = kGptOssSwiGLULimit;  // gptoss_swiglu only (its alpha: kGptOssTestAlpha)
};

/// gptoss_swiglu in these tests: alpha not gpt-oss's 1.702, so that a kernel ignoring the parameter fails, and a
/// limit of 1.25 on pre-activations of size ~1, so that about a tenth of the gate values and a quarter of the up values
/// are clamped (1.25 is a bf16 value: H given in bf16 also lands exactly on the limit).
constexpr double kGptOssTestAlpha = 1.45, kGptOssTestLimit = 1.25;

/// gpt-oss's A from (gate, up), written as HF does (exp, min/max), independently of activation.hpp.
double gptoss_ref(double gate, double up, double limit) {
  const double g = std::min(gate, limit), u = std::max(-limit, std::min(up, limit));
  return (u + 1.0) * g / (1.0 + std::exp(-kGptOssTestAlpha * g));
}

std::string up_case_name(const testing::TestParamInfo<UpCase>& i) {
  return std::string(activation_name(i.param.act)) +
         (i.param.swiglu_limit != kGptOssSwiGLULimit ? "_clamped" : "") + "_" + weight_layout_name(i.param.layout) +
         (i.param.bias ? "_bias" : "_nobias") + (i.param.store_h ? "_H_and_A" : "_A_only");
}

/// Everything the up-projection produced, plus the float64 expectation.
struct UpResult {
  std::vector<double> h, a, h_ref, a_ref;
  std::vector<unsigned char> raw_h, raw_a;
  bool tails_untouched = true, canaries = true;
};

/// Runs the up-projection over `lengths` on the Hopper kernel (or the reference GEMM when `reference`).
/// w1 is given interleaved; for the concatenated layout it is uploaded permuted (the math is the same).
/// guard > 0: X rows and the H and A rows get `guard` extra columns (NaN in X, checked untouched in H and A).
UpResult run_up(const UpCase& uc, std::int64_t T, std::int64_t d, std::int64_t n, const std::vector<int>& lengths,
                std::uint32_t seed, bool reference = false, std::int64_t pad_rows = 0, std::int64_t pad_k = 0,
                std::int64_t guard = 0) {
  std::mt19937 rng(seed);
  const std::int64_t E = static_cast<std::int64_t>(lengths.size());
  const bool glu = is_glu(uc.act);
  const std::int64_t N = glu ? 2 * n : n, act_cols = n;
  const Segments s = make_segments(lengths, T, rng);
  const std::int64_t P = s.rows(), P_cap = P + 37;  // capacity past the routed rows stays untouched
  const std::vector<double> x = normal(static_cast<std::size_t>(T * d), 1.0, rng);
  const std::vector<double> w = normal(static_cast<std::size_t>(E * N * d), 1.0 / std::sqrt(double(d)), rng);
  const std::vector<double> b = normal(static_cast<std::size_t>(E * N), 0.5, rng);
  // Device weights: (E, rows_per_expert, ld) with optional padding rows/columns (strided views), NaN in the padding:
  // the tensor map's extents are d and N, so TMA never reads it (an edge tile's rows past N arrive as zeros).
  const std::int64_t ldw = d + pad_k, rows_e = N + pad_rows;
  std::vector<double> w_dev(static_cast<std::size_t>(E * rows_e * ldw), kNaN), b_dev(static_cast<std::size_t>(E * N));
  const bool concat = uc.layout == WeightLayout::kConcatenated;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t c = 0; c < N; ++c) {
      const std::int64_t row = concat ? (c % 2) * n + c / 2 : c;
      for (std::int64_t k = 0; k < d; ++k) w_dev[(e * rows_e + row) * ldw + k] = w[(e * N + c) * d + k];
      b_dev[e * N + row] = b[e * N + c];
    }
  const std::int64_t ldx = d + guard, ld_h = N + guard, ld_a = act_cols + guard;
  DeviceBuffer dx(encode(with_nan_guard(x, T, d, ldx), DType::kBF16)), dw(encode(w_dev, DType::kBF16)),
      db(encode(b_dev, DType::kBF16));
  DeviceBuffer doff(host_bytes(s.offsets)), dtil(host_bytes(s.tiles64)), dgat(host_bytes(s.gather));
  DeviceBuffer dh(static_cast<std::size_t>(P_cap * ld_h * 2)), da(static_cast<std::size_t>(P_cap * ld_a * 2));

  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = E, a.N = N, a.K = d, a.P_max = P_cap;
  a.expert_offsets = static_cast<const std::int32_t*>(doff.get());
  a.expert_tiles = static_cast<const std::int32_t*>(dtil.get());
  a.a = dx.get(), a.lda = ldx, a.a_gather = static_cast<const std::int32_t*>(dgat.get());
  a.b.ptr = dw.get(), a.b.expert_stride = rows_e * ldw, a.b.stride_col = ldw, a.b.stride_k = 1;
  a.b.permute = concat ? 1 : 0, a.b.glu_n = n;
  a.epilogue = Epilogue::kUpActivation;
  a.out = uc.store_h ? dh.get() : nullptr, a.ld_out = ld_h;
  if (uc.bias) a.bias = db.get(), a.ld_bias = N;
  a.activation = uc.act;
  if (uc.act == Activation::kGptOssSwiGLU)
    a.act_alpha = static_cast<float>(kGptOssTestAlpha), a.act_limit = static_cast<float>(uc.swiglu_limit);
  a.act_out = da.get(), a.ld_act = ld_a;

  launch_grouped("up_projection", a, reference);
  UpResult r;
  r.raw_h = dh.download(), r.raw_a = da.download();
  r.canaries = dh.canary_intact() && da.canary_intact();
  r.tails_untouched = all_bytes(r.raw_a, static_cast<std::size_t>(P * ld_a * 2), r.raw_a.size(), 0xFF) &&
                      all_bytes(r.raw_h, static_cast<std::size_t>(uc.store_h ? P * ld_h * 2 : 0), r.raw_h.size(), 0xFF) &&
                      guard_untouched(r.raw_a, act_cols, ld_a) && guard_untouched(r.raw_h, N, ld_h);
  r.h = decode_rows(r.raw_h, P, N, ld_h);
  r.a = decode_rows(r.raw_a, P, act_cols, ld_a);
  // float64 expectation (H interleaved whatever the layout).
  r.h_ref.assign(static_cast<std::size_t>(P * N), 0.0);
  r.a_ref.assign(static_cast<std::size_t>(P * act_cols), 0.0);
  // Weight row outermost: each expert's weights stream through the cache once, not once per routed row (at
  // gpt-oss's d = n = 2880 that is 132 MB per expert, and the row-outer order made this check take seconds per call).
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t c = 0; c < N; ++c) {
      const double* wr = &w[static_cast<std::size_t>((e * N + c) * d)];
      for (std::int64_t g = s.offsets[e]; g < s.offsets[e + 1]; ++g) {
        const double* xr = &x[static_cast<std::size_t>(s.gather[g] * d)];
        double acc = uc.bias ? b[e * N + c] : 0.0;
        for (std::int64_t k = 0; k < d; ++k) acc += xr[k] * wr[k];
        r.h_ref[g * N + c] = acc;
      }
    }
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t g = s.offsets[e]; g < s.offsets[e + 1]; ++g) {
      for (std::int64_t j = 0; j < act_cols; ++j)
        r.a_ref[g * act_cols + j] =
            uc.act == Activation::kGptOssSwiGLU
                ? gptoss_ref(r.h_ref[g * N + 2 * j], r.h_ref[g * N + 2 * j + 1], uc.swiglu_limit)
            : glu ? act_ref(uc.act, r.h_ref[g * N + 2 * j]) * r.h_ref[g * N + 2 * j + 1]
                  : act_ref(uc.act, r.h_ref[g * N + j]);
    }
  return r;
}

class HopperUpProjection : public testing::TestWithParam<UpCase> {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

// Segments: an empty expert, 1 row, 127, 128, 129, 257 rows (partial and exact tiles), then the rest.
const std::vector<int> kEdgeLengths = {0, 1, 127, 128, 0, 129, 257, 64, 3};

/// Runs `body` with the N tile forced to 128 (ping-pong) and 256 (cooperative; the up-projection multicasts W1
/// across 2-CTA clusters), then restores the heuristic.
template <class F>
void for_each_tile(F&& body) {
  for (int tile : {128, 256}) {
    SCOPED_TRACE("tile N " + std::to_string(tile));
    gpu::set_hopper_tile_n(tile);
    g_tile_n = tile;
    body();
  }
  gpu::set_hopper_tile_n(0);
  g_tile_n = 0;
}

TEST_P(HopperUpProjection, MatchesFloat64AndTheReferenceGemm) {
  const UpCase uc = GetParam();
  const std::int64_t n = 256;  // N = 512 (GLU) or 256: two or four 128-column tiles, one or two 256-column ones
  const UpResult ref = run_up(uc, 500, 320, n, kEdgeLengths, 21, /*reference=*/true);
  for_each_tile([&] {
  const UpResult fast = run_up(uc, 500, 320, n, kEdgeLengths, 21);
  EXPECT_TRUE(fast.canaries);
  EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones were written";
  for (double v : fast.a) ASSERT_FALSE(std::isnan(v)) << "an A element was not written";
  EXPECT_LT(rel_error(fast.a, fast.a_ref), 1e-2);
  EXPECT_LT(rel_error(fast.a, ref.a), 1e-2);
  if (uc.store_h) {
    for (double v : fast.h) ASSERT_FALSE(std::isnan(v)) << "an H element was not written";
    EXPECT_LT(rel_error(fast.h, fast.h_ref), 4e-3);  // bf16 output rounding only
    EXPECT_LT(rel_error(fast.h, ref.h), 4e-3);
  }
  // Deterministic: a second run is bitwise equal.
  const UpResult again = run_up(uc, 500, 320, n, kEdgeLengths, 21);
  EXPECT_EQ(again.raw_a, fast.raw_a);
  EXPECT_EQ(again.raw_h, fast.raw_h);
  });
}

std::vector<UpCase> up_cases() {
  std::vector<UpCase> v;
  for (Activation a : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared,
                       Activation::kReLU, Activation::kGELU, Activation::kSiLU, Activation::kGptOssSwiGLU})
    for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
      if (!is_glu(a) && l == WeightLayout::kConcatenated) continue;
      for (bool bias : {false, true})
        for (bool h : {true, false}) {
          v.push_back({a, l, bias, h});
          if (a == Activation::kGptOssSwiGLU) v.push_back({a, l, bias, h, kGptOssTestLimit});  // clamps active
        }
    }
  return v;
}
INSTANTIATE_TEST_SUITE_P(AllEpilogues, HopperUpProjection, testing::ValuesIn(up_cases()), up_case_name);

TEST(HopperUpProjectionProperties, LayoutsAndInferenceModeAreBitwiseIdentical) {
  REQUIRE_GPU();
  const UpCase il{Activation::kSwiGLU, WeightLayout::kInterleaved, true, true};
  const UpCase cc{Activation::kSwiGLU, WeightLayout::kConcatenated, true, true};
  const UpCase inf{Activation::kSwiGLU, WeightLayout::kInterleaved, true, false};
  for_each_tile([&] {
    const UpResult a = run_up(il, 300, 256, 128, kEdgeLengths, 5);
    const UpResult b = run_up(cc, 300, 256, 128, kEdgeLengths, 5);
    const UpResult c = run_up(inf, 300, 256, 128, kEdgeLengths, 5);
    EXPECT_EQ(a.raw_h, b.raw_h) << "H must not depend on the weight layout";
    EXPECT_EQ(a.raw_a, b.raw_a);
    EXPECT_EQ(a.raw_a, c.raw_a) << "A must not depend on whether H is stored";
  });
}

TEST(HopperUpProjectionProperties, EdgeShapes) {
  REQUIRE_GPU();
  const UpCase uc{Activation::kSwiGLU, WeightLayout::kConcatenated, true, true};
  struct Shape {
    std::int64_t T, d, n;
    std::vector<int> lengths;
    std::int64_t pad_rows, pad_k;
    const char* name;
  };
  std::vector<int> many(300, 0);  // > 32 experts: the scheduler walks several windows; most are empty
  for (std::size_t e = 0; e < many.size(); e += 7) many[e] = static_cast<int>(e % 150) + 1;
  const std::vector<Shape> shapes = {
      {1, 64, 64, {1}, 0, 0, "T1_one_row"},
      {1, 64, 64, {0, 0, 1, 0}, 0, 0, "T1_K1_among_empty_experts"},
      {40, 128, 64, {40, 40, 40, 40}, 0, 0, "K_eq_E"},
      {700, 192, 64, {700}, 0, 0, "E1"},
      {900, 128, 64, many, 0, 0, "300_experts"},
      {200, 256, 128, {200, 50, 0, 129}, 16, 64, "strided_weights"},
      {1, 64, 128, {0, 1}, 0, 0, "T1_wide_tile"},
      {900, 128, 128, many, 0, 0, "300_experts_wide_tile"},
  };
  for_each_tile([&] {
    for (const Shape& s : shapes) {
      const UpResult r = run_up(uc, s.T, s.d, s.n, s.lengths, 9, false, s.pad_rows, s.pad_k);
      EXPECT_TRUE(r.canaries) << s.name;
      EXPECT_TRUE(r.tails_untouched) << s.name;
      EXPECT_LT(rel_error(r.h, r.h_ref), 4e-3) << s.name;
      EXPECT_LT(rel_error(r.a, r.a_ref), 1e-2) << s.name;
    }
  });
}

// ---- down-projection ------------------------------------------------------------------------------------------

struct DownResult {
  std::vector<double> y, y_ref;
  std::vector<unsigned char> raw;
  bool tails_untouched = true, canaries = true;
};

/// guard > 0: `guard` extra columns after every row of the activations and W2 (NaN) and of Y (checked untouched).
/// The P x d rows a grouped GEMM stored with row stride ld (bf16), with its buffer's canaries, the rows past P and
/// the guard columns checked untouched.
DownResult stored_rows(const DeviceBuffer& out, std::int64_t P, std::int64_t d, std::int64_t ld) {
  DownResult r;
  r.raw = out.download();
  r.canaries = out.canary_intact();
  r.tails_untouched = all_bytes(r.raw, static_cast<std::size_t>(P * ld * 2), r.raw.size(), 0xFF) &&
                      guard_untouched(r.raw, d, ld);
  r.y = decode_rows(r.raw, P, d, ld);
  return r;
}

DownResult run_down(std::int64_t d, std::int64_t n, const std::vector<int>& lengths, bool bias, std::uint32_t seed,
                    bool reference = false, std::int64_t guard = 0) {
  std::mt19937 rng(seed);
  const std::int64_t E = static_cast<std::int64_t>(lengths.size());
  const Segments s = make_segments(lengths, 1, rng);
  const std::int64_t P = s.rows(), P_cap = P + 29;
  std::vector<double> act = normal(static_cast<std::size_t>(P_cap * n), 1.0, rng);
  const std::vector<double> w = normal(static_cast<std::size_t>(E * d * n), 1.0 / std::sqrt(double(n)), rng);
  const std::vector<double> b = normal(static_cast<std::size_t>(E * d), 0.5, rng);
  const std::int64_t lda = n + guard, ldy = d + guard;
  DeviceBuffer da(encode(with_nan_guard(act, P_cap, n, lda), DType::kBF16)),
      dw(encode(with_nan_guard(w, E * d, n, lda), DType::kBF16)), db(encode(b, DType::kBF16));
  DeviceBuffer doff(host_bytes(s.offsets)), dtil(host_bytes(s.tiles64)), dy(static_cast<std::size_t>(P_cap * ldy * 2));
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = E, a.N = d, a.K = n, a.P_max = P_cap;
  a.expert_offsets = static_cast<const std::int32_t*>(doff.get());
  a.expert_tiles = static_cast<const std::int32_t*>(dtil.get());
  a.a = da.get(), a.lda = lda;
  a.b.ptr = dw.get(), a.b.expert_stride = d * lda, a.b.stride_col = lda, a.b.stride_k = 1;
  a.epilogue = Epilogue::kStore;
  a.out = dy.get(), a.ld_out = ldy;
  if (bias) a.bias = db.get(), a.ld_bias = d;
  launch_grouped("down_projection", a, reference);
  DownResult r = stored_rows(dy, P, d, ldy);
  r.y_ref.assign(static_cast<std::size_t>(P * d), 0.0);
  for (std::int64_t e = 0; e < E; ++e)  // weight row outermost: each expert's W2 streams through the cache once
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t g = s.offsets[e]; g < s.offsets[e + 1]; ++g) {
        double acc = bias ? b[e * d + c] : 0.0;
        for (std::int64_t k = 0; k < n; ++k) acc += act[g * n + k] * w[(e * d + c) * n + k];
        r.y_ref[g * d + c] = acc;
      }
  return r;
}

// The rasterisation group only reorders the tiles: every group size (dividing an expert's M-tiles or not, larger
// than an expert) gives bitwise the same H, A and Y, on both tiles.
TEST(HopperSchedulerProperties, RasterOrderGivesBitwiseIdenticalResults) {
  REQUIRE_GPU();
  const UpCase uc{Activation::kSwiGLU, WeightLayout::kInterleaved, true, true};
  const std::vector<int> lengths = {1000, 0, 700, 129, 1, 300, 2000};  // 1 to 16 M-tiles per expert
  for_each_tile([&] {
    gpu::set_hopper_raster_m(1);
    const UpResult base = run_up(uc, 4130, 128, 256, lengths, 13);
    EXPECT_LT(rel_error(base.a, base.a_ref), 1e-2);
    const DownResult down_base = run_down(512, 128, lengths, true, 14);
    EXPECT_LT(rel_error(down_base.y, down_base.y_ref), 1e-2);
    for (int raster : {2, 3, 7, 64}) {
      SCOPED_TRACE("raster_m " + std::to_string(raster));
      gpu::set_hopper_raster_m(raster);
      const UpResult r = run_up(uc, 4130, 128, 256, lengths, 13);
      EXPECT_TRUE(r.canaries);
      EXPECT_TRUE(r.tails_untouched);
      EXPECT_EQ(r.raw_h, base.raw_h);
      EXPECT_EQ(r.raw_a, base.raw_a);
      EXPECT_EQ(run_down(512, 128, lengths, true, 14).raw, down_base.raw);
    }
  });
  gpu::set_hopper_raster_m(0);
}

TEST(HopperDownProjection, MatchesFloat64AndTheReferenceGemm) {
  REQUIRE_GPU();
  for (bool bias : {false, true})
    for (auto [d, n] : {std::pair<std::int64_t, std::int64_t>{384, 192}, {128, 64}, {256, 576}, {512, 1024}}) {
      const DownResult ref = run_down(d, n, kEdgeLengths, bias, 31, true);
      for_each_tile([&, d = d, n = n] {
      const DownResult fast = run_down(d, n, kEdgeLengths, bias, 31);
      for (double v : fast.y) ASSERT_FALSE(std::isnan(v)) << "a Y element was not written";
      EXPECT_TRUE(fast.canaries);
      EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones were written";
      EXPECT_LT(rel_error(fast.y, fast.y_ref), 4e-3) << d << "x" << n;
      EXPECT_LT(rel_error(fast.y, ref.y), 4e-3) << d << "x" << n;
      EXPECT_EQ(run_down(d, n, kEdgeLengths, bias, 31).raw, fast.raw) << "not deterministic";
      });
    }
}

TEST(HopperDownProjection, ManyExpertsAndSingleRows) {
  REQUIRE_GPU();
  const std::vector<int> many = many_short_segments();
  for_each_tile([&] {
    const DownResult r = run_down(256, 128, many, true, 3);
    EXPECT_TRUE(r.tails_untouched);
    EXPECT_LT(rel_error(r.y, r.y_ref), 4e-3);
  });
}

// ---- dispatch ---------------------------------------------------------------------------------------------------

// ---- backward dX~ = dH W1_e (MN-major W1 read in place) ------------------------------------------------------------

/// dX~ of `lengths` segments: dH (P x K, K = 2n for GLU rows), W1 (E, K, d) in the given layout, d output columns.
/// guard > 0: `guard` extra columns after every row of dH and W1 (NaN) and of dX~ (checked untouched).
DownResult run_dx(std::int64_t d, std::int64_t K, bool concatenated, const std::vector<int>& lengths,
                  std::uint32_t seed, bool reference = false, std::int64_t guard = 0) {
  std::mt19937 rng(seed);
  const std::int64_t E = static_cast<std::int64_t>(lengths.size()), n = K / 2;
  const Segments s = make_segments(lengths, 1, rng);
  const std::int64_t P = s.rows(), P_cap = P + 29;
  std::vector<double> dh = normal(static_cast<std::size_t>(P_cap * K), 1.0, rng);
  const std::vector<double> w1 = normal(static_cast<std::size_t>(E * K * d), 1.0 / std::sqrt(double(d)), rng);
  const std::int64_t lda = K + guard, ldw = d + guard;
  DeviceBuffer ddh(encode(with_nan_guard(dh, P_cap, K, lda), DType::kBF16)),
      dw(encode(with_nan_guard(w1, E * K, d, ldw), DType::kBF16));
  DeviceBuffer doff(host_bytes(s.offsets)), dtil(host_bytes(s.tiles64)), dy(static_cast<std::size_t>(P_cap * ldw * 2));
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = E, a.N = d, a.K = K, a.P_max = P_cap;
  a.expert_offsets = static_cast<const std::int32_t*>(doff.get());
  a.expert_tiles = static_cast<const std::int32_t*>(dtil.get());
  a.a = ddh.get(), a.lda = lda;
  a.b.ptr = dw.get(), a.b.expert_stride = K * ldw, a.b.stride_col = 1, a.b.stride_k = ldw;
  a.b.permute = concatenated ? 2 : 0, a.b.glu_n = n;
  a.epilogue = Epilogue::kStore;
  a.out = dy.get(), a.ld_out = ldw;
  launch_grouped("dx_expanded", a, reference);
  DownResult r = stored_rows(dy, P, d, ldw);
  r.y_ref.assign(static_cast<std::size_t>(P * d), 0.0);
  // Row-by-row axpy over W1's contiguous rows (each y element still sums k = 0, 1, ... in order): the column walk
  // it replaces read W1 with a stride of d elements and took minutes at gpt-oss's d = n = 2880.
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t g = s.offsets[e]; g < s.offsets[e + 1]; ++g) {
      double* yr = &r.y_ref[static_cast<std::size_t>(g * d)];
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t row = concatenated ? (k % 2) * n + k / 2 : k;
        const double coef = dh[g * K + k];
        const double* wr = &w1[static_cast<std::size_t>((e * K + row) * d)];
        for (std::int64_t c = 0; c < d; ++c) yr[c] += coef * wr[c];
      }
    }
  return r;
}

/// for_each_tile for dX~, each tile also in 2-CTA clusters along M (the weight tile multicast to the pair; an odd
/// expert's last pair has an empty second tile), then the heuristic's clusters again.
template <class F>
void for_each_dx_tile(F&& body) {
  for (int cluster : {1, 2}) {
    SCOPED_TRACE("cluster M " + std::to_string(cluster));
    gpu::set_hopper_cluster_m(cluster);
    for_each_tile(body);
  }
  gpu::set_hopper_cluster_m(0);
}

TEST(HopperDxExpanded, MatchesFloat64AndTheReferenceGemm) {
  REQUIRE_GPU();
  gpu::set_hopper_backward_enabled(true);
  for (bool concatenated : {false, true})
    for (auto [d, K] : {std::pair<std::int64_t, std::int64_t>{384, 128}, {128, 64}, {256, 512}, {512, 2048}}) {
      SCOPED_TRACE(std::to_string(d) + "x" + std::to_string(K) + (concatenated ? " concatenated" : ""));
      const DownResult ref = run_dx(d, K, concatenated, kEdgeLengths, 41, true);
      std::map<int, std::vector<unsigned char>> unclustered;  // tile N -> dX~ without clusters
      for_each_dx_tile([&, d = d, K = K] {
        const DownResult fast = run_dx(d, K, concatenated, kEdgeLengths, 41);
        for (double v : fast.y) ASSERT_FALSE(std::isnan(v)) << "a dX~ element was not written";
        EXPECT_TRUE(fast.canaries);
        EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones were written";
        EXPECT_LT(rel_error(fast.y, fast.y_ref), 4e-3);
        EXPECT_LT(rel_error(fast.y, ref.y), 4e-3);
        EXPECT_EQ(run_dx(d, K, concatenated, kEdgeLengths, 41).raw, fast.raw) << "not deterministic";
        // Clusters change who loads the weight tile, not what a tile computes: bitwise the same dX~.
        const auto it = unclustered.find(g_tile_n);
        if (it == unclustered.end())
          unclustered.emplace(g_tile_n, fast.raw);
        else
          EXPECT_EQ(fast.raw, it->second) << "clusters changed a bit of dX~";
      });
    }
}

TEST(HopperDxExpanded, ManyExpertsAndSingleRows) {
  REQUIRE_GPU();
  gpu::set_hopper_backward_enabled(true);
  const std::vector<int> many = many_short_segments();
  for_each_dx_tile([&] {
    const DownResult r = run_dx(256, 128, true, many, 3);
    EXPECT_TRUE(r.tails_untouched);
    EXPECT_LT(rel_error(r.y, r.y_ref), 4e-3);
  });
}

TEST(HopperDxExpanded, SwitchSendsItToTheReferenceGemm) {
  REQUIRE_GPU();
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = 4, a.N = 256, a.K = 128, a.P_max = 100;
  static std::int32_t dummy[64];
  a.a = dummy, a.lda = 128;
  a.b.ptr = dummy, a.b.expert_stride = 256 * 128, a.b.stride_col = 1, a.b.stride_k = 256;
  a.epilogue = Epilogue::kStore;
  a.out = dummy, a.ld_out = 256;
  gpu::set_hopper_backward_enabled(false);
  EXPECT_NE(gpu::hopper_unsupported_reason(a).find("MACHMOE_HOPPER_BACKWARD"), std::string::npos);
  gpu::set_hopper_backward_enabled(true);
  EXPECT_EQ(gpu::hopper_unsupported_reason(a), "");
}

TEST(HopperDispatch, NamesWhyAShapeFallsBack) {
  REQUIRE_GPU();
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = 4, a.N = 256, a.K = 128, a.P_max = 100;
  static std::int32_t dummy[64];
  a.a = dummy, a.lda = 128, a.a_gather = dummy;
  a.b.ptr = dummy, a.b.expert_stride = 256 * 128, a.b.stride_col = 128, a.b.stride_k = 1;
  a.epilogue = Epilogue::kUpActivation;
  a.out = dummy, a.ld_out = 256, a.act_out = dummy, a.ld_act = 128;
  EXPECT_EQ(gpu::hopper_unsupported_reason(a), "");
  auto reason = [&](auto change) {
    VarlenMArgs b = a;
    change(b);
    return gpu::hopper_unsupported_reason(b);
  };
  // Any multiple of 8 runs (edge tiles, a partial last k-block); what breaks 16-byte rows falls back.
  EXPECT_EQ(reason([](VarlenMArgs& b) { b.K = 96; }), "");
  EXPECT_EQ(reason([](VarlenMArgs& b) { b.N = 192; b.ld_act = 96; }), "");
  EXPECT_NE(reason([](VarlenMArgs& b) { b.K = 100; }).find("K = 100"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.N = 196; }).find("N = 196"), std::string::npos);
  // A GLU up-projection of n = 12 (N = 24): A's rows are 12 wide.
  EXPECT_NE(reason([](VarlenMArgs& b) { b.N = 24; }).find("n = N / 2"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.dt = DType::kFP16; }).find("dtype"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.b.stride_k = 2; }).find("K-major"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.lda = 129; }).find("aligned"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.epilogue = Epilogue::kActivationGrad; }).find("dH GEMM"),
            std::string::npos);
  // The expert stride: with several experts one that breaks 16-byte rows falls back; with one expert it is never
  // stepped, so any value runs (a broadcast weight's 0, an odd slice's), K-major and MN-major alike.
  EXPECT_NE(reason([](VarlenMArgs& b) { b.b.expert_stride = 256 * 128 + 4; }).find("aligned"), std::string::npos);
  for (std::int64_t stride : {std::int64_t{0}, std::int64_t{3}, std::int64_t{256 * 128 + 4}}) {
    EXPECT_EQ(reason([&](VarlenMArgs& b) { b.E = 1, b.b.expert_stride = stride; }), "") << stride;
    EXPECT_EQ(reason([&](VarlenMArgs& b) {
                b.E = 1, b.b.expert_stride = stride, b.b.stride_col = 1, b.b.stride_k = 256, b.a_gather = nullptr;
                b.epilogue = Epilogue::kStore, b.act_out = nullptr;
              }),
              "")
        << "MN-major (dX~), " << stride;
  }
  gpu::set_hopper_kernels_enabled(false);
  EXPECT_NE(gpu::hopper_unsupported_reason(a).find("disabled"), std::string::npos);
  gpu::set_hopper_kernels_enabled(true);
}


// ---- backward dH kernel: dA' = gather(dO) W2_e^T, dH = act'(H) (s dA'), A' = s A, dS partials ---------------------

struct DhResult {
  std::vector<double> dh, ap, ds, dh_ref, ap_ref, ds_ref;  // ds: per pair, the sum of its partials
  std::vector<unsigned char> raw_dh, raw_ap, raw_ds;
  bool tails_untouched = true, canaries = true;
  std::int64_t clamped = 0, at_limit = 0;  // gptoss_swiglu: (gate, up) pairs with a value beyond / exactly at a limit
};

/// The dH kernel over `lengths` segments: T tokens of dO (T x d), W2 (E, d, n) read in place (stride 1 along n),
/// H (P x w1_rows, interleaved) ~ N(0, 1), a random score per pair and a random pair order (scatter).
/// guard > 0: `guard` extra columns after every row of dO, W2 and H (NaN: a padded column that read them would
/// make its dS partial NaN) and of dH and A' (checked untouched). The dS partials are exactly ceil(n / 64) per pair,
/// with the buffer's canary right after the last pair's.
DhResult run_dh(Activation act, std::int64_t T, std::int64_t d, std::int64_t n, const std::vector<int>& lengths,
                std::uint32_t seed, bool reference = false, bool with_expectation = true, std::int64_t guard = 0,
                double swiglu_limit = kGptOssSwiGLULimit) {
  std::mt19937 rng(seed);
  const std::int64_t E = static_cast<std::int64_t>(lengths.size());
  const bool glu = is_glu(act);
  const std::int64_t rows = glu ? 2 * n : n, ds_tiles = (n + gpu::kDsTileN - 1) / gpu::kDsTileN;
  const std::int64_t ldo = d + guard, ldw = n + guard, ldh = rows + guard;
  const Segments s = make_segments(lengths, T, rng);
  const std::int64_t P = s.rows(), P_cap = P + 19;
  const std::vector<double> dout = normal(static_cast<std::size_t>(T * d), 1.0, rng);
  const std::vector<double> w2 = normal(static_cast<std::size_t>(E * d * n), 1.0 / std::sqrt(double(n)), rng);
  const std::vector<double> h = normal(static_cast<std::size_t>(P_cap * rows), 1.0, rng);
  std::vector<float> scores(static_cast<std::size_t>(P));
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (auto& x : scores) x = u(rng);
  std::vector<std::int32_t> scatter(static_cast<std::size_t>(P));
  for (std::int64_t g = 0; g < P; ++g) scatter[g] = static_cast<std::int32_t>(g);
  std::shuffle(scatter.begin(), scatter.end(), rng);
  DeviceBuffer ddo(encode(with_nan_guard(dout, T, d, ldo), DType::kBF16)),
      dw(encode(with_nan_guard(w2, E * d, n, ldw), DType::kBF16)),
      dhin(encode(with_nan_guard(h, P_cap, rows, ldh), DType::kBF16));
  DeviceBuffer doff(host_bytes(s.offsets)), dtil(host_bytes(s.tiles64)), dgat(host_bytes(s.gather)),
      dsc(host_bytes(scores)), dscat(host_bytes(scatter));
  DeviceBuffer ddh(static_cast<std::size_t>(P_cap * ldh * 2)), dapr(static_cast<std::size_t>(P_cap * ldw * 2)),
      dpart(static_cast<std::size_t>(P * ds_tiles * 4));
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = E, a.N = n, a.K = d, a.P_max = P_cap;
  a.expert_offsets = static_cast<const std::int32_t*>(doff.get());
  a.expert_tiles = static_cast<const std::int32_t*>(dtil.get());
  a.a = ddo.get(), a.lda = ldo, a.a_gather = static_cast<const std::int32_t*>(dgat.get());
  a.b.ptr = dw.get(), a.b.expert_stride = d * ldw, a.b.stride_col = 1, a.b.stride_k = ldw;
  a.epilogue = Epilogue::kActivationGrad;
  a.activation = act;
  if (act == Activation::kGptOssSwiGLU)
    a.act_alpha = static_cast<float>(kGptOssTestAlpha), a.act_limit = static_cast<float>(swiglu_limit);
  a.out = ddh.get(), a.ld_out = ldh;
  a.act_out = dapr.get(), a.ld_act = ldw;
  a.h_in = dhin.get(), a.ld_h = ldh;
  a.scores = static_cast<const float*>(dsc.get()), a.scatter = static_cast<const std::int32_t*>(dscat.get());
  a.ds_partial = static_cast<float*>(dpart.get());
  launch_grouped("dh_kernel", a, reference);
  DhResult r;
  r.raw_dh = ddh.download(), r.raw_ap = dapr.download(), r.raw_ds = dpart.download();
  r.canaries = ddh.canary_intact() && dapr.canary_intact() && dpart.canary_intact();
  r.tails_untouched = all_bytes(r.raw_dh, static_cast<std::size_t>(P * ldh * 2), r.raw_dh.size(), 0xFF) &&
                      all_bytes(r.raw_ap, static_cast<std::size_t>(P * ldw * 2), r.raw_ap.size(), 0xFF) &&
                      guard_untouched(r.raw_dh, rows, ldh) && guard_untouched(r.raw_ap, n, ldw);
  r.dh = decode_rows(r.raw_dh, P, rows, ldh);
  r.ap = decode_rows(r.raw_ap, P, n, ldw);
  const std::vector<double> parts = decode(r.raw_ds.data(), static_cast<std::size_t>(P * ds_tiles), DType::kFP32);
  r.ds.assign(static_cast<std::size_t>(P), 0.0);
  for (std::int64_t p = 0; p < P; ++p)
    for (std::int64_t t = 0; t < ds_tiles; ++t) r.ds[p] += parts[p * ds_tiles + t];
  if (!with_expectation) return r;
  // float64 expectation from the same bf16 inputs.
  r.dh_ref.assign(static_cast<std::size_t>(P * rows), 0.0);
  r.ap_ref.assign(static_cast<std::size_t>(P * n), 0.0);
  r.ds_ref.assign(static_cast<std::size_t>(P), 0.0);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t g = s.offsets[e]; g < s.offsets[e + 1]; ++g) {
      const double* dor = &dout[static_cast<std::size_t>(s.gather[g] * d)];
      const std::int64_t pr = scatter[g];
      const double sc = scores[pr];
      // dA' of the row by axpy over W2's contiguous rows (each element still sums k = 0, 1, ... in order; a column
      // walk with a stride of n elements was the slow part of this check at gpt-oss's shapes).
      std::vector<double> dap_row(static_cast<std::size_t>(n), 0.0);
      for (std::int64_t k = 0; k < d; ++k) {
        const double coef = dor[k];
        const double* wr = &w2[static_cast<std::size_t>((e * d + k) * n)];
        for (std::int64_t j = 0; j < n; ++j) dap_row[j] += coef * wr[j];
      }
      for (std::int64_t j = 0; j < n; ++j) {
        const double dap = dap_row[j];
        const double* hr = &h[static_cast<std::size_t>(g * rows)];
        double a_val;
        if (act == Activation::kGptOssSwiGLU) {  // math::glu_backward in float64 (CPU-tested against the formula)
          const math::GluGrad<double> f = math::glu_backward<Activation::kGptOssSwiGLU>(
              hr[2 * j], hr[2 * j + 1], sc * dap, math::ActParams<double>{kGptOssTestAlpha, swiglu_limit});
          a_val = f.value;
          r.dh_ref[g * rows + 2 * j] = f.d_gate;
          r.dh_ref[g * rows + 2 * j + 1] = f.d_up;
          r.at_limit += hr[2 * j] == swiglu_limit || std::fabs(hr[2 * j + 1]) == swiglu_limit;
          r.clamped += hr[2 * j] > swiglu_limit || std::fabs(hr[2 * j + 1]) > swiglu_limit;
        } else if (glu) {
          const auto f = math::act_value_and_derivative(act, hr[2 * j]);
          a_val = f.value * hr[2 * j + 1];
          r.dh_ref[g * rows + 2 * j] = sc * dap * hr[2 * j + 1] * f.derivative;
          r.dh_ref[g * rows + 2 * j + 1] = sc * dap * f.value;
        } else {
          const auto f = math::act_value_and_derivative(act, hr[j]);
          a_val = f.value;
          r.dh_ref[g * rows + j] = sc * dap * f.derivative;
        }
        r.ap_ref[g * n + j] = sc * a_val;
        r.ds_ref[pr] += dap * a_val;
      }
    }
  return r;
}

// The dH kernel's outputs all written (no NaN left from the buffers' fill or read from a NaN guard), its canaries and
// the rows and columns past the valid ones untouched, dH, A' and the dS partials within 1e-2 of float64 (the run's own
// expectation) and of the reference GEMM's run `ref` (the same inputs).
void expect_dh_matches(const DhResult& fast, const DhResult& ref) {
  for (double v : fast.dh) ASSERT_FALSE(std::isnan(v)) << "a dH element is NaN (unwritten, or a guard read)";
  for (double v : fast.ap) ASSERT_FALSE(std::isnan(v)) << "an A' element is NaN (unwritten, or a guard read)";
  for (double v : fast.ds) ASSERT_FALSE(std::isnan(v)) << "a dS partial is unwritten or took a padded column's NaN";
  EXPECT_TRUE(fast.canaries) << "written past the dS partials, dH or A'";
  EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones or columns past the valid ones were written";
  EXPECT_LT(rel_error(fast.dh, fast.dh_ref), 1e-2);
  EXPECT_LT(rel_error(fast.ap, fast.ap_ref), 1e-2);
  EXPECT_LT(rel_error(fast.ds, fast.ds_ref), 1e-2);
  EXPECT_LT(rel_error(fast.dh, ref.dh), 1e-2);
  EXPECT_LT(rel_error(fast.ap, ref.ap), 1e-2);
  EXPECT_LT(rel_error(fast.ds, ref.ds), 1e-2);
}

class HopperDhKernel : public testing::TestWithParam<Activation> {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    gpu::set_hopper_backward_enabled(true);
  }
};

TEST_P(HopperDhKernel, MatchesFloat64AndTheReferenceGemm) {
  const Activation act = GetParam();
  for (auto [d, n] : {std::pair<std::int64_t, std::int64_t>{320, 256}, {64, 128}, {1024, 384}}) {
    SCOPED_TRACE("d " + std::to_string(d) + " n " + std::to_string(n));
    const DhResult ref = run_dh(act, 300, d, n, kEdgeLengths, 51, true, /*with_expectation=*/false);
    for_each_tile([&, d = d, n = n] {
      const DhResult fast = run_dh(act, 300, d, n, kEdgeLengths, 51);
      ASSERT_NO_FATAL_FAILURE(expect_dh_matches(fast, ref));
      const DhResult again = run_dh(act, 300, d, n, kEdgeLengths, 51, false, /*with_expectation=*/false);
      EXPECT_EQ(again.raw_dh, fast.raw_dh) << "not deterministic";
      EXPECT_EQ(again.raw_ap, fast.raw_ap) << "not deterministic";
      EXPECT_EQ(again.raw_ds, fast.raw_ds) << "not deterministic";
    });
  }
}

INSTANTIATE_TEST_SUITE_P(AllActivations, HopperDhKernel,
                         testing::Values(Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU,
                                         Activation::kReLUSquared, Activation::kReLU, Activation::kGELU,
                                         Activation::kSiLU, Activation::kGptOssSwiGLU),
                         [](const testing::TestParamInfo<Activation>& i) {
                           return std::string(activation_name(i.param));
                         });

// gptoss_swiglu with its clamps active (limit 1.25 on H ~ N(0, 1) in bf16): H is an input here, so the kernel and the
// float64 expectation see the same values, those exactly on the limit included (torch passes the gradient there).
TEST(HopperDhKernelProperties, GptOssClampsMatchFloat64AndTheReferenceGemm) {
  REQUIRE_GPU();
  gpu::set_hopper_backward_enabled(true);
  const Activation act = Activation::kGptOssSwiGLU;
  for (auto [d, n] : {std::pair<std::int64_t, std::int64_t>{320, 256}, {64, 128}, {1024, 384}}) {
    SCOPED_TRACE("d " + std::to_string(d) + " n " + std::to_string(n));
    const DhResult ref = run_dh(act, 300, d, n, kEdgeLengths, 53, true, true, 0, kGptOssTestLimit);
    EXPECT_GT(ref.clamped * 5, static_cast<std::int64_t>(ref.ap.size())) << "too few clamped values to test";
    EXPECT_GT(ref.at_limit, 0) << "no H value exactly on the limit";
    EXPECT_LT(rel_error(ref.dh, ref.dh_ref), 1e-2) << "GPU reference GEMM";
    EXPECT_LT(rel_error(ref.ap, ref.ap_ref), 1e-2) << "GPU reference GEMM";
    EXPECT_LT(rel_error(ref.ds, ref.ds_ref), 1e-2) << "GPU reference GEMM";
    for_each_tile([&, d = d, n = n] {
      const DhResult fast = run_dh(act, 300, d, n, kEdgeLengths, 53, false, true, 0, kGptOssTestLimit);
      for (double v : fast.dh) ASSERT_FALSE(std::isnan(v)) << "a dH element was not written";
      EXPECT_TRUE(fast.canaries);
      EXPECT_TRUE(fast.tails_untouched);
      EXPECT_LT(rel_error(fast.dh, fast.dh_ref), 1e-2);
      EXPECT_LT(rel_error(fast.ap, fast.ap_ref), 1e-2);
      EXPECT_LT(rel_error(fast.ds, fast.ds_ref), 1e-2);
      EXPECT_LT(rel_error(fast.dh, ref.dh), 1e-2);
      // Clamped elements get exactly zero gradient on both paths.
      for (std::size_t i = 0; i < fast.dh.size(); ++i)
        if (fast.dh_ref[i] == 0.0) {
          ASSERT_EQ(fast.dh[i], 0.0) << "element " << i;
        }
    });
  }
}

TEST(HopperDhKernelProperties, ManyExpertsSingleRowsAndOneToken) {
  REQUIRE_GPU();
  gpu::set_hopper_backward_enabled(true);
  const std::vector<int> many = many_short_segments();
  for_each_tile([&] {
    const DhResult r = run_dh(Activation::kSwiGLU, 64, 256, 256, many, 7);
    EXPECT_TRUE(r.tails_untouched);
    EXPECT_LT(rel_error(r.dh, r.dh_ref), 1e-2);
    EXPECT_LT(rel_error(r.ds, r.ds_ref), 1e-2);
    const DhResult one = run_dh(Activation::kGELU, 1, 128, 256, {0, 1, 0}, 8);  // T = 1, one routed row
    EXPECT_TRUE(one.tails_untouched);
    EXPECT_LT(rel_error(one.dh, one.dh_ref), 1e-2);
    EXPECT_LT(rel_error(one.ap, one.ap_ref), 1e-2);
    EXPECT_LT(rel_error(one.ds, one.ds_ref), 1e-2);
  });
}

// The dH epilogue stages, stores and reuses its buffers warp by warp (16 rows each). Segments (one an expert) whose
// last row atom leaves one warp with every count of valid rows, 1 to 15: alone in the atom (up to 15 rows), after full
// warps with empty ones behind (17-63 rows), and past one and two atoms (65-140), in both tiles, against float64 and
// the reference GEMM.
TEST(HopperDhKernelProperties, EveryCountOfAWarpsRows) {
  REQUIRE_GPU();
  gpu::set_hopper_backward_enabled(true);
  const std::vector<int> lengths = {1,  2,  4,  5,  6,  7,  8,  9,  10, 11,  12,  13,  14,  15, 16, 17, 20,
                                    31, 33, 38, 47, 49, 56, 62, 63, 0,  65,  72,  81,  90,  97, 113, 130, 140, 3};
  for (Activation act : {Activation::kSwiGLU, Activation::kReLU}) {
    SCOPED_TRACE(activation_name(act));
    const DhResult ref = run_dh(act, 400, 128, 256, lengths, 61, true, /*with_expectation=*/false);
    for_each_tile([&] {
      const DhResult fast = run_dh(act, 400, 128, 256, lengths, 61);
      expect_dh_matches(fast, ref);
    });
  }
}

TEST(HopperDhKernelProperties, FallsBackWhereTheKernelDoesNotApply) {
  REQUIRE_GPU();
  VarlenMArgs a;
  a.dt = DType::kBF16;
  a.E = 4, a.N = 256, a.K = 128, a.P_max = 100;
  static std::int32_t dummy[64];
  a.a = dummy, a.lda = 128, a.a_gather = dummy;
  a.b.ptr = dummy, a.b.expert_stride = 256 * 128, a.b.stride_col = 1, a.b.stride_k = 256;
  a.epilogue = Epilogue::kActivationGrad;
  a.out = dummy, a.ld_out = 512, a.act_out = dummy, a.ld_act = 256, a.h_in = dummy, a.ld_h = 512;
  a.scores = reinterpret_cast<const float*>(dummy), a.scatter = dummy, a.ds_partial = reinterpret_cast<float*>(dummy);
  gpu::set_hopper_backward_enabled(true);
  EXPECT_EQ(gpu::hopper_unsupported_reason(a), "");
  auto reason = [&](auto change) {
    VarlenMArgs b = a;
    change(b);
    return gpu::hopper_unsupported_reason(b);
  };
  EXPECT_NE(reason([](VarlenMArgs& b) { b.a_gather = nullptr; }).find("gather"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.ld_h = 511; }).find("H rows"), std::string::npos);
  EXPECT_EQ(reason([](VarlenMArgs& b) { b.N = 200; }), "");  // n = 200: edge tiles
  EXPECT_NE(reason([](VarlenMArgs& b) { b.N = 196; }).find("N = 196"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.K = 100; }).find("K = 100"), std::string::npos);
  EXPECT_NE(reason([](VarlenMArgs& b) { b.ds_partial = nullptr; }).find("dS-partial"), std::string::npos);
  gpu::set_hopper_backward_enabled(false);
  EXPECT_NE(gpu::hopper_unsupported_reason(a).find("MACHMOE_HOPPER_BACKWARD"), std::string::npos);
  gpu::set_hopper_backward_enabled(true);
}

// ---- edge tiles: d and n any multiple of 8 (issue #14, T13) ---------------------------------------------------------
//
// Shapes whose N is no multiple of the tile (the last N-tile hangs past N) and whose K is no multiple of 64 (a
// partial last k-block), on both tiles, with NaN guard columns after every input row (a load past a row's valid
// columns would bring NaN into a stored element or a dS partial) and guard columns after every output row that must
// keep their fill (stores clipped at the valid columns). Segments include empty experts and 1-row experts.

struct OddShape {
  std::int64_t T, d, n;
  std::vector<int> lengths;
  const char* name;
};

constexpr std::int64_t kGuard = 8;  // one 16-byte chunk of bf16 after every row

/// K % 64 in {8, 56}, N % 128 in {8, ..., 120}: partial k-blocks and edge tiles of every kernel.
std::vector<OddShape> odd_shapes() {
  return {{300, 200, 72, kEdgeLengths, "d200_n72"},
          {300, 136, 264, kEdgeLengths, "d136_n264"},
          {300, 248, 120, kEdgeLengths, "d248_n120"},
          {50, 8, 8, {0, 1, 5, 0, 130}, "d8_n8"}};
}
/// gpt-oss (d = n = 2880: N = 2880 or 5760, 64 columns past the last whole 128-tile) with few rows, so that the
/// float64 expectation stays quick.
const OddShape kGptOss{200, 2880, 2880, {0, 1, 37, 0, 130}, "gptoss_d2880_n2880"};

const Activation kAllActivations[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU,
                                      Activation::kReLUSquared, Activation::kReLU, Activation::kGELU,
                                      Activation::kSiLU};

class HopperEdgeTiles : public testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    gpu::set_hopper_kernels_enabled(true);
    gpu::set_hopper_backward_enabled(true);
  }
};

void check_up(const UpCase& uc, const OddShape& sh) {
  SCOPED_TRACE(std::string(sh.name) + " " + activation_name(uc.act) + " " + weight_layout_name(uc.layout) +
               (uc.bias ? " bias" : "") + (uc.store_h ? "" : " A only"));
  const UpResult ref = run_up(uc, sh.T, sh.d, sh.n, sh.lengths, 61, /*reference=*/true, 0, 0, kGuard);
  for_each_tile([&] {
    const UpResult fast = run_up(uc, sh.T, sh.d, sh.n, sh.lengths, 61, false, 0, 0, kGuard);
    EXPECT_TRUE(fast.canaries);
    EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones or columns past the valid ones were written";
    for (double v : fast.a) ASSERT_FALSE(std::isnan(v)) << "an A element is NaN (unwritten, or a guard read)";
    EXPECT_LT(rel_error(fast.a, fast.a_ref), 1e-2);
    EXPECT_LT(rel_error(fast.a, ref.a), 1e-2);
    if (uc.store_h) {
      for (double v : fast.h) ASSERT_FALSE(std::isnan(v)) << "an H element is NaN (unwritten, or a guard read)";
      EXPECT_LT(rel_error(fast.h, fast.h_ref), 4e-3);
      EXPECT_LT(rel_error(fast.h, ref.h), 4e-3);
    }
  });
}

TEST_F(HopperEdgeTiles, UpProjectionEveryActivationLayoutAndBias) {
  for (const OddShape& sh : odd_shapes())
    for (Activation act : kAllActivations)
      for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated}) {
        if (!is_glu(act) && l == WeightLayout::kConcatenated) continue;
        for (bool bias : {false, true}) check_up({act, l, bias, true}, sh);
      }
  check_up({Activation::kSwiGLU, WeightLayout::kConcatenated, true, false}, odd_shapes()[0]);  // inference: A only
}

TEST_F(HopperEdgeTiles, UpProjectionGptOss) {
  for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated})
    check_up({Activation::kSwiGLU, l, true, true}, kGptOss);
  check_up({Activation::kGELU, WeightLayout::kInterleaved, false, true}, kGptOss);  // N = n = 2880
}

// The gpt-oss test above split into its factors at small cost (its float64 check is the slow part), so that a hang
// or a failure there is traced to one of them: many tiles per CTA with edge tiles among them (the edge tests above
// give every CTA one tile at most), K = 2880 (45 k-blocks), and N = 5760 / 2880 itself. n = 320 repeats gpt-oss's
// edge pattern at small N: N = 640 = 2 x 256 + 128 and N = 320 = 2 x 128 + 64 = 256 + 64, so the GLU's 256-wide edge
// tile has its second half box wholly past N (loaded by the cluster's second CTA and multicast), and the 128- and
// 256-wide edge tiles of N = n have exactly 64 valid columns, the rest (a half box wholly past N) padding.
std::vector<int> many_tile_lengths() {
  std::vector<int> v;
  for (int e = 0; e < 40; ++e) v.push_back(e % 7 == 3 ? 0 : 37 + (e * 53) % 150);  // empty experts among them
  return v;
}

TEST_F(HopperEdgeTiles, UpProjectionManyTilesPerCta) {
  const OddShape sh{3000, 320, 320, many_tile_lengths(), "many_tiles_d320_n320"};  // about 250 tiles per launch
  for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated})
    check_up({Activation::kSwiGLU, l, true, true}, sh);
  check_up({Activation::kGELU, WeightLayout::kInterleaved, true, true}, sh);
}

TEST_F(HopperEdgeTiles, UpProjectionGptOssK) {
  const OddShape sh{200, 2880, 320, {0, 1, 37, 0, 130}, "d2880_n320"};  // K = 2880, N = 640 or 320
  for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated})
    check_up({Activation::kSwiGLU, l, true, true}, sh);
  check_up({Activation::kGELU, WeightLayout::kInterleaved, false, true}, sh);
}

TEST_F(HopperEdgeTiles, UpProjectionGptOssN) {
  const OddShape sh{200, 64, 2880, {0, 1, 37, 0, 130}, "d64_n2880"};  // N = 5760 or 2880, K = 64
  for (WeightLayout l : {WeightLayout::kInterleaved, WeightLayout::kConcatenated})
    check_up({Activation::kSwiGLU, l, true, true}, sh);
  check_up({Activation::kGELU, WeightLayout::kInterleaved, false, true}, sh);
}

TEST_F(HopperEdgeTiles, LayoutsStayBitwiseIdentical) {
  const OddShape sh = odd_shapes()[0];
  for_each_tile([&] {
    const UpResult a = run_up({Activation::kSwiGLU, WeightLayout::kInterleaved, true, true}, sh.T, sh.d, sh.n,
                              sh.lengths, 5, false, 0, 0, kGuard);
    const UpResult b = run_up({Activation::kSwiGLU, WeightLayout::kConcatenated, true, true}, sh.T, sh.d, sh.n,
                              sh.lengths, 5, false, 0, 0, kGuard);
    EXPECT_EQ(a.raw_h, b.raw_h) << "H must not depend on the weight layout";
    EXPECT_EQ(a.raw_a, b.raw_a);
  });
}

void check_down(const OddShape& sh, bool bias) {
  SCOPED_TRACE(std::string(sh.name) + (bias ? " bias" : ""));
  const DownResult ref = run_down(sh.d, sh.n, sh.lengths, bias, 71, true, kGuard);
  for_each_tile([&] {
    const DownResult fast = run_down(sh.d, sh.n, sh.lengths, bias, 71, false, kGuard);
    for (double v : fast.y) ASSERT_FALSE(std::isnan(v)) << "a Y element is NaN (unwritten, or a guard read)";
    EXPECT_TRUE(fast.canaries);
    EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones or columns past d were written";
    EXPECT_LT(rel_error(fast.y, fast.y_ref), 4e-3);
    EXPECT_LT(rel_error(fast.y, ref.y), 4e-3);
    EXPECT_EQ(run_down(sh.d, sh.n, sh.lengths, bias, 71, false, kGuard).raw, fast.raw) << "not deterministic";
  });
}

TEST_F(HopperEdgeTiles, DownProjection) {
  for (const OddShape& sh : odd_shapes())
    for (bool bias : {false, true}) check_down(sh, bias);
  check_down(kGptOss, true);
}

void check_dx(const OddShape& sh, std::int64_t K, bool concatenated) {
  SCOPED_TRACE(std::string(sh.name) + " K " + std::to_string(K) + (concatenated ? " concatenated" : ""));
  const DownResult ref = run_dx(sh.d, K, concatenated, sh.lengths, 81, true, kGuard);
  for_each_dx_tile([&] {
    const DownResult fast = run_dx(sh.d, K, concatenated, sh.lengths, 81, false, kGuard);
    for (double v : fast.y) ASSERT_FALSE(std::isnan(v)) << "a dX~ element is NaN (unwritten, or a guard read)";
    EXPECT_TRUE(fast.canaries);
    EXPECT_TRUE(fast.tails_untouched) << "rows past the routed ones or columns past d were written";
    EXPECT_LT(rel_error(fast.y, fast.y_ref), 4e-3);
    EXPECT_LT(rel_error(fast.y, ref.y), 4e-3);
  });
}

TEST_F(HopperEdgeTiles, DxExpandedBothLayoutsAndNonGlu) {
  for (const OddShape& sh : odd_shapes()) {
    for (bool concatenated : {false, true}) check_dx(sh, 2 * sh.n, concatenated);  // GLU: K = 2n
    check_dx(sh, sh.n, false);                                                      // other activations: K = n
  }
  for (bool concatenated : {false, true}) check_dx(kGptOss, 2 * kGptOss.n, concatenated);
}

void check_dh(Activation act, const OddShape& sh) {
  SCOPED_TRACE(std::string(sh.name) + " " + activation_name(act));
  const DhResult ref = run_dh(act, sh.T, sh.d, sh.n, sh.lengths, 91, true, /*with_expectation=*/false, kGuard);
  for_each_tile([&] {
    const DhResult fast = run_dh(act, sh.T, sh.d, sh.n, sh.lengths, 91, false, true, kGuard);
    ASSERT_NO_FATAL_FAILURE(expect_dh_matches(fast, ref));
    const DhResult again = run_dh(act, sh.T, sh.d, sh.n, sh.lengths, 91, false, false, kGuard);
    EXPECT_EQ(again.raw_ds, fast.raw_ds) << "not deterministic";
  });
}

TEST_F(HopperEdgeTiles, DhKernelEveryActivation) {
  for (const OddShape& sh : odd_shapes())
    for (Activation act : kAllActivations) check_dh(act, sh);
  check_dh(Activation::kSwiGLU, kGptOss);
  check_dh(Activation::kGELU, kGptOss);
}

TEST_F(HopperEdgeTiles, OtherFamiliesManyTilesPerCta) {
  const OddShape sh{3000, 320, 320, many_tile_lengths(), "many_tiles_d320_n320"};
  check_down(sh, true);
  check_dx(sh, 2 * sh.n, true);
  check_dh(Activation::kSwiGLU, sh);
}

}  // namespace
}  // namespace machmoe::test
