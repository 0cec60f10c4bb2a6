// The Hopper weight-gradient kernels (src/gpu/hopper: varlen-K mainloop, K-grouped scheduler, weight-gradient
// epilogue) at the kernel level, through the dispatcher (launch_weight_gemm), against a float64 host computation of
// the same sum on the same bf16 inputs and against the GPU reference GEMM (launch_varlen_k_gemm):
//   dW2-shaped (A = dO gathered by the routing index, B = A' contiguous) and dW1-shaped (A = dH contiguous, B = X
//   gathered, interleaved or concatenated GLU row map); output bf16 and fp32; overwrite and accumulate-into
//   (pre-filled output); experts without rows (exact zeros; accumulating, untouched bits); 1-row segments, segments
//   that are not multiples of 64, one expert holding most rows; strided operands and output; both tiles (128 x 128
//   ping-pong, 128 x 256 cooperative); bitwise-identical reruns; NaN in every byte the kernel must not read (rows
//   past the last routed row, rows of tokens never routed, padding columns) and in every output byte it must write;
//   the dispatcher's fallback reasons. The reference kernel's options (output dtype, accumulate) are checked against
//   float64 too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>

#include "gpu/hopper/dispatch.hpp"
#include "gpu/kernels.hpp"
#include "gpu_support.hpp"

namespace machmoe::test {
namespace {

using gpu::VarlenKArgs;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct WgradCase {
  bool dw1 = false;  // dW1-shaped: A contiguous (dH), B gathered (X); else dW2-shaped: A gathered (dO), B contiguous
  std::int64_t M = 256, N = 256;
  std::int64_t T = 1000;  // rows of the gathered source (tokens)
  std::vector<int> lengths;  // rows per expert
  std::int64_t glu_n = 0;    // > 0: concatenated row map (M = 2 glu_n)
  DType dt = DType::kBF16;   // inputs
  DType out_dt = DType::kBF16;
  bool accumulate = false;
  std::int64_t pad = 0;  // extra elements per operand and output row, extra output rows per expert
};

enum class Path { kHopper, kReference };

/// The tile for_each_tile forces now (0: the heuristic's), for the progress notes.
int g_tile_n = 0;

/// One problem: inputs on the device (NaN wherever the GEMM must not read), the output's prefill, and the float64
/// expectation of every output element the GEMM writes.
class WgradProblem {
 public:
  WgradProblem(const WgradCase& wc, std::uint32_t seed) : c_(wc) {
    std::mt19937 rng(seed);
    E_ = static_cast<std::int64_t>(wc.lengths.size());
    offsets_.push_back(0);
    for (int f : wc.lengths) offsets_.push_back(offsets_.back() + f);
    P_ = offsets_.back();
    P_cap_ = P_ + 40;  // rows past the last routed row: NaN (uninitialised workspace)
    const std::int64_t P_cap = P_cap_;
    // Tokens t % 5 == 3 are never routed and hold NaN rows: a gathered copy may only read the rows it names.
    std::uniform_int_distribution<std::int64_t> tok(0, wc.T - 1);
    for (std::int64_t g = 0; g < P_; ++g) {
      std::int64_t t = tok(rng);
      if (t % 5 == 3) t = (t + 1) % wc.T;
      gather_.push_back(static_cast<std::int32_t>(t));
    }
    const std::int64_t wg = wc.dw1 ? wc.N : wc.M, wcn = wc.dw1 ? wc.M : wc.N;  // widths: gathered, contiguous
    ldg_ = wg + wc.pad, ldc_ = wcn + wc.pad;
    std::normal_distribution<double> nd(0.0, 1.0);
    gsrc_.assign(static_cast<std::size_t>(wc.T * ldg_), kNaN);
    for (std::int64_t t = 0; t < wc.T; ++t)
      if (t % 5 != 3)
        for (std::int64_t k = 0; k < wg; ++k) gsrc_[t * ldg_ + k] = nd(rng);
    csrc_.assign(static_cast<std::size_t>(P_cap * ldc_), kNaN);
    for (std::int64_t g = 0; g < P_; ++g)
      for (std::int64_t k = 0; k < wcn; ++k) csrc_[g * ldc_ + k] = nd(rng);
    gsrc_ = quantize(gsrc_, wc.dt), csrc_ = quantize(csrc_, wc.dt);
    dg_ = std::make_unique<DeviceBuffer>(encode(gsrc_, wc.dt));
    dc_ = std::make_unique<DeviceBuffer>(encode(csrc_, wc.dt));
    std::vector<unsigned char> off_b(offsets_.size() * 4), gat_b(gather_.size() * 4 + 4);
    std::memcpy(off_b.data(), offsets_.data(), off_b.size());
    if (!gather_.empty()) std::memcpy(gat_b.data(), gather_.data(), gather_.size() * 4);
    doff_ = std::make_unique<DeviceBuffer>(off_b);
    dgat_ = std::make_unique<DeviceBuffer>(gat_b);
    // Output: (E, M + pad, N + pad). Overwrite: every byte 0xFF (NaN) beforehand, so an element left unwritten
    // shows. Accumulate: random values, quantized to the output dtype.
    rows_e_ = wc.M + wc.pad, ld_out_ = wc.N + wc.pad;
    const std::size_t count = static_cast<std::size_t>(E_ * rows_e_ * ld_out_);
    if (wc.accumulate) {
      std::vector<double> pre(count);
      for (auto& v : pre) v = nd(rng);
      prefill_ = encode(pre, wc.out_dt);
    } else {
      prefill_.assign(count * dtype_size(wc.out_dt), 0xFF);
    }
    // The elements the GEMM writes (through the row map) and their expert.
    for (std::int64_t e = 0; e < E_; ++e)
      for (std::int64_t m = 0; m < wc.M; ++m) {
        const std::int64_t row = wc.glu_n > 0 ? (m % 2) * wc.glu_n + m / 2 : m;
        for (std::int64_t n = 0; n < wc.N; ++n)
          region_.push_back(static_cast<std::size_t>((e * rows_e_ + row) * ld_out_ + n));
      }
  }

  std::int64_t experts() const { return E_; }
  const WgradCase& config() const { return c_; }

  /// `contiguous_tma`: tell the kernel the contiguous buffer's rows, so that its whole k-blocks come by TMA (the
  /// layer's way); false: every block by cp.async (a caller that does not know them).
  VarlenKArgs args(void* out, bool contiguous_tma = true) const {
    VarlenKArgs a;
    a.contiguous_rows = contiguous_tma ? P_cap_ : 0;
    a.dt = c_.dt;
    a.E = E_, a.M = c_.M, a.N = c_.N;
    a.expert_offsets = static_cast<const std::int32_t*>(doff_->get());
    const auto* gather = static_cast<const std::int32_t*>(dgat_->get());
    if (c_.dw1) {
      a.a = dc_->get(), a.lda = ldc_;
      a.b = dg_->get(), a.ldb = ldg_, a.b_gather = gather;
    } else {
      a.a = dg_->get(), a.lda = ldg_, a.a_gather = gather;
      a.b = dc_->get(), a.ldb = ldc_;
    }
    a.out = out, a.out_expert_stride = rows_e_ * ld_out_, a.ld_out = ld_out_, a.glu_concat_n = c_.glu_n;
    a.out_dt = c_.out_dt, a.accumulate = c_.accumulate;
    return a;
  }

  /// Runs the GEMM on a fresh, pre-filled output and returns its bytes.
  std::vector<unsigned char> run(Path path, bool* canary = nullptr, bool contiguous_tma = true) const {
    DeviceBuffer out(prefill_);
    const VarlenKArgs a = args(out.get(), contiguous_tma);
    const std::string tile = g_tile_n > 0 ? std::to_string(g_tile_n) : std::string("(heuristic)");
    progress(std::string(c_.dw1 ? "dW1" : "dW2") +
             (path == Path::kHopper ? " on the Hopper kernel, tile N " + tile : std::string(" on the reference GEMM")) +
             ": E " + std::to_string(E_) + ", M " + std::to_string(c_.M) + ", N " + std::to_string(c_.N) + ", rows " +
             std::to_string(P_) + ", out " + dtype_name(c_.out_dt) + (c_.accumulate ? ", accumulate" : "") +
             (c_.glu_n > 0 ? ", concatenated row map" : ""));
    if (path == Path::kHopper) {
      EXPECT_EQ(gpu::hopper_wgrad_unsupported_reason(a), "") << "the case must take the Hopper kernel";
      gpu::launch_weight_gemm(a, "test/weight_grad", nullptr);
    } else {
      gpu::launch_varlen_k_gemm(a, nullptr);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    if (canary) *canary = out.canary_intact();
    return out.download();
  }

  /// float64 expectation of the written elements (region order): prefill (accumulating) + sum over the segment.
  const std::vector<double>& expected() const {
    if (!expected_.empty() || region_.empty()) return expected_;
    const std::vector<double> pre = decode(prefill_.data(), prefill_.size() / dtype_size(c_.out_dt), c_.out_dt);
    expected_.resize(region_.size());
    std::vector<double> acc(static_cast<std::size_t>(c_.M * c_.N));
    std::size_t r = 0;
    for (std::int64_t e = 0; e < E_; ++e) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t g = offsets_[e]; g < offsets_[e + 1]; ++g) {
        const double* grow = &gsrc_[static_cast<std::size_t>(gather_[g] * ldg_)];
        const double* crow = &csrc_[static_cast<std::size_t>(g * ldc_)];
        const double* arow = c_.dw1 ? crow : grow;
        const double* brow = c_.dw1 ? grow : crow;
        for (std::int64_t m = 0; m < c_.M; ++m) {
          const double am = arow[m];
          double* out = &acc[static_cast<std::size_t>(m * c_.N)];
          for (std::int64_t n = 0; n < c_.N; ++n) out[n] += am * brow[n];
        }
      }
      for (std::int64_t i = 0; i < c_.M * c_.N; ++i, ++r)
        expected_[r] = acc[static_cast<std::size_t>(i)] + (c_.accumulate ? pre[region_[r]] : 0.0);
    }
    return expected_;
  }

  /// The written elements of `raw`, decoded, in region order.
  std::vector<double> region_values(const std::vector<unsigned char>& raw) const {
    const std::vector<double> all = decode(raw.data(), raw.size() / dtype_size(c_.out_dt), c_.out_dt);
    std::vector<double> v(region_.size());
    for (std::size_t i = 0; i < region_.size(); ++i) v[i] = all[region_[i]];
    return v;
  }

  /// Every byte outside the written elements still holds the prefill.
  bool outside_untouched(const std::vector<unsigned char>& raw) const {
    const std::size_t sz = dtype_size(c_.out_dt);
    std::vector<char> written(prefill_.size() / sz, 0);
    for (std::size_t i : region_) written[i] = 1;
    for (std::size_t i = 0; i < written.size(); ++i)
      if (!written[i] && std::memcmp(raw.data() + i * sz, prefill_.data() + i * sz, sz) != 0) return false;
    return true;
  }

  /// Experts without rows: exact +0 bytes (overwrite) or the prefill's bytes (accumulate) in all their elements.
  bool empty_experts_exact(const std::vector<unsigned char>& raw) const {
    const std::size_t sz = dtype_size(c_.out_dt);
    const std::size_t per_expert = static_cast<std::size_t>(c_.M * c_.N);
    for (std::int64_t e = 0; e < E_; ++e) {
      if (c_.lengths[e] != 0) continue;
      for (std::size_t i = e * per_expert; i < (e + 1) * per_expert; ++i) {
        const unsigned char* got = raw.data() + region_[i] * sz;
        if (c_.accumulate) {
          if (std::memcmp(got, prefill_.data() + region_[i] * sz, sz) != 0) return false;
        } else {
          for (std::size_t b = 0; b < sz; ++b)
            if (got[b] != 0) return false;
        }
      }
    }
    return true;
  }

 private:
  WgradCase c_;
  std::int64_t E_ = 0, P_ = 0, P_cap_ = 0, ldg_ = 0, ldc_ = 0, rows_e_ = 0, ld_out_ = 0;
  std::vector<std::int32_t> offsets_, gather_;
  std::vector<double> gsrc_, csrc_;
  std::unique_ptr<DeviceBuffer> dg_, dc_, doff_, dgat_;
  std::vector<unsigned char> prefill_;
  std::vector<std::size_t> region_;
  mutable std::vector<double> expected_;
};

double tolerance(DType out_dt) { return out_dt == DType::kFP32 ? 1e-4 : 4e-3; }

/// The full check of one problem on the Hopper kernel: float64, the reference GEMM, untouched bytes, exact zeros
/// of empty experts, no NaN, canary, bitwise rerun, and bitwise the same without the contiguous operand's TMA.
void check_problem(const WgradProblem& prob) {
  const WgradCase& wc = prob.config();
  bool canary = false;
  const std::vector<unsigned char> fast = prob.run(Path::kHopper, &canary);
  EXPECT_TRUE(canary) << "the output's canary was overwritten";
  const std::vector<double> got = prob.region_values(fast);
  for (double v : got) ASSERT_FALSE(std::isnan(v)) << "an output element is NaN (unwritten, or a NaN row leaked)";
  EXPECT_LT(rel_error(got, prob.expected()), tolerance(wc.out_dt)) << "against float64";
  const std::vector<unsigned char> ref = prob.run(Path::kReference);
  EXPECT_LT(rel_error(got, prob.region_values(ref)), tolerance(wc.out_dt)) << "against the reference GEMM";
  EXPECT_TRUE(prob.outside_untouched(fast)) << "bytes outside the gradient's elements were written";
  EXPECT_TRUE(prob.empty_experts_exact(fast)) << "an expert without rows is not exact zeros / untouched";
  EXPECT_TRUE(prob.empty_experts_exact(ref)) << "the reference: an expert without rows";
  EXPECT_TRUE(prob.run(Path::kHopper) == fast) << "a rerun is not bitwise identical";
  // The contiguous operand by cp.async throughout (no tensor map) feeds the tensor cores the same values.
  EXPECT_TRUE(prob.run(Path::kHopper, nullptr, /*contiguous_tma=*/false) == fast)
      << "TMA-fed and cp.async-fed contiguous operand differ";
}

/// Runs `body` with the N tile forced to 128 (ping-pong) and 256 (cooperative): every N takes both (edge tiles).
template <class F>
void for_each_tile(std::int64_t /*N*/, F&& body) {
  for (int tile : {128, 256}) {
    SCOPED_TRACE("tile N " + std::to_string(tile));
    gpu::set_hopper_tile_n(tile);
    g_tile_n = tile;
    body();
  }
  gpu::set_hopper_tile_n(0);
  g_tile_n = 0;
}

class HopperWeightGrad : public testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    gpu::set_hopper_kernels_enabled(true);
    gpu::set_hopper_backward_enabled(true);
  }
};

// Segments: empty experts, 1 row, around one k-block (63, 64, 65), several blocks and a partial one.
const std::vector<int> kEdgeLengths = {0, 1, 63, 64, 65, 0, 127, 300, 1000, 2};

TEST_F(HopperWeightGrad, Dw2ShapeMatchesFloat64AndTheReferenceGemm) {
  for (DType out_dt : {DType::kBF16, DType::kFP32}) {
    SCOPED_TRACE(std::string("out ") + dtype_name(out_dt));
    WgradCase wc;
    wc.M = 512, wc.N = 256, wc.T = 1500, wc.lengths = kEdgeLengths, wc.out_dt = out_dt;
    const WgradProblem prob(wc, 1);
    for_each_tile(wc.N, [&] { check_problem(prob); });
  }
}

TEST_F(HopperWeightGrad, Dw1ShapeInterleavedAndConcatenated) {
  for (bool concat : {false, true})
    for (DType out_dt : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(std::string(concat ? "concatenated" : "interleaved") + ", out " + dtype_name(out_dt));
      WgradCase wc;
      wc.dw1 = true, wc.M = 512, wc.N = 768, wc.T = 1500, wc.lengths = kEdgeLengths, wc.out_dt = out_dt;
      wc.glu_n = concat ? 256 : 0;
      const WgradProblem prob(wc, 2);
      for_each_tile(wc.N, [&] { check_problem(prob); });
    }
}

TEST_F(HopperWeightGrad, AccumulateIntoFp32AndBf16) {
  for (bool dw1 : {false, true})
    for (DType out_dt : {DType::kFP32, DType::kBF16}) {
      SCOPED_TRACE(std::string(dw1 ? "dW1" : "dW2") + ", out " + dtype_name(out_dt));
      WgradCase wc;
      wc.dw1 = dw1, wc.M = 256, wc.N = 512, wc.T = 1200, wc.lengths = kEdgeLengths, wc.out_dt = out_dt;
      wc.accumulate = true;
      wc.glu_n = dw1 ? 128 : 0;
      const WgradProblem prob(wc, 3);
      for_each_tile(wc.N, [&] { check_problem(prob); });
    }
}

TEST_F(HopperWeightGrad, ExpertsWithoutRowsWriteExactZerosOrStayUntouched) {
  // Mostly empty experts (zero pairs routed to them), among them a whole run of them and the last one.
  const std::vector<int> lengths = {0, 0, 70, 0, 0, 0, 1, 0, 0, 0, 0, 0};
  for (bool accumulate : {false, true})
    for (DType out_dt : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(std::string(accumulate ? "accumulate" : "overwrite") + ", out " + dtype_name(out_dt));
      WgradCase wc;
      wc.M = 256, wc.N = 256, wc.T = 100, wc.lengths = lengths, wc.out_dt = out_dt, wc.accumulate = accumulate;
      const WgradProblem prob(wc, 4);
      for_each_tile(wc.N, [&] { check_problem(prob); });
    }
  // No rows at all: every expert.
  WgradCase wc;
  wc.M = 128, wc.N = 256, wc.T = 10, wc.lengths = std::vector<int>(20, 0);
  const WgradProblem prob(wc, 5);
  for_each_tile(wc.N, [&] { check_problem(prob); });
}

TEST_F(HopperWeightGrad, TinyAndHugeSegments) {
  // One expert holds most rows (80 k-blocks), the others 1 row or a few.
  const std::vector<int> lengths = {1, 5100, 1, 0, 3, 1, 17, 1};
  for (bool dw1 : {false, true}) {
    SCOPED_TRACE(dw1 ? "dW1" : "dW2");
    WgradCase wc;
    wc.dw1 = dw1, wc.M = 384, wc.N = 256, wc.T = 3000, wc.lengths = lengths, wc.out_dt = DType::kFP32;
    const WgradProblem prob(wc, 6);
    for_each_tile(wc.N, [&] { check_problem(prob); });
  }
}

TEST_F(HopperWeightGrad, StridedOperandsAndOutput) {
  for (bool dw1 : {false, true}) {
    SCOPED_TRACE(dw1 ? "dW1" : "dW2");
    WgradCase wc;
    wc.dw1 = dw1, wc.M = 256, wc.N = 256, wc.T = 700, wc.lengths = kEdgeLengths, wc.pad = 24;  // 16-byte multiples
    wc.accumulate = dw1;
    const WgradProblem prob(wc, 7);
    for_each_tile(wc.N, [&] { check_problem(prob); });
  }
}

TEST_F(HopperWeightGrad, NaNPastTheLastRoutedRowDoesNotLeak) {
  // The last expert ends 1 row into a k-block: 63 zero-filled rows of the block lie past the last routed row, where
  // the contiguous operand holds NaN (and 40 more rows after them).
  for (bool dw1 : {false, true}) {
    SCOPED_TRACE(dw1 ? "dW1" : "dW2");
    WgradCase wc;
    wc.dw1 = dw1, wc.M = 128, wc.N = 128, wc.T = 300, wc.lengths = {64, 129}, wc.out_dt = DType::kFP32;
    const WgradProblem prob(wc, 8);
    check_problem(prob);
  }
}

TEST_F(HopperWeightGrad, Realistic7BShapes) {
  // 7B (24576, 1536, 256, 128, 8) scaled down in rows: dW2 M = d = 1536, N = n = 256; dW1 M = 2n = 512, N = d.
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> len(0, 256);
  std::vector<int> lengths(32);
  for (int& f : lengths) f = len(rng);  // ~4000 rows over 32 experts
  lengths[5] = 0;
  for (bool dw1 : {false, true}) {
    SCOPED_TRACE(dw1 ? "dW1" : "dW2");
    WgradCase wc;
    wc.dw1 = dw1, wc.M = dw1 ? 512 : 1536, wc.N = dw1 ? 1536 : 256, wc.T = 4096, wc.lengths = lengths;
    wc.glu_n = dw1 ? 256 : 0;
    const WgradProblem prob(wc, 10);
    for_each_tile(wc.N, [&] { check_problem(prob); });
  }
}

TEST_F(HopperWeightGrad, HeuristicTileMatchesBothForcedTiles) {
  // Whatever the tile, the same sums in the same k order per output element: fp32 results agree closely; the
  // heuristic's choice is one of the two.
  WgradCase wc;
  wc.M = 1536, wc.N = 256, wc.T = 2000, wc.lengths = std::vector<int>(16, 150), wc.out_dt = DType::kFP32;
  const WgradProblem prob(wc, 11);
  gpu::set_hopper_tile_n(0);
  const std::vector<double> heuristic = prob.region_values(prob.run(Path::kHopper));
  EXPECT_LT(rel_error(heuristic, prob.expected()), 1e-4);
  for_each_tile(wc.N, [&] { EXPECT_LT(rel_error(prob.region_values(prob.run(Path::kHopper)), heuristic), 1e-5); });
}

// ---- edge tiles: M and N any multiple of 8 -------------------------------------------------------------------------

// M and N that are not tile multiples (the last m- and n-tiles hang past them): columns past M or N are zero-filled
// on the way in and never stored. pad > 0 puts NaN guard columns after every operand row (a copy that read past M
// or N would bring NaN into a stored element) and prefilled guard columns and rows around every expert's output
// (outside_untouched: nothing is written past the valid extents, e.g. a padded row of the concatenated row map
// landing on a valid one).
TEST_F(HopperWeightGrad, EdgeTilesAlongMAndN) {
  struct Shape {
    bool dw1;
    std::int64_t M, N, glu_n, pad;
    const char* name;
  };
  const std::vector<Shape> shapes = {
      {false, 200, 72, 0, 8, "dW2_d200_n72"},
      {false, 136, 264, 0, 24, "dW2_d136_n264"},
      {false, 8, 8, 0, 8, "dW2_d8_n8"},
      {true, 144, 200, 0, 8, "dW1_n72_d200_interleaved"},
      {true, 144, 200, 72, 8, "dW1_n72_d200_concatenated"},
      {true, 528, 136, 264, 16, "dW1_n264_d136_concatenated"},
      {true, 16, 8, 8, 8, "dW1_n8_d8_concatenated"},
  };
  for (const Shape& sh : shapes)
    for (DType out_dt : {DType::kBF16, DType::kFP32})
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(std::string(sh.name) + ", out " + dtype_name(out_dt) + (accumulate ? ", accumulate" : ""));
        WgradCase wc;
        wc.dw1 = sh.dw1, wc.M = sh.M, wc.N = sh.N, wc.glu_n = sh.glu_n, wc.pad = sh.pad;
        // A fresh copy moved in: copy-assigning into the empty vector here sets off GCC 12's -Wnonnull (a false
        // positive inside std::copy).
        wc.T = 900, wc.lengths = std::vector<int>(kEdgeLengths), wc.out_dt = out_dt, wc.accumulate = accumulate;
        const WgradProblem prob(wc, 12);
        for_each_tile(wc.N, [&] { check_problem(prob); });
      }
}

TEST_F(HopperWeightGrad, GptOssShapesFewTokens) {
  // gpt-oss (d = n = 2880): dW2 M = d, N = n; dW1 M = 2n (concatenated), N = d. 45 x 64 columns: edge tiles of
  // 64 columns (128-wide tiles) or 192 (256-wide); few rows so that the float64 check stays quick.
  const std::vector<int> lengths = {0, 1, 37, 0, 130};
  for (bool dw1 : {false, true}) {
    SCOPED_TRACE(dw1 ? "dW1" : "dW2");
    WgradCase wc;
    wc.dw1 = dw1, wc.M = dw1 ? 5760 : 2880, wc.N = 2880, wc.T = 300, wc.lengths = lengths;
    wc.glu_n = dw1 ? 2880 : 0, wc.pad = 8, wc.out_dt = DType::kFP32;
    const WgradProblem prob(wc, 13);
    for_each_tile(wc.N, [&] { check_problem(prob); });
  }
}

// The gpt-oss test split into its factors at small cost: M = 2880 or N = 2880 (an edge tile of 64 valid columns)
// against a small other extent, and many tiles per CTA with edge tiles among them (EdgeTilesAlongMAndN gives every
// CTA one tile at most), on both tiles. 320 = 2 x 128 + 64 = 256 + 64 repeats gpt-oss's edge (64 valid columns).
TEST_F(HopperWeightGrad, GptOssFactorsAndManyTilesPerCta) {
  std::vector<int> many;
  for (int e = 0; e < 40; ++e) many.push_back(e % 7 == 3 ? 0 : 1 + (e * 53) % 200);
  struct Shape {
    bool dw1;
    std::int64_t M, N, glu_n;
    std::vector<int> lengths;
    const char* name;
  };
  const std::vector<Shape> shapes = {
      {false, 2880, 320, 0, {0, 1, 37, 0, 130}, "dW2_M2880_N320"},
      {false, 320, 2880, 0, {0, 1, 37, 0, 130}, "dW2_M320_N2880"},
      {true, 640, 2880, 320, {0, 1, 37, 0, 130}, "dW1_M640_N2880_concatenated"},
      {false, 320, 320, 0, many, "dW2_M320_N320_40_experts"},
      {true, 640, 320, 320, many, "dW1_M640_N320_concatenated_40_experts"},
  };
  // fp32 output by the register path; bf16 by TMA stores (a CTA's many tiles take turns in its staging halves).
  for (const Shape& sh : shapes)
    for (DType out_dt : {DType::kFP32, DType::kBF16}) {
      SCOPED_TRACE(std::string(sh.name) + ", out " + dtype_name(out_dt));
      WgradCase wc;
      wc.dw1 = sh.dw1, wc.M = sh.M, wc.N = sh.N, wc.glu_n = sh.glu_n, wc.pad = 8, wc.T = 900;
      wc.lengths = sh.lengths, wc.out_dt = out_dt;
      const WgradProblem prob(wc, 14);
      for_each_tile(wc.N, [&] { check_problem(prob); });
    }
}

// ---- dispatch ---------------------------------------------------------------------------------------------------

// Groups of m-tiles (a CTA takes m_group m-tiles of one expert and n-tile back to back) and B kept on the ring:
// where an expert's k-blocks divide the ring's stages (4 on the wide tile, 5 on the square one), a group's later tiles
// load only A. Segments of 1, 2, 4 and 5 k-blocks, whole and partial, among others and empty experts; 8 m-tiles (the
// last an edge tile) so that every forced group divides them or falls to a divisor (3 -> 2). Every group must give
// the bytes of no group, and the full check (float64, reference, untouched bytes, reruns). Without groups the
// cooperative tile's bf16 epilogue stages into the tile's last ring stage (one round), with groups it does not (four
// rounds): the bf16 cases also hold those two epilogues to the same bytes.
TEST_F(HopperWeightGrad, GroupsOfMTilesKeepBOnTheRingBitwise) {
  const std::vector<int> lengths = {256, 200, 0, 128, 100, 64, 1, 320, 300, 256, 0, 130, 193, 257, 40, 256};
  for (bool dw1 : {false, true})
    for (DType out_dt : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(std::string(dw1 ? "dW1" : "dW2") + ", out " + dtype_name(out_dt));
      WgradCase wc;
      wc.dw1 = dw1, wc.M = 1000, wc.N = dw1 ? 520 : 264, wc.T = 1200, wc.lengths = lengths, wc.out_dt = out_dt;
      wc.glu_n = dw1 ? 500 : 0, wc.pad = 8;
      const WgradProblem prob(wc, 15);
      for_each_tile(wc.N, [&] {
        gpu::set_hopper_wgrad_m_group(1);
        const std::vector<unsigned char> ungrouped = prob.run(Path::kHopper);
        for (int group : {2, 3, 4, 8}) {
          SCOPED_TRACE("m-tile group " + std::to_string(group));
          gpu::set_hopper_wgrad_m_group(group);
          EXPECT_TRUE(prob.run(Path::kHopper) == ungrouped) << "not bitwise the result without groups";
          EXPECT_TRUE(prob.run(Path::kHopper, nullptr, /*contiguous_tma=*/false) == ungrouped)
              << "the contiguous operand by cp.async: not bitwise the result without groups";
        }
        check_problem(prob);  // with the last group (8)
      });
      gpu::set_hopper_wgrad_m_group(0);
    }
}

// The cooperative tile's bf16 epilogue in one round, half of it staged in the tile's last ring stage (taken without
// groups of m-tiles), where the last n-tile has more than 128 and fewer than 256 valid columns: both warpgroups pass
// the barrier that guards the borrowed stage, and the last block is clipped (N = 200: 8 of its 64 columns) or absent
// (N = 400: 144 valid). Against float64 (check_problem), and bitwise against the four-round epilogue that groups of
// two m-tiles take. (The other tests' edge tiles leave 8, 64 or 68 columns, or run in groups.)
TEST_F(HopperWeightGrad, BorrowedStageOnEdgeTilesOfMoreThanHalfATile) {
  const std::vector<int> lengths = {300, 0, 1000, 65, 200, 1};
  gpu::set_hopper_tile_n(256);  // the cooperative tile: the only one that borrows
  g_tile_n = 256;
  for (bool dw1 : {false, true})
    for (std::int64_t N : {200, 400}) {
      SCOPED_TRACE(std::string(dw1 ? "dW1" : "dW2") + " N " + std::to_string(N));
      WgradCase wc;  // M = 200: two m-tiles, so that a forced group of two is not cut to one
      wc.dw1 = dw1, wc.M = 200, wc.N = N, wc.glu_n = dw1 ? 100 : 0, wc.pad = 8;
      // (A fresh copy moved in: GCC 12's -Wnonnull false positive, as in EdgeTilesAlongMAndN.)
      wc.T = 1200, wc.lengths = std::vector<int>(lengths), wc.out_dt = DType::kBF16;
      const WgradProblem prob(wc, 16);
      gpu::set_hopper_wgrad_m_group(2);
      const std::vector<unsigned char> four_rounds = prob.run(Path::kHopper);
      gpu::set_hopper_wgrad_m_group(1);
      EXPECT_TRUE(prob.run(Path::kHopper) == four_rounds) << "the borrowed stage's bytes differ from four rounds'";
      check_problem(prob);
    }
  gpu::set_hopper_wgrad_m_group(0);
  gpu::set_hopper_tile_n(0);
  g_tile_n = 0;
}

TEST(HopperWeightGradDispatch, NamesWhyAShapeFallsBack) {
  REQUIRE_GPU();
  gpu::set_hopper_kernels_enabled(true);
  gpu::set_hopper_backward_enabled(true);
  alignas(16) static std::int32_t dummy[64];  // never dereferenced: only the reason is asked for
  VarlenKArgs a;
  a.E = 4, a.M = 256, a.N = 256;
  a.expert_offsets = dummy;
  a.a = dummy, a.lda = 256, a.a_gather = dummy;
  a.b = dummy, a.ldb = 256;
  a.out = dummy, a.out_expert_stride = 256 * 256, a.ld_out = 256;
  EXPECT_EQ(gpu::hopper_wgrad_unsupported_reason(a), "");
  auto reason = [&](auto change) {
    VarlenKArgs b = a;
    change(b);
    return gpu::hopper_wgrad_unsupported_reason(b);
  };
  // Any multiple of 8 runs (edge tiles); what breaks 16-byte rows falls back.
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.M = 200; }), "");
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.N = 72; }), "");
  EXPECT_NE(reason([](VarlenKArgs& b) { b.M = 196; }).find("M = 196"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.N = 324; }).find("N = 324"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.dt = DType::kFP16; }).find("dtype fp16"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.out_dt = DType::kFP16; }).find("output dtype"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.lda = 260; }).find("A rows"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.ldb = 100; }).find("B rows"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.ld_out = 260; }).find("output rows"), std::string::npos);
  // The producer's row addresses take 32-bit byte strides: up to 2^30 - 8 elements.
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.lda = (std::int64_t{1} << 30) - 8, b.ldb = (std::int64_t{1} << 30) - 8; }),
            "");
  EXPECT_NE(reason([](VarlenKArgs& b) { b.lda = std::int64_t{1} << 30; }).find("row stride of 2^30"),
            std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.ldb = std::int64_t{3} << 40; }).find("row stride of 2^30"),
            std::string::npos);
  // The output's expert stride matters with several experts only (with one its tensor map takes M ld_out).
  EXPECT_NE(reason([](VarlenKArgs& b) { b.out_expert_stride = 256 * 256 + 4; }).find("output rows"),
            std::string::npos);
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.E = 1, b.out_expert_stride = 3; }), "");
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.E = 1, b.out_expert_stride = 0; }), "");
  EXPECT_NE(reason([](VarlenKArgs& b) { b.glu_concat_n = 64; }).find("M != 2n"), std::string::npos);
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.glu_concat_n = 128; }), "");
  EXPECT_NE(reason([](VarlenKArgs& b) { b.b_gather = dummy; }).find("both or neither"), std::string::npos);
  EXPECT_NE(reason([](VarlenKArgs& b) { b.a_gather = nullptr; }).find("both or neither"), std::string::npos);
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.a_gather = nullptr, b.b_gather = dummy; }), "");
  EXPECT_EQ(reason([](VarlenKArgs& b) { b.out_dt = DType::kFP32, b.accumulate = true; }), "");
  gpu::set_hopper_backward_enabled(false);
  EXPECT_NE(gpu::hopper_wgrad_unsupported_reason(a).find("MACHMOE_HOPPER_BACKWARD"), std::string::npos);
  gpu::set_hopper_backward_enabled(true);
  gpu::set_hopper_kernels_enabled(false);
  EXPECT_NE(gpu::hopper_wgrad_unsupported_reason(a).find("disabled"), std::string::npos);
  gpu::set_hopper_kernels_enabled(true);
}

// ---- the reference kernel's output dtype and accumulate mode -------------------------------------------------------

TEST(ReferenceWeightGrad, OutputDtypesAndAccumulateMatchFloat64) {
  REQUIRE_GPU();
  for (DType dt : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (DType out_dt : {dt, DType::kFP32})  // a weight gradient is of the data dtype or fp32
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(std::string("in ") + dtype_name(dt) + ", out " + dtype_name(out_dt) +
                     (accumulate ? ", accumulate" : ""));
        WgradCase wc;
        wc.dw1 = accumulate, wc.M = 96, wc.N = 80, wc.T = 200, wc.lengths = {0, 1, 65, 130, 0, 7};
        wc.dt = dt, wc.out_dt = out_dt, wc.accumulate = accumulate, wc.glu_n = accumulate ? 48 : 0;
        const WgradProblem prob(wc, 12);
        bool canary = false;
        const std::vector<unsigned char> ref = prob.run(Path::kReference, &canary);
        EXPECT_TRUE(canary);
        const double tol = out_dt == DType::kFP32 ? 1e-5 : 4e-3;
        EXPECT_LT(rel_error(prob.region_values(ref), prob.expected()), tol);
        EXPECT_TRUE(prob.outside_untouched(ref));
        EXPECT_TRUE(prob.empty_experts_exact(ref));
      }
}

}  // namespace
}  // namespace machmoe::test
