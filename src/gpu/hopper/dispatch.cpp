#include "gpu/hopper/dispatch.hpp"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <limits>
#include <mutex>
#include <map>
#include <set>
#include <utility>

#include "core/env.hpp"
#include "core/fallback.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/hopper/heuristics.hpp"
#include "gpu/hopper/kernel_families.hpp"
#include "machmoe/device.hpp"
#include "machmoe/fallback.hpp"
#include "machmoe/sm_margin.hpp"

namespace machmoe::gpu {
namespace {

std::atomic<int>& enabled_flag() {
  static std::atomic<int> flag{detail::env_switch("MACHMOE_DISABLE_HOPPER_KERNELS", false) ? 0 : 1};
  return flag;
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MACHMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || f == nullptr)
      throw RuntimeError("machmoe: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12 or newer)");
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

/// bf16 K-major tensor map with a 128-byte swizzle; dims[0] is K (contiguous). Strides in bytes.
CUtensorMap make_tensor_map(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box) {
  CUtensorMap map;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank),
                                    const_cast<void*>(base), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw RuntimeError("machmoe: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(static_cast<int>(r)));
  return map;
}

struct DeviceTraits {
  int major = 0, minor = 0, sm_count = 0;
  std::int64_t memory_gbps = 0;  // peak (cuda_memory_bandwidth_gbps; 0: not reported)
};

/// The current device's compute capability, SM count and memory bandwidth, queried once per device (every forward launch asks).
DeviceTraits current_device() {
  int dev = 0;
  MACHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, DeviceTraits> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find(dev);
  if (it != known.end()) return it->second;
  DeviceTraits t;
  MACHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.major, cudaDevAttrComputeCapabilityMajor, dev));
  MACHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.minor, cudaDevAttrComputeCapabilityMinor, dev));
  MACHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.sm_count, cudaDevAttrMultiProcessorCount, dev));
  t.memory_gbps = cuda_memory_bandwidth_gbps(dev);
  known.emplace(dev, t);
  return t;
}

/// The SMs the persistent grids may take: the device's less the SM margin (include/machmoe/sm_margin.hpp; the layer's
/// entry points refuse a margin that leaves fewer than two). The wgrad tile heuristic counts its tiles against it too.
int usable_sms(const DeviceTraits& dev) { return std::max(dev.sm_count - sm_margin(), 1); }

// The reasons that are a choice, not a limit: reported as notes, never an error (FallbackPolicy::kError).
constexpr const char* kDisabledReason = "Hopper kernels disabled (MACHMOE_DISABLE_HOPPER_KERNELS or the test switch)";
constexpr const char* kBackwardOffReason =
    "the Hopper backward kernels are switched off (MACHMOE_HOPPER_BACKWARD=0 or the test switch)";

/// Warns once per (stage, reason), or throws machmoe::Error under FallbackPolicy::kError (core/fallback.hpp).
void report_fallback(const char* stage, const std::string& shape, const std::string& reason) {
  detail::report_reference_fallback(stage, shape, reason, reason == kDisabledReason || reason == kBackwardOffReason);
}

using hopper::tiles_of;

// The override layer of the tile heuristics (hopper/heuristics.hpp): MACHMOE_HOPPER_TILE_N=128|256,
// MACHMOE_HOPPER_RASTER_M=g, MACHMOE_HOPPER_CLUSTER_M=1|2 (dX~) and MACHMOE_HOPPER_WGRAD_M_GROUP=g (weight gradients)
// from the environment, or set_hopper_tile_n, set_hopper_raster_m, set_hopper_cluster_m and
// set_hopper_wgrad_m_group (tests, tuning).
std::atomic<int>& forced_tile_n() {
  static std::atomic<int> v{detail::env_nonnegative_int("MACHMOE_HOPPER_TILE_N", 0)};
  return v;
}
std::atomic<int>& forced_raster_m() {
  static std::atomic<int> v{detail::env_nonnegative_int("MACHMOE_HOPPER_RASTER_M", 0)};
  return v;
}
std::atomic<int>& forced_cluster_m() {
  static std::atomic<int> v{detail::env_nonnegative_int("MACHMOE_HOPPER_CLUSTER_M", 0)};
  return v;
}
std::atomic<int>& forced_wgrad_m_group() {
  static std::atomic<int> v{detail::env_nonnegative_int("MACHMOE_HOPPER_WGRAD_M_GROUP", 0)};
  return v;
}
hopper::TileOverrides tile_overrides() {
  hopper::TileOverrides o;
  o.tile_n = forced_tile_n().load();
  o.raster_m = forced_raster_m().load();
  o.cluster_m = forced_cluster_m().load();
  o.wgrad_m_group = forced_wgrad_m_group().load();
  return o;
}

template <class Tile>
void launch_up(Activation act, const hopper::UpProjectionParams& p, int sms, cudaStream_t stream) {
  using hopper::launch_up_projection;
  switch (act) {
    case Activation::kSwiGLU: return launch_up_projection<Tile, Activation::kSwiGLU>(p, sms, stream);
    case Activation::kGeGLU: return launch_up_projection<Tile, Activation::kGeGLU>(p, sms, stream);
    case Activation::kReGLU: return launch_up_projection<Tile, Activation::kReGLU>(p, sms, stream);
    case Activation::kReLUSquared: return launch_up_projection<Tile, Activation::kReLUSquared>(p, sms, stream);
    case Activation::kReLU: return launch_up_projection<Tile, Activation::kReLU>(p, sms, stream);
    case Activation::kGELU: return launch_up_projection<Tile, Activation::kGELU>(p, sms, stream);
    case Activation::kSiLU: return launch_up_projection<Tile, Activation::kSiLU>(p, sms, stream);
    case Activation::kGptOssSwiGLU: return launch_up_projection<Tile, Activation::kGptOssSwiGLU>(p, sms, stream);
  }
}

template <class Tile>
void launch_dh(Activation act, const hopper::DhKernelParams& p, int sms, cudaStream_t stream) {
  using hopper::launch_dh_kernel;
  switch (act) {
    case Activation::kSwiGLU: return launch_dh_kernel<Tile, Activation::kSwiGLU>(p, sms, stream);
    case Activation::kGeGLU: return launch_dh_kernel<Tile, Activation::kGeGLU>(p, sms, stream);
    case Activation::kReGLU: return launch_dh_kernel<Tile, Activation::kReGLU>(p, sms, stream);
    case Activation::kReLUSquared: return launch_dh_kernel<Tile, Activation::kReLUSquared>(p, sms, stream);
    case Activation::kReLU: return launch_dh_kernel<Tile, Activation::kReLU>(p, sms, stream);
    case Activation::kGELU: return launch_dh_kernel<Tile, Activation::kGELU>(p, sms, stream);
    case Activation::kSiLU: return launch_dh_kernel<Tile, Activation::kSiLU>(p, sms, stream);
    case Activation::kGptOssSwiGLU: return launch_dh_kernel<Tile, Activation::kGptOssSwiGLU>(p, sms, stream);
  }
}

}  // namespace

void set_hopper_tile_n(int tile_n) { forced_tile_n().store(tile_n); }
void set_hopper_raster_m(int raster_m) { forced_raster_m().store(raster_m > 0 ? raster_m : 0); }
void set_hopper_cluster_m(int cluster_m) { forced_cluster_m().store(cluster_m > 0 ? cluster_m : 0); }
void set_hopper_wgrad_m_group(int m_group) { forced_wgrad_m_group().store(m_group > 0 ? m_group : 0); }

void set_hopper_kernels_enabled(bool enabled) { enabled_flag().store(enabled ? 1 : 0); }

namespace {
/// The backward's Hopper kernels (on by default; MACHMOE_HOPPER_BACKWARD=0 or set_hopper_backward_enabled(false)
/// sends the backward's GEMMs to the reference kernels, e.g. to compare the two paths).
std::atomic<int>& backward_flag() {
  static std::atomic<int> flag{detail::env_switch("MACHMOE_HOPPER_BACKWARD", true) ? 1 : 0};
  return flag;
}
}  // namespace
void set_hopper_backward_enabled(bool enabled) { backward_flag().store(enabled ? 1 : 0); }
bool hopper_backward_enabled() { return backward_flag().load() != 0; }
bool hopper_kernels_enabled() { return enabled_flag().load() != 0; }

namespace {

/// The concatenated GLU layout's distance from gate row j to up row j (elements of 2 bytes), a stride of the
/// weights' tensor maps: TMA takes positive multiples of 16 bytes below 2^40. Joined halves give n times the row
/// stride; halves that lie apart (torchtitan's w1 and w3, two allocations) give whatever lies between them.
bool glu_half_stride_fits_tma(std::int64_t half_stride) {
  return half_stride > 0 && half_stride % 8 == 0 && half_stride < (std::int64_t{1} << 39);
}
constexpr const char* kGluHalfStrideReason =
    "the concatenated layout's up half not a positive multiple of 16 bytes after its gate half (or 2^40 bytes or "
    "more after it)";

std::string unsupported_reason(const VarlenMArgs& a, const DeviceTraits& dev) {
  if (!hopper_kernels_enabled()) return kDisabledReason;
  if (a.dt != DType::kBF16) return std::string("dtype ") + dtype_name(a.dt) + " (the Hopper kernels are bf16)";
  if (dev.major != 9 || dev.minor != 0)
    return "compute capability " + std::to_string(dev.major) + "." + std::to_string(dev.minor) + " (needs 9.0)";
  // Any multiple of 8 along N and K (edge tiles, a zero-filled partial last k-block): heuristics.hpp.
  const std::string shape_reason = hopper::varlen_m_shape_unsupported_reason(
      a.N, a.K, a.epilogue == Epilogue::kUpActivation && is_glu(a.activation));
  if (!shape_reason.empty()) return shape_reason;
  if (a.N > (std::int64_t{1} << 30) || a.K > (std::int64_t{1} << 30)) return "N or K of 2^30 or more";
  if (a.E <= 0 || a.E > (1 << 30)) return "E out of range";
  if (a.P_max >= (std::int64_t{1} << 31) || a.a_rows >= (std::int64_t{1} << 31))
    return "more than 2^31 - 1 routed rows";
  if (a.a_row_shift != nullptr && a.a_gather != nullptr) return "a row shift with a gathered A";
  // The persistent schedulers number output tiles with int: every expert's partial last M-tile included, the count
  // is at most (P_max / 128 + E) M-tiles times the N-tiles of the narrowest tile.
  if ((a.P_max / 128 + a.E) * tiles_of(a.N, hopper::kMinTileN) >= (std::int64_t{1} << 31))
    return "more than 2^31 - 1 output tiles";
  const ExpertOperand& b = a.b;
  // K-major weights (stride 1 along K: the forward's W1 and W2) or MN-major (stride 1 along N: the backward reads
  // W1 for dX~ in place).
  const bool mn_major = b.stride_col == 1 && b.stride_k != 1;
  if (b.stride_k != 1 && !mn_major)
    return "weights neither K-major (stride 1 along K) nor MN-major (stride 1 along N)";
  const bool dh_kernel = a.epilogue == Epilogue::kActivationGrad;
  if (mn_major) {
    // The backward reads W1 (dX~) and W2 (dH) in place: dX~ has a contiguous A and no bias; dH gathers dO.
    const bool dx = a.epilogue == Epilogue::kStore && a.a_gather == nullptr && a.bias == nullptr;
    if (!dx && !dh_kernel) return "MN-major weights outside the backward's dX~ and dH GEMMs";
    if (!hopper_backward_enabled()) return kBackwardOffReason;
    if (b.permute == 1) return "MN-major weights permuted along N";
    if (b.permute == 2 && (dh_kernel || a.K != 2 * b.glu_n)) return "concatenated layout with K != 2n";
    if (!aligned16(b.ptr) || b.stride_k % 8 != 0 || b.expert_stride % 8 != 0)
      return "weight rows not 16-byte aligned";
    if (b.permute == 2 && !glu_half_stride_fits_tma(b.half_stride())) return kGluHalfStrideReason;
  } else {
    if (dh_kernel) return "dH GEMM with weights that are not MN-major (stride 1 along n)";
    if (b.permute == 2) return "weights permuted along K";
    if (b.permute == 1 && (a.epilogue != Epilogue::kUpActivation || !is_glu(a.activation)))
      return "concatenated layout outside a GLU up-projection";
    if (!aligned16(b.ptr) || b.stride_col % 8 != 0 || b.expert_stride % 8 != 0)
      return "weight rows not 16-byte aligned";
    if (b.permute == 1 && !glu_half_stride_fits_tma(b.half_stride())) return kGluHalfStrideReason;
  }
  if (!aligned16(a.a) || a.lda % 8 != 0) return "A rows not 16-byte aligned";
  if (a.out && (!aligned16(a.out) || a.ld_out % 8 != 0)) return "output rows not 16-byte aligned";
  if (dh_kernel) {
    if (a.a_gather == nullptr) return "dH GEMM without a gather index";
    if (a.out == nullptr || a.act_out == nullptr || a.h_in == nullptr || a.ds_partial == nullptr ||
        a.scores == nullptr || a.scatter == nullptr)
      return "dH GEMM without dH, A', H, scores, scatter or dS-partial buffers";
    if (!aligned16(a.act_out) || a.ld_act % 8 != 0) return "A' rows not 16-byte aligned";
    if (!aligned16(a.h_in) || a.ld_h % 8 != 0) return "H rows not 16-byte aligned";
  } else if (a.epilogue == Epilogue::kUpActivation) {
    if (a.act_out && (!aligned16(a.act_out) || a.ld_act % 8 != 0)) return "A-output rows not 16-byte aligned";
    if (a.act_out == nullptr && a.out == nullptr) return "nothing to store";
    if (a.a_gather == nullptr) return "up-projection without a gather index";
  } else {
    if (a.out == nullptr) return "nothing to store";
    if (a.a_gather != nullptr) return "down-projection with a gather index";
  }
  return "";
}

/// With one expert the weights' expert stride is never stepped, and a view may carry any value there (a broadcast
/// weight has 0, a slice of a larger tensor an odd one): one expert's span stands in for it, so that such a view
/// neither falls back for "weight rows not 16-byte aligned" nor hands a 0-byte stride to cuTensorMapEncodeTiled.
VarlenMArgs with_one_expert_stride(VarlenMArgs a) {
  if (a.E == 1) {
    const bool mn_major = a.b.stride_col == 1 && a.b.stride_k != 1;
    a.b.expert_stride = mn_major ? a.K * a.b.stride_k : a.N * a.b.stride_col;
  }
  return a;
}

}  // namespace

std::string hopper_unsupported_reason(const VarlenMArgs& args) {
  return unsupported_reason(with_one_expert_stride(args), current_device());
}

namespace {
/// The shape a fallback notice of a varlen-M GEMM names.
std::string expert_gemm_shape(const VarlenMArgs& a) {
  return "M = " + std::to_string(a.P_max) + " routed rows at most, N = " + std::to_string(a.N) +
         ", K = " + std::to_string(a.K) + ", " + std::to_string(a.E) + " experts";
}
}  // namespace

void refuse_expert_gemm_fallback(const VarlenMArgs& args, const char* stage) {
  if (fallback_policy() != FallbackPolicy::kError) return;
  const VarlenMArgs a = with_one_expert_stride(args);
  const std::string reason = unsupported_reason(a, current_device());
  if (!reason.empty()) report_fallback(stage, expert_gemm_shape(a), reason);  // throws (deliberate reasons: a note)
}

void launch_expert_gemm(const VarlenMArgs& args, const char* stage, cudaStream_t stream) {
  const VarlenMArgs a = with_one_expert_stride(args);
  const DeviceTraits dev = current_device();
  const std::string reason = unsupported_reason(a, dev);
  if (!reason.empty()) {
    report_fallback(stage, expert_gemm_shape(a), reason);
    launch_varlen_m_gemm(a, stream);
    return;
  }
  if (a.P_max == 0) return;  // no routed rows: nothing to write
  const bool up = a.epilogue == Epilogue::kUpActivation;
  const bool dh_kernel = a.epilogue == Epilogue::kActivationGrad;
  const bool mn_major = a.b.stride_col == 1 && a.b.stride_k != 1;  // the backward's dX~ and dH (unsupported_reason)
  hopper::GemmShape shape;
  shape.family = up          ? hopper::KernelFamily::kUpProjection
                 : dh_kernel ? hopper::KernelFamily::kDhKernel
                 : mn_major  ? hopper::KernelFamily::kDxExpanded
                             : hopper::KernelFamily::kDownProjection;
  shape.N = a.N, shape.K = a.K;
  shape.rows_per_expert = a.E > 0 ? a.P_max / a.E : 0;
  shape.memory_gbps = dev.memory_gbps;
  const hopper::TileChoice tiles = hopper::choose_tiles(shape, tile_overrides());

  hopper::VarlenMSchedulerParams sched;
  sched.E = static_cast<int>(a.E);
  sched.n_tiles = static_cast<int>(tiles_of(a.N, tiles.tile_n));  // the last may be an edge tile
  sched.raster_m = tiles.raster_m;
  sched.expert_offsets = a.expert_offsets;

  hopper::MainloopVarlenMParams main;
  main.K = static_cast<int>(a.K);
  main.a = a.a, main.lda = a.lda, main.gather = a.a_gather, main.a_row_shift = a.a_row_shift;
  const ExpertOperand& b = a.b;
  if (mn_major) {
    // (N, half, j, E) with k = 2 j + half: interleaved rows k = 2j, 2j + 1 or, concatenated (permute along K),
    // gate row j and up row j of the up half (n rows on where the halves are joined, anywhere after the gate half
    // where they lie apart). Box (64, 2, 32, 1): one 64-column block of all 64 k of a stage.
    const std::int64_t half_stride = b.permute == 2 ? b.half_stride() : b.stride_k;
    const std::int64_t j_stride = b.permute == 2 ? b.stride_k : 2 * b.stride_k;
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(a.N), 2, static_cast<cuuint64_t>(a.K / 2),
                                static_cast<cuuint64_t>(a.E)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(half_stride) * 2, static_cast<cuuint64_t>(j_stride) * 2,
                                   static_cast<cuuint64_t>(b.expert_stride) * 2};
    const cuuint32_t box[4] = {64, 2, 32, 1};
    main.tma_b = make_tensor_map(b.ptr, 4, dims, strides, box);
  } else if (b.permute == 1) {
    // The concatenated layout: (K, j, half, E), gate row j at half 0 and up row j at half 1, wherever the up half
    // lies after the gate half. A tile's gate rows and up rows are two boxes (64, kTileN / 2, 1, 1).
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(a.K), static_cast<cuuint64_t>(b.glu_n), 2,
                                static_cast<cuuint64_t>(a.E)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(b.stride_col) * 2,
                                   static_cast<cuuint64_t>(b.half_stride()) * 2,
                                   static_cast<cuuint64_t>(b.expert_stride) * 2};
    const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(tiles.tile_n / 2), 1, 1};
    main.tma_b = make_tensor_map(b.ptr, 4, dims, strides, box);
  } else {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(a.K), static_cast<cuuint64_t>(a.N),
                                static_cast<cuuint64_t>(a.E)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(b.stride_col) * 2, static_cast<cuuint64_t>(b.expert_stride) * 2};
    const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(tiles.tile_n / 2), 1};
    main.tma_b = make_tensor_map(b.ptr, 3, dims, strides, box);
  }
  main.b_concatenated = b.permute == 1;
  main.glu_n = static_cast<int>(b.glu_n);

  // Output tensor maps for the epilogue's TMA stores: (columns, rows), box 64 x 64 (64 x box_rows: the dH epilogue's
  // warps each load and store their own kEpilogueWarpRows rows), 128-byte swizzle. The extent is the valid columns,
  // so a TMA store of an edge tile clips there (and the predicated stores test o.cols).
  auto output = [&](void* ptr, std::int64_t cols, std::int64_t ld, cuuint32_t box_rows = 64) {
    hopper::EpilogueOutput o;
    o.ptr = ptr, o.ld = ld, o.cols = cols;
    if (ptr != nullptr) {
      const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(a.P_max)};
      const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
      const cuuint32_t box[2] = {64, box_rows};
      o.tma = make_tensor_map(ptr, 2, dims, strides, box);
    }
    return o;
  };
  hopper::EpilogueBias bias;
  bias.ptr = a.bias, bias.ld = a.ld_bias;
  const int sms = usable_sms(dev);
  if (up) {
    hopper::UpProjectionParams p;
    p.mainloop = main, p.scheduler = sched;
    p.epilogue.h = output(a.out, a.N, a.ld_out);
    p.epilogue.a = output(a.act_out, is_glu(a.activation) ? a.N / 2 : a.N, a.ld_act);
    p.epilogue.bias = bias;
    p.epilogue.concatenated = main.b_concatenated;
    p.epilogue.glu_n = main.glu_n;
    p.epilogue.N = static_cast<int>(a.N);
    p.epilogue.act_alpha = a.act_alpha, p.epilogue.act_limit = a.act_limit;
    if (tiles.tile_n == 256)
      launch_up<hopper::Tile128x256CooperativeCluster2>(a.activation, p, sms, stream);
    else
      launch_up<hopper::Tile128x128PingPong>(a.activation, p, sms, stream);
  } else if (dh_kernel) {
    hopper::DhKernelParams p;
    p.mainloop = main, p.scheduler = sched;
    const std::int64_t dh_cols = is_glu(a.activation) ? 2 * a.N : a.N;
    constexpr cuuint32_t kWarpRows = hopper::kEpilogueWarpRows;  // EpilogueActivationGrad's rows a warp
    p.epilogue.dh = output(a.out, dh_cols, a.ld_out, kWarpRows);
    p.epilogue.a_prime = output(a.act_out, a.N, a.ld_act, kWarpRows);
    p.epilogue.tma_h = output(const_cast<void*>(a.h_in), dh_cols, a.ld_h, kWarpRows).tma;  // the staging buffer's layout
    p.epilogue.scores = a.scores, p.epilogue.scatter = a.scatter;
    p.epilogue.ds_partial = a.ds_partial;
    // The reference's layout: one per 64 columns of A, ceil(n / 64) per pair (launch_ds_reduce reads that many).
    p.epilogue.ds_tiles = static_cast<int>(tiles_of(a.N, kDsTileN));
    p.epilogue.N = static_cast<int>(a.N);
    p.epilogue.act_alpha = a.act_alpha, p.epilogue.act_limit = a.act_limit;
    if (tiles.tile_n == 256)
      launch_dh<hopper::Tile128x256CooperativeStagedH>(a.activation, p, sms, stream);
    else
      launch_dh<hopper::Tile128x128PingPong>(a.activation, p, sms, stream);
  } else {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(a.K), static_cast<cuuint64_t>(a.a_rows > 0 ? a.a_rows : a.P_max)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(a.lda) * 2};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(hopper::Tile128x128PingPong::kTileM)};
    main.tma_a = make_tensor_map(a.a, 2, dims, strides, box);
    hopper::DownProjectionParams p;
    p.mainloop = main, p.scheduler = sched;
    p.epilogue.out = output(a.out, a.N, a.ld_out);
    p.epilogue.bias = bias;
    p.epilogue.N = static_cast<int>(a.N);
    const bool pairs = tiles.cluster_m == 2;  // dX~ only (heuristics.hpp)
    if (mn_major && tiles.tile_n == 256 && pairs)
      hopper::launch_dx_expanded<hopper::Tile128x256CooperativeCluster2>(p, sms, stream);
    else if (mn_major && tiles.tile_n == 256)
      hopper::launch_dx_expanded<hopper::Tile128x256Cooperative>(p, sms, stream);
    else if (mn_major && pairs)
      hopper::launch_dx_expanded<hopper::Tile128x128PingPongCluster2>(p, sms, stream);
    else if (mn_major)
      hopper::launch_dx_expanded<hopper::Tile128x128PingPong>(p, sms, stream);
    else if (tiles.tile_n == 256)
      hopper::launch_down_projection<hopper::Tile128x256Cooperative>(p, sms, stream);
    else
      hopper::launch_down_projection<hopper::Tile128x128PingPong>(p, sms, stream);
  }
}

// ---- weight gradients (varlen-K) ----------------------------------------------------------------------------------

namespace {

constexpr std::int64_t kMaxWgradRowStride = std::int64_t{1} << 30;  // elements, exclusive

std::string wgrad_unsupported_reason(const VarlenKArgs& a, const DeviceTraits& dev) {
  if (!hopper_kernels_enabled()) return kDisabledReason;
  if (!hopper_backward_enabled()) return kBackwardOffReason;
  if (a.dt != DType::kBF16) return std::string("dtype ") + dtype_name(a.dt) + " (the Hopper kernels are bf16)";
  if (a.out_dt != DType::kBF16 && a.out_dt != DType::kFP32)
    return std::string("output dtype ") + dtype_name(a.out_dt) + " (the Hopper weight gradients are bf16 or fp32)";
  if (dev.major != 9 || dev.minor != 0)
    return "compute capability " + std::to_string(dev.major) + "." + std::to_string(dev.minor) + " (needs 9.0)";
  // Any multiple of 8 along M and N (edge tiles: zero-filled loads, clipped stores): heuristics.hpp.
  const std::string shape_reason = hopper::wgrad_shape_unsupported_reason(a.M, a.N);
  if (!shape_reason.empty()) return shape_reason;
  if (a.M > (std::int64_t{1} << 30) || a.N > (std::int64_t{1} << 30)) return "M or N of 2^30 or more";
  if (a.E <= 0 || a.E * tiles_of(a.M, 128) * tiles_of(a.N, 128) >= (std::int64_t{1} << 31)) return "E out of range";
  if (a.expert_offsets == nullptr || a.out == nullptr) return "no expert offsets or no output";
  // The two families instantiated: dW2 (A gathered, B contiguous) and dW1 (A contiguous, B gathered). The other
  // combinations are one table line each (generate_instantiations.py) when something needs them.
  if ((a.a_gather != nullptr) == (a.b_gather != nullptr))
    return "gather on both or neither operand (no such Hopper kernel instantiated)";
  if (!aligned16(a.a) || a.lda % 8 != 0) return "A rows not 16-byte aligned";
  if (!aligned16(a.b) || a.ldb % 8 != 0) return "B rows not 16-byte aligned";
  // The producer's row addresses take 32-bit byte strides (mainloop_varlen_k.cuh, copy_rows_whole).
  if (a.lda >= kMaxWgradRowStride || a.ldb >= kMaxWgradRowStride)
    return "an operand's row stride of 2^30 elements or more";
  // (With one expert the output's expert stride is never stepped: its tensor map takes M ld_out instead.)
  if (!aligned16(a.out) || a.ld_out % 8 != 0 || (a.E > 1 && a.out_expert_stride % 8 != 0))
    return "output rows not 16-byte aligned";
  if (a.glu_concat_n < 0 || (a.glu_concat_n > 0 && a.M != 2 * a.glu_concat_n))
    return "concatenated row map with M != 2n";
  if (a.glu_concat_n > 0 && (a.half_stride() <= 0 || a.half_stride() % 8 != 0))
    return "the concatenated layout's up half not a positive multiple of 16 bytes after its gate half";
  return "";
}

}  // namespace

std::string hopper_wgrad_unsupported_reason(const VarlenKArgs& a) {
  return wgrad_unsupported_reason(a, current_device());
}

namespace {
/// The shape a fallback notice of a weight-gradient GEMM names.
std::string weight_gemm_shape(const VarlenKArgs& a) {
  return "M = " + std::to_string(a.M) + ", N = " + std::to_string(a.N) + " per expert, " + std::to_string(a.E) +
         " experts";
}
}  // namespace

void refuse_weight_gemm_fallback(const VarlenKArgs& a, const char* stage) {
  if (fallback_policy() != FallbackPolicy::kError || a.E == 0 || a.M == 0 || a.N == 0) return;
  const std::string reason = wgrad_unsupported_reason(a, current_device());
  if (!reason.empty()) report_fallback(stage, weight_gemm_shape(a), reason);
}

void launch_weight_gemm(const VarlenKArgs& a, const char* stage, cudaStream_t stream) {
  if (a.E == 0 || a.M == 0 || a.N == 0) return;  // nothing to write
  const DeviceTraits dev = current_device();
  const std::string reason = wgrad_unsupported_reason(a, dev);
  if (!reason.empty()) {
    report_fallback(stage, weight_gemm_shape(a), reason);
    launch_varlen_k_gemm(a, stream);
    return;
  }
  const int sms = usable_sms(dev);  // read once: the tile choice and the grid count the same SMs
  hopper::WgradShape shape;
  shape.E = a.E, shape.M = a.M, shape.N = a.N, shape.sm_count = sms;
  shape.rows_per_expert = a.contiguous_rows / a.E;  // the rows reserved (0: unknown)
  const hopper::TileChoice tiles = hopper::choose_wgrad_tiles(shape, tile_overrides());

  hopper::WeightGradParams p;
  p.scheduler.E = static_cast<int>(a.E);
  p.scheduler.m_tiles = static_cast<int>(tiles_of(a.M, 128));  // the last m- and n-tiles may be edge tiles
  p.scheduler.n_tiles = static_cast<int>(tiles_of(a.N, tiles.tile_n));
  // The scheduler's units are whole groups: the largest divisor of the m-tile count up to the heuristic's group.
  p.scheduler.m_group = 1;
  for (int g = std::min(tiles.wgrad_m_group, p.scheduler.m_tiles); g > 1; --g)
    if (p.scheduler.m_tiles % g == 0) {
      p.scheduler.m_group = g;
      break;
    }
  p.scheduler.expert_offsets = a.expert_offsets;
  p.mainloop.M = static_cast<int>(a.M), p.mainloop.N = static_cast<int>(a.N);
  p.mainloop.a = a.a, p.mainloop.lda = a.lda, p.mainloop.a_gather = a.a_gather;
  p.mainloop.b = a.b, p.mainloop.ldb = a.ldb, p.mainloop.b_gather = a.b_gather;
  // The contiguous operand (the one without a gather) by TMA where its buffer's row count is known and fits TMA's
  // 32-bit coordinates; otherwise its k-blocks are copied like the gathered operand's.
  // MACHMOE_WGRAD_TMA=0 keeps cp.async for it (bitwise the same results; for A/B timing of the two producers).
  static const bool tma_allowed = detail::env_switch("MACHMOE_WGRAD_TMA", true);
  if (tma_allowed && a.contiguous_rows > 0 && a.contiguous_rows <= std::numeric_limits<std::int32_t>::max()) {
    const bool a_contiguous = a.a_gather == nullptr;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(a_contiguous ? a.M : a.N),
                                static_cast<cuuint64_t>(a.contiguous_rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(a_contiguous ? a.lda : a.ldb) * 2};
    const cuuint32_t box[2] = {64, 64};  // (64 columns) x (one k-block of rows): one 8 KiB block of a stage
    p.mainloop.tma_contiguous = make_tensor_map(a_contiguous ? a.a : a.b, 2, dims, strides, box);
    p.mainloop.contiguous_tma = true;
  }
  p.epilogue.out = a.out;
  p.epilogue.out_expert_stride = a.out_expert_stride, p.epilogue.ld_out = a.ld_out;
  p.epilogue.glu_concat_n = a.glu_concat_n, p.epilogue.glu_half_stride = a.half_stride();
  p.epilogue.M = static_cast<int>(a.M), p.epilogue.N = static_cast<int>(a.N);
  p.epilogue.out_fp32 = a.out_dt == DType::kFP32;
  p.epilogue.accumulate = a.accumulate;
  // The bf16 overwrite leaves by TMA store: map (N, M, E) with the output's own strides, so the stores clip at each
  // expert's M rows and at N columns; with the concatenated row map (N, n, 2, E), clipped at n rows per half.
  // MACHMOE_WGRAD_TMA_STORE=0 keeps the register-to-global stores (bitwise the same results; for A/B timing).
  static const bool tma_store_allowed = detail::env_switch("MACHMOE_WGRAD_TMA_STORE", true);
  // (Rows that do not overlap, and strides within TMA's 2^40 bytes; one expert's stride is never used. The
  // concatenated layout's halves: each half's experts apart, as the whole's where the halves are joined; the public
  // entry points refuse halves that share memory, layer.cpp.)
  const bool concat = a.glu_concat_n > 0;
  const std::int64_t rows_per_half = concat ? a.glu_concat_n : a.M;
  const std::int64_t expert_stride = a.E == 1 ? a.M * a.ld_out : a.out_expert_stride;
  const bool halves_fit =
      !concat || (a.half_stride() >= rows_per_half * a.ld_out && glu_half_stride_fits_tma(a.half_stride()));
  if (tma_store_allowed && a.out_dt == DType::kBF16 && !a.accumulate && a.ld_out >= a.N &&
      expert_stride >= rows_per_half * a.ld_out && expert_stride < (std::int64_t{1} << 38) && halves_fit) {
    const auto u64 = [](std::int64_t v) { return static_cast<cuuint64_t>(v); };
    if (concat) {  // M = 2n (wgrad_unsupported_reason)
      const cuuint64_t dims[4] = {u64(a.N), u64(a.glu_concat_n), 2, u64(a.E)};
      const cuuint64_t strides[3] = {u64(a.ld_out) * 2, u64(a.half_stride()) * 2, u64(expert_stride) * 2};
      const cuuint32_t box[4] = {64, 32, 1, 1};
      p.epilogue.tma_out = make_tensor_map(a.out, 4, dims, strides, box);
    } else {
      const cuuint64_t dims[3] = {u64(a.N), u64(a.M), u64(a.E)};
      const cuuint64_t strides[2] = {u64(a.ld_out) * 2, u64(expert_stride) * 2};
      const cuuint32_t box[3] = {64, 64, 1};
      p.epilogue.tma_out = make_tensor_map(a.out, 3, dims, strides, box);
    }
    p.epilogue.tma_store = true;
  }
  // The cooperative tile's TMA epilogue also stages into the tile's last ring stage (one round instead of four;
  // epilogue_wgrad.cuh). Not with groups of m-tiles, which exist to keep B on the ring. Without groups a CTA's next
  // tile can still share (expert, n-tile) and would keep B (grid smaller than the m-tiles), but the second consumer
  // stages into that B: keep_b_allowed = false turns keeping off wherever a stage is borrowed.
  // MACHMOE_WGRAD_BORROW=0 keeps the four rounds (bitwise the same results; for A/B timing).
  static const bool borrow_wanted = detail::env_switch("MACHMOE_WGRAD_BORROW", true);
  if (borrow_wanted && p.epilogue.tma_store && tiles.tile_n == 256 && p.scheduler.m_group == 1) {
    p.epilogue.borrow_stage = true;
    p.mainloop.keep_b_allowed = false;
  }
  const bool dw2 = a.a_gather != nullptr;  // else dW1 (wgrad_unsupported_reason: exactly one operand gathered)
  if (dw2 && tiles.tile_n == 256)
    hopper::launch_weight_grad_dw2<hopper::Tile128x256Cooperative>(p, sms, stream);
  else if (dw2)
    hopper::launch_weight_grad_dw2<hopper::Tile128x128PingPong>(p, sms, stream);
  else if (tiles.tile_n == 256)
    hopper::launch_weight_grad_dw1<hopper::Tile128x256Cooperative>(p, sms, stream);
  else
    hopper::launch_weight_grad_dw1<hopper::Tile128x128PingPong>(p, sms, stream);
}

}  // namespace machmoe::gpu
