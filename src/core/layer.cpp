// Public forward/backward: validation of every argument, then dispatch to a backend. Today the backend is the
// CPU reference (fp32/fp64 host tensors); the CUDA runtime plugs in here.
#include "machmoe/layer.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "core/host_io.hpp"
#include "reference/layer.hpp"
#include "machmoe/device.hpp"
#include "machmoe/error.hpp"
#include "machmoe/sm_margin.hpp"

#ifdef MACHMOE_WITH_CUDA
#include "gpu/layer_cuda.hpp"
#endif

namespace machmoe {

namespace {

using detail::ArgChecker;

std::string bytes_str(std::size_t b) { return std::to_string(b) + " bytes"; }

/// A caller buffer's start: a misaligned one would fault in the GPU kernels' 16-byte accesses, far from the cause.
void check_buffer_start(const ArgChecker& c, const char* name, const void* ptr) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  if (address % kBufferAlignment != 0)
    c.fail(name, "a pointer aligned to kBufferAlignment = " + std::to_string(kBufferAlignment) + " bytes",
           "address " + std::to_string(address) + " (" + std::to_string(address % kBufferAlignment) +
               " bytes past a multiple)");
}

/// The bytes a caller's tensor or buffer spans, from its lowest to its highest element, named for messages. Empty for
/// an absent view, one without elements, or a buffer of no bytes: such a one touches no memory.
struct CallerBytes {
  const char* name;
  std::uintptr_t begin = 0, end = 0;
};

CallerBytes bytes_of(const TensorView& t, const char* name) {
  if (t.data == nullptr || t.numel() == 0) return {name};
  std::int64_t low = 0, high = 0;  // element offsets of the lowest and highest element (strides may be 0 or any sign)
  for (int i = 0; i < t.rank; ++i) (t.stride[i] < 0 ? low : high) += (t.shape[i] - 1) * t.stride[i];
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  return {name, base + static_cast<std::uintptr_t>(low * size), base + static_cast<std::uintptr_t>((high + 1) * size)};
}

/// W1's view (or its gradient's) split into the views of its halves where it has them: a 4D (E, 2, n, d) view of the
/// concatenated layout, whose gate and up halves may lie apart (check_w1_view); else the view itself.
TensorView w1_half(const TensorView& t, int half) {
  TensorView v = t;
  v.rank = 3;
  v.shape[0] = t.shape[0], v.shape[1] = t.shape[2], v.shape[2] = t.shape[3], v.shape[3] = 0;
  v.stride[0] = t.stride[0], v.stride[1] = t.stride[2], v.stride[2] = t.stride[3], v.stride[3] = 0;
  v.data = static_cast<char*>(t.data) + half * t.stride[1] * static_cast<std::int64_t>(dtype_size(t.dtype));
  return v;
}

/// The bytes of W1 or its gradient: a 4D view's two halves apart, so that memory between them (another tensor of
/// the call, where the halves are two allocations) is not taken for theirs.
std::vector<CallerBytes> w1_bytes(const TensorView& t, const char* name) {
  if (t.rank != 4 || t.data == nullptr || t.numel() == 0) return {bytes_of(t, name)};
  return {bytes_of(w1_half(t, 0), name), bytes_of(w1_half(t, 1), name)};
}

CallerBytes bytes_of(const void* data, std::size_t bytes, const char* name) {
  if (data == nullptr || bytes == 0) return {name};
  const auto base = reinterpret_cast<std::uintptr_t>(data);
  return {name, base, base + bytes};
}

/// What a call writes must not share memory with anything else it is given: the GPU reads inputs after it has
/// written outputs (x after grad_x, for the weight gradients), so an alias would silently give other results there
/// than on the CPU. Compared by the span from lowest to highest byte, so that views interleaved in one allocation
/// would be refused too; views laid one after another (a flat gradient buffer's) pass.
void check_no_aliasing(const ArgChecker& c, const std::vector<CallerBytes>& written,
                       const std::vector<CallerBytes>& read) {
  const auto clash = [&](const CallerBytes& w, const CallerBytes& o) {
    if (w.begin == w.end || o.begin == o.end || w.end <= o.begin || o.end <= w.begin) return;
    c.fail(w.name, "memory of its own (it is written, so it may share no byte with another argument of the call)",
           "bytes [" + std::to_string(w.begin) + ", " + std::to_string(w.end) + "), overlapping " + o.name + " at [" +
               std::to_string(o.begin) + ", " + std::to_string(o.end) + ")");
  };
  for (auto w = written.begin(); w != written.end(); ++w) {
    for (auto o = w + 1; o != written.end(); ++o) clash(*w, *o);
    for (const CallerBytes& o : read) clash(*w, o);
  }
}

/// What every entry point reads: x, the weights and the caller's routing.
std::vector<CallerBytes> layer_inputs(const TensorView& x, const LayerWeights& w, const RoutingTriples* routing) {
  std::vector<CallerBytes> r{bytes_of(x, "x"), bytes_of(w.router_weight, "weights.router_weight")};
  for (const CallerBytes& half : w1_bytes(w.w1, "weights.w1")) r.push_back(half);
  for (const CallerBytes& b : {bytes_of(w.b1, "weights.b1"), bytes_of(w.w2, "weights.w2"), bytes_of(w.b2, "weights.b2")})
    r.push_back(b);
  if (routing != nullptr) {
    r.push_back(bytes_of(routing->token_index, "routing.token_index"));
    r.push_back(bytes_of(routing->expert_index, "routing.expert_index"));
    r.push_back(bytes_of(routing->score, "routing.score"));
  }
  return r;
}

/// What a backward call writes of its outputs (absent ones touch nothing).
std::vector<CallerBytes> backward_outputs(const BackwardOutputs& out) {
  const LayerWeightGrads& g = out.grad_weights;
  std::vector<CallerBytes> r{bytes_of(out.grad_x, "outputs.grad_x"), bytes_of(out.grad_scores, "outputs.grad_scores"),
                             bytes_of(g.router_weight, "outputs.grad_weights.router_weight")};
  for (const CallerBytes& half : w1_bytes(g.w1, "outputs.grad_weights.w1")) r.push_back(half);
  for (const CallerBytes& b : {bytes_of(g.b1, "outputs.grad_weights.b1"), bytes_of(g.w2, "outputs.grad_weights.w2"),
                               bytes_of(g.b2, "outputs.grad_weights.b2")})
    r.push_back(b);
  return r;
}

template <class V>
V joined(V a, const V& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// W1 or its gradient (`grad`: the data dtype or fp32): (E, w1_rows, d), or, in the concatenated layout of a GLU
/// activation, (E, 2, n, d), whose dimension 1 steps from gate row j to up row j. Such a view's halves may lie apart
/// (torchtitan's w1 and w3, two allocations), the up half after the gate half: each half must be a well-formed
/// (E, n, d) view, and where the up half starts inside the gate half's span, the whole view must be row-major
/// (as a contiguous (E, 2n, d) tensor viewed so is), so that no two elements share memory.
void check_w1_view(const ArgChecker& c, const MoEProblem& p, const TensorView& t, const char* name, DType dt,
                   const Device& dev, bool grad) {
  const auto check = [&](const TensorView& v, const std::string& what, std::initializer_list<std::int64_t> shape) {
    if (grad) c.grad_tensor(v, what, shape, dt, dev);
    else c.tensor(v, what, shape, dt, dev);
  };
  if (t.rank != 4) {
    check(t, name, {p.E, p.w1_rows(), p.d});
    return;
  }
  const bool concat = is_glu(p.activation) && p.weight_layout == WeightLayout::kConcatenated;
  if (!concat)
    c.fail(name,
           "shape " + detail::shape_string({p.E, p.w1_rows(), p.d}) +
               " (a 4D (E, 2, n, d) view is taken only for the concatenated layout of a GLU activation)",
           t.shape_string());
  c.well_formed(t, name);
  if (t.shape[0] != p.E || t.shape[1] != 2 || t.shape[2] != p.n || t.shape[3] != p.d)
    c.fail(name,
           "shape " + detail::shape_string({p.E, p.w1_rows(), p.d}) + " or " +
               detail::shape_string({p.E, 2, p.n, p.d}) + " (gate and up halves)",
           t.shape_string());
  check(w1_half(t, 0), std::string(name) + " (its gate half, [:, 0])", {p.E, p.n, p.d});
  if (t.numel() == 0) return;
  // The gate half's span in elements, from its first element to its last, inclusive (its layout check bounds it).
  std::int64_t span = 1;
  for (int i : {0, 2, 3}) span += (t.shape[i] - 1) * t.stride[i];
  if (t.stride[1] <= 0 || t.stride[1] > std::numeric_limits<std::int64_t>::max() - span)
    c.fail(std::string(name) + ".stride",
           "a positive stride along dimension 1 (the up half after the gate half), addressing fewer than 2^63 "
           "elements",
           t.stride_string());
  if (t.stride[1] < span) check(t, name, {p.E, 2, p.n, p.d});  // the halves interleave: row-major as a whole
}

/// Checks shared by forward and backward; returns the layer's data dtype.
DType validate_inputs(const ArgChecker& c, const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                      const RoutingTriples* routing, void* stream) {
  validate_problem(p, c.where().c_str());
  if (x.empty()) c.fail("x", "a tensor of shape " + detail::shape_string({p.T, p.d}), "an empty view");
  const DType dt = x.dtype;
  const Device dev = x.device;
  if (!is_floating(dt)) c.fail("x", "a floating dtype (bf16, fp16, fp32, fp64)", dtype_name(dt));
  c.tensor(x, "x", {p.T, p.d}, dt, dev);
  if (p.routing == RoutingMode::kCallerSupplied) {
    if (!w.router_weight.empty()) c.tensor(w.router_weight, "weights.router_weight", {p.E, p.d}, dt, dev);
  } else {
    c.tensor(w.router_weight, "weights.router_weight", {p.E, p.d}, dt, dev);
  }
  check_w1_view(c, p, w.w1, "weights.w1", dt, dev, false);
  c.tensor(w.w2, "weights.w2", {p.E, p.d, p.n}, dt, dev);
  if (p.has_b1) c.tensor(w.b1, "weights.b1", {p.E, p.w1_rows()}, dt, dev);
  else c.absent(w.b1, "weights.b1", "problem.has_b1 is false");
  if (p.has_b2) c.tensor(w.b2, "weights.b2", {p.E, p.d}, dt, dev);
  else c.absent(w.b2, "weights.b2", "problem.has_b2 is false");

  if (p.routing == RoutingMode::kCallerSupplied) {
    if (routing == nullptr) c.fail("routing", "(token, expert, score) triples for routing 'caller'", "nullptr");
    c.index_tensor(routing->token_index, "routing.token_index", {p.num_pairs}, dev);
    c.index_tensor(routing->expert_index, "routing.expert_index", {p.num_pairs}, dev);
    c.tensor(routing->score, "routing.score", {p.num_pairs}, score_dtype(dt), dev);
  } else if (routing != nullptr) {
    c.fail("routing", std::string("nullptr (routing '") + routing_mode_name(p.routing) + "' routes by itself)",
           "a RoutingTriples pointer");
  }

  if (dev.type == DeviceType::kCUDA) {
#ifndef MACHMOE_WITH_CUDA
    c.fail("x", "tensors on cpu (this build has no CUDA support: nvcc was not found at configure time)",
           device_name(dev));
#endif
    if (dt == DType::kFP64)
      c.fail("x", "dtype bf16, fp16 or fp32 on cuda (fp64 runs on the CPU reference)", dtype_name(dt));
    if (p.routing == RoutingMode::kTokenRounding && p.K > 64)
      c.fail("problem.K", "K <= 64 for token rounding on cuda", std::to_string(p.K));
    // Last: what the arguments say comes before what this machine has (a build with CUDA may run on one without).
    c.device(dev, "x");
    // The expert GEMMs keep one cluster of two SMs at least (include/machmoe/sm_margin.hpp).
    const int margin = sm_margin();
    const int sms = margin > 0 ? cuda_sm_count(dev.index) : 0;
    if (margin > 0 && margin > sms - 2)
      c.fail("sm_margin",
             "the SM margin (set_sm_margin, MACHMOE_SM_MARGIN) at most " + std::to_string(sms - 2) + " on " +
                 device_name(dev) + " (" + std::to_string(sms) + " SMs; the expert GEMMs need a cluster of two)",
             std::to_string(margin));
  } else {
    c.device(dev, "x");
    if (dt != DType::kFP32 && dt != DType::kFP64)
      c.fail("x", "dtype fp32 or fp64 on cpu (the CPU reference; bf16/fp16 run on the GPU)", dtype_name(dt));
    if (stream != nullptr) c.fail("stream", "nullptr for cpu tensors", "a non-null stream");
  }
  return dt;
}

/// The views the GPU path hands to cuBLAS in the router GEMMs (src/gpu/layer_cuda.cpp: logits = x W_r^T in the
/// forward; dX += dlogits W_r and dW_r = dlogits^T x in the backward), whose row strides it passes as int leading
/// dimensions. Caller-supplied routing has no router GEMM.
void check_router_gemm_strides(const ArgChecker& c, const MoEProblem& p, const Device& dev,
                               std::initializer_list<std::pair<const TensorView*, const char*>> views) {
  if (dev.type != DeviceType::kCUDA || p.routing == RoutingMode::kCallerSupplied) return;
  for (const auto& [t, name] : views) c.int32_row_stride(*t, name, "an operand of the router GEMM");
}

/// Value checks of caller-supplied routing (host data): ranges, token order, at most K pairs per token.
void validate_routing_values(const ArgChecker& c, const MoEProblem& p, const RoutingTriples& r) {
  const std::vector<std::int64_t> tok = detail::read_index(r.token_index);
  const std::vector<std::int64_t> exp = detail::read_index(r.expert_index);
  std::int64_t run = 0;
  for (std::int64_t i = 0; i < p.num_pairs; ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    if (tok[i] < 0 || tok[i] >= p.T)
      c.fail("routing.token_index" + at, "a token in [0, " + std::to_string(p.T) + ")", std::to_string(tok[i]));
    if (exp[i] < 0 || exp[i] >= p.E)
      c.fail("routing.expert_index" + at, "an expert in [0, " + std::to_string(p.E) + ")", std::to_string(exp[i]));
    if (i > 0 && tok[i] < tok[i - 1])
      c.fail("routing.token_index" + at,
             "token indices in ascending order (the pairs of a token contiguous), so >= " + std::to_string(tok[i - 1]),
             std::to_string(tok[i]));
    run = (i > 0 && tok[i] == tok[i - 1]) ? run + 1 : 1;
    if (run > p.K)
      c.fail("routing.token_index" + at, "at most K = " + std::to_string(p.K) + " pairs per token",
             std::to_string(run) + " pairs for token " + std::to_string(tok[i]));
  }
}

template <class R>
ref::LayerInputs<R> read_inputs(const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                                const RoutingTriples* routing, std::vector<std::vector<R>>& store,
                                std::vector<std::vector<std::int64_t>>& index_store) {
  auto keep = [&](const TensorView& t) -> const R* {
    if (t.empty()) return nullptr;
    store.push_back(detail::read_real<R>(t));
    return store.back().data();
  };
  store.reserve(8);
  index_store.reserve(2);
  ref::LayerInputs<R> in;
  in.x = keep(x);
  in.router_weight = keep(w.router_weight);
  in.experts.w1 = keep(w.w1);
  in.experts.b1 = keep(w.b1);
  in.experts.w2 = keep(w.w2);
  in.experts.b2 = keep(w.b2);
  if (p.routing == RoutingMode::kCallerSupplied) {
    index_store.push_back(detail::read_index(routing->token_index));
    index_store.push_back(detail::read_index(routing->expert_index));
    in.pair_token = index_store[0].data();
    in.pair_expert = index_store[1].data();
    in.pair_score = keep(routing->score);
  }
  return in;
}

template <class T>
void put(void* base, const BufferRegion& r, const T* src, std::size_t count) {
  if (count == 0) return;  // an empty vector's data() may be null, which memcpy must not be given even for 0 bytes
  std::memcpy(static_cast<char*>(base) + r.offset, src, count * sizeof(T));
}

void put_int32(void* base, const BufferRegion& r, const std::vector<std::int64_t>& v) {
  std::int32_t* dst = reinterpret_cast<std::int32_t*>(static_cast<char*>(base) + r.offset);
  for (std::size_t i = 0; i < v.size(); ++i) dst[i] = static_cast<std::int32_t>(v[i]);
}

std::vector<std::int64_t> get_int32(const void* base, const BufferRegion& r, std::size_t count) {
  const std::int32_t* src = reinterpret_cast<const std::int32_t*>(static_cast<const char*>(base) + r.offset);
  return std::vector<std::int64_t>(src, src + count);
}

template <class R>
std::vector<R> get_real(const void* base, const BufferRegion& r, std::size_t count) {
  const R* src = reinterpret_cast<const R*>(static_cast<const char*>(base) + r.offset);
  return std::vector<R>(src, src + count);
}

template <class R>
void store_saved(const MoEProblem& p, const SavedLayout& l, void* base, const ref::ForwardSaved<R>& s) {
  if (l.h.present()) put(base, l.h, s.h.data(), s.h.size());
  if (l.router_logits.present()) put(base, l.router_logits, s.router_logits.data(), s.router_logits.size());
  put(base, l.scores, s.scores.data(), s.scores.size());
  put_int32(base, l.scatter, s.meta.scatter);
  put_int32(base, l.inverse, s.meta.inverse);
  put_int32(base, l.gather, s.meta.gather);
  put_int32(base, l.expert_offsets, s.meta.expert_offsets);
  if (l.token_offsets.present()) put_int32(base, l.token_offsets, s.meta.token_offsets);
  (void)p;
}

/// How an entry point names its saved buffer in messages: backward() and backward_input() take it in their
/// BackwardBuffers, backward_weight() and finish_backward_w1() as plain arguments.
struct SavedArgNames {
  const char* data;
  const char* bytes;
};
constexpr SavedArgNames kSavedInBuffers{"buffers.saved", "buffers.saved_bytes"};
constexpr SavedArgNames kSavedArgument{"saved", "saved_bytes"};

template <class R>
ref::ForwardSaved<R> load_saved(const ArgChecker& c, const MoEProblem& p, const SavedLayout& l, const void* base,
                                const SavedArgNames& names) {
  std::vector<std::int64_t> off = get_int32(base, l.expert_offsets, static_cast<std::size_t>(p.E + 1));
  bool ok = off[0] == 0;
  for (std::int64_t e = 0; e < p.E && ok; ++e) ok = off[e + 1] >= off[e];
  const std::int64_t P = off[p.E];
  ok = ok && P <= p.max_pairs() && (p.routing == RoutingMode::kTokenRounding || P == p.max_pairs());
  if (!ok)
    c.fail(names.data, "the buffer forward() filled for this problem (consistent expert offsets)",
           "offsets that end at " + std::to_string(P) + " pairs (expected " +
               (p.routing == RoutingMode::kTokenRounding ? "at most " : "") + std::to_string(p.max_pairs()) + ")");
  const std::size_t np = static_cast<std::size_t>(P);
  std::vector<std::int64_t> scatter = get_int32(base, l.scatter, np), inverse = get_int32(base, l.inverse, np),
                            gather = get_int32(base, l.gather, np);
  // The index arrays the reference reads through (pair_token = gather[inverse[p]], the grouped rows of x, H and the
  // gradients), range-checked in O(P) before any of them is used: a buffer of another problem with the same layout
  // (top-K with T*K unchanged: T = 100, K = 1 against T = 50, K = 2) passes the offset checks above and would
  // otherwise be read and written out of bounds. Checked before the backward writes anything.
  const auto check_range = [&](const std::vector<std::int64_t>& v, const char* array, const char* what,
                               std::int64_t limit) {
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] < 0 || v[i] >= limit)
        c.fail(names.data,
               std::string("the buffer forward() filled for this problem, whose saved ") + array + "[" +
                   std::to_string(i) + "] is " + what + " in [0, " + std::to_string(limit) + ")",
               std::to_string(v[i]) + ": the saved buffer does not belong to this problem (a forward of another "
                                      "problem with the same layout, or memory overwritten since)");
  };
  check_range(scatter, "scatter", "a pair", P);
  check_range(inverse, "inverse", "a grouped row", P);
  check_range(gather, "gather", "a token", p.T);
  // Then what ties the arrays to each other and to this problem, also in O(P): scatter and inverse are inverse
  // permutations, the pairs' tokens (gather[inverse[p]]) never decrease, and for top-K pair p is token p / K. A
  // buffer of another problem whose indices all fall in range (top-K with T = 50, K = 2 fed to T = 100, K = 1) passes
  // the range checks but not these. With a variable K the saved per-token offsets must agree with the pairs (the
  // reference rebuilds them from the pairs, so this finds a buffer overwritten since, not another problem's); the
  // full backward with caller-supplied routing compares the pairs with the caller's (reference_backward).
  const auto not_ours = [&](const std::string& expected, const std::string& got) {
    c.fail(names.data, "the buffer forward() filled for this problem, whose " + expected,
           got + ": the saved buffer does not belong to this problem (a forward of another problem with the same "
                 "layout, or memory overwritten since)");
  };
  for (std::int64_t q = 0; q < P; ++q)
    if (scatter[static_cast<std::size_t>(inverse[q])] != q)
      not_ours("saved scatter and inverse are inverse permutations",
               "scatter[inverse[" + std::to_string(q) + "]] = " + std::to_string(scatter[inverse[q]]));
  std::int64_t previous_token = 0;
  for (std::int64_t q = 0; q < P; ++q) {
    const std::int64_t token = gather[static_cast<std::size_t>(inverse[q])];
    if (token < previous_token)
      not_ours("pairs' tokens (gather[inverse[p]]) never decrease",
               "pair " + std::to_string(q) + " of token " + std::to_string(token) + " after one of token " +
                   std::to_string(previous_token));
    if (p.routing == RoutingMode::kTopK && token != q / p.K)
      not_ours("pair p belongs to token p / K = p / " + std::to_string(p.K) + " (top-K)",
               "pair " + std::to_string(q) + " of token " + std::to_string(token));
    previous_token = token;
  }
  if (l.token_offsets.present()) {  // variable K: each token's pairs where the forward put them
    const std::vector<std::int64_t> saved_offsets = get_int32(base, l.token_offsets, static_cast<std::size_t>(p.T + 1));
    std::int64_t q = 0;
    for (std::int64_t t = 0; t <= p.T; ++t) {
      while (q < P && gather[static_cast<std::size_t>(inverse[q])] < t) ++q;
      if (saved_offsets[static_cast<std::size_t>(t)] != q)
        not_ours("saved token_offsets[t] is the number of pairs of the tokens before t",
                 "token_offsets[" + std::to_string(t) + "] = " + std::to_string(saved_offsets[t]) +
                     " where the pairs say " + std::to_string(q));
    }
  }
  ref::ForwardSaved<R> s;
  s.meta = ref::metadata_from_grouped(p.T, p.E, std::move(scatter), std::move(inverse), std::move(gather),
                                      std::move(off));
  s.scores = get_real<R>(base, l.scores, np);
  if (l.h.present()) s.h = get_real<R>(base, l.h, np * static_cast<std::size_t>(p.w1_rows()));
  if (l.router_logits.present())
    s.router_logits = get_real<R>(base, l.router_logits, static_cast<std::size_t>(p.T * p.E));
  return s;
}

template <class R>
void forward_cpu(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
                 const ForwardOutputs& out, const ForwardBuffers& buffers) {
  std::vector<std::vector<R>> store;
  std::vector<std::vector<std::int64_t>> index_store;
  const ref::LayerInputs<R> in = read_inputs<R>(p, x, w, routing, store, index_store);
  const ref::ForwardResult<R> res = ref::layer_forward(p, in);
  detail::write_real(out.out, res.out.data());
  if (!out.router_logits.empty()) detail::write_real(out.router_logits, res.router_logits.data());
  detail::write_int32(out.expert_counts, res.expert_counts.data());
  store_saved(p, saved_layout(p, x.dtype), buffers.saved, res.saved);
}

/// The reference backward over host views: the forward's state from `saved`, inputs and upstream gradients.
template <class R>
ref::BackwardResult<R> reference_backward(const ArgChecker& c, const MoEProblem& p, const TensorView& x,
                                          const LayerWeights& w, const RoutingTriples* routing,
                                          const BackwardInputs& bin, const void* saved_buffer,
                                          std::vector<std::int64_t>& expert_counts) {
  const ref::ForwardSaved<R> saved = load_saved<R>(c, p, saved_layout(p, x.dtype), saved_buffer, kSavedInBuffers);
  expert_counts = saved.meta.expert_counts;  // (the weight gradients' accumulation leaves experts without pairs)
  std::vector<std::vector<R>> store;
  std::vector<std::vector<std::int64_t>> index_store;
  const ref::LayerInputs<R> in = read_inputs<R>(p, x, w, routing, store, index_store);
  if (p.routing == RoutingMode::kCallerSupplied)  // the caller's pairs again: the saved ones must be these
    for (std::int64_t q = 0; q < saved.meta.num_pairs(); ++q)
      if (saved.meta.pair_token[q] != in.pair_token[q] || saved.meta.pair_expert[q] != in.pair_expert[q])
        c.fail("buffers.saved",
               "the buffer forward() filled for these routing triples, whose pair " + std::to_string(q) +
                   " is token " + std::to_string(in.pair_token[q]) + ", expert " + std::to_string(in.pair_expert[q]),
               "token " + std::to_string(saved.meta.pair_token[q]) + ", expert " +
                   std::to_string(saved.meta.pair_expert[q]) +
                   " in the saved buffer: it does not belong to this problem (a forward of other pairs)");
  const std::vector<R> grad_out = detail::read_real<R>(bin.grad_out);
  std::vector<R> grad_logits;
  if (!bin.grad_router_logits.empty()) grad_logits = detail::read_real<R>(bin.grad_router_logits);
  return ref::layer_backward(p, in, saved, grad_out.data(), grad_logits.empty() ? nullptr : grad_logits.data());
}

/// grad_x, and the router's gradient (zero without a router) or the caller's score gradients.
template <class R>
void write_input_grads(const MoEProblem& p, const BackwardOutputs& out, const ref::BackwardResult<R>& g) {
  const bool acc = out.grad_weights.accumulate;
  detail::write_real(out.grad_x, g.dx.data());
  if (p.routing == RoutingMode::kCallerSupplied) {
    detail::write_real(out.grad_scores, g.dscores.data());
    // No router in the layer: its gradient is zero (accumulating it leaves the buffer as it is).
    if (!out.grad_weights.router_weight.empty() && !acc) {
      const std::vector<R> zeros(static_cast<std::size_t>(p.E * p.d), R(0));
      detail::write_grad(out.grad_weights.router_weight, zeros.data(), false);
    }
  } else if (!acc || p.max_pairs() > 0) {  // a call with no pairs (T = 0) leaves an accumulated router gradient
    detail::write_grad(out.grad_weights.router_weight, g.drouter_weight.data(), acc);
  }
}

/// The experts' weight gradients; accumulating leaves the experts without pairs (expert_counts) as they are.
template <class R>
void write_weight_grads(const MoEProblem& p, const BackwardOutputs& out, const std::vector<R>& dw1,
                        const std::vector<R>& db1, const std::vector<R>& dw2, const std::vector<R>& db2,
                        const std::vector<std::int64_t>& expert_counts) {
  const bool acc = out.grad_weights.accumulate;
  const std::int64_t* pairs = expert_counts.data();
  if (!out.w1_grads_later) {  // else finish_backward_w1() writes them
    detail::write_grad(out.grad_weights.w1, dw1.data(), acc, pairs);
    if (p.has_b1) detail::write_grad(out.grad_weights.b1, db1.data(), acc, pairs);
  }
  detail::write_grad(out.grad_weights.w2, dw2.data(), acc, pairs);
  if (p.has_b2) detail::write_grad(out.grad_weights.b2, db2.data(), acc, pairs);
}

template <class R>
void backward_cpu(const ArgChecker& c, const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                  const RoutingTriples* routing, const BackwardInputs& bin, const BackwardOutputs& out,
                  const BackwardBuffers& buffers) {
  std::vector<std::int64_t> expert_counts;
  const ref::BackwardResult<R> g = reference_backward<R>(c, p, x, w, routing, bin, buffers.saved, expert_counts);
  write_input_grads(p, out, g);
  write_weight_grads(p, out, g.dw1, g.db1, g.dw2, g.db2, expert_counts);
  // W1's gradients later: dH goes over the saved H, as on the GPU (the caller handed the buffer over), and
  // finish_backward_w1() recomputes them from it (so that path is what gets tested).
  if (out.w1_grads_later)
    put(const_cast<void*>(buffers.saved), saved_layout(p, x.dtype).h, g.dh.data(), g.dh.size());
}

template <class R>
void finish_backward_w1_cpu(const ArgChecker& c, const MoEProblem& p, const TensorView& x, const BackwardOutputs& out,
                            const void* saved_buf) {
  const ref::ForwardSaved<R> saved = load_saved<R>(c, p, saved_layout(p, x.dtype), saved_buf,
                                                    kSavedArgument);  // .h holds dH
  const std::vector<R> xs = detail::read_real<R>(x);
  // The reference computes W2's gradients in the same pass; zero A' and dO make them zero, and they are dropped.
  const std::vector<R> a_prime(static_cast<std::size_t>(saved.meta.num_pairs() * p.n), R(0));
  const std::vector<R> grad_out(static_cast<std::size_t>(p.T * p.d), R(0));
  ref::ExpertGrads<R> g;
  ref::experts_weight_grads(ref::expert_shape(p), p.E, xs.data(), saved.meta, saved.scores.data(), saved.h.data(),
                            a_prime.data(), grad_out.data(), p.has_b1, false, g);
  const bool acc = out.grad_weights.accumulate;
  const std::int64_t* pairs = saved.meta.expert_counts.data();
  detail::write_grad(out.grad_weights.w1, g.dw1.data(), acc, pairs);
  if (p.has_b1) detail::write_grad(out.grad_weights.b1, g.db1.data(), acc, pairs);
}

template <class R>
void backward_input_cpu(const ArgChecker& c, const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                        const RoutingTriples* routing, const BackwardInputs& bin, const BackwardOutputs& out,
                        const BackwardBuffers& buffers, const DeferredBuffer& deferred) {
  // The reference computes the weight gradients too; only dH and A' are kept for backward_weight(), which
  // recomputes the weight gradients from them (so the deferred path is what gets tested).
  std::vector<std::int64_t> expert_counts;  // (backward_weight() reads them from the saved buffer again)
  const ref::BackwardResult<R> g = reference_backward<R>(c, p, x, w, routing, bin, buffers.saved, expert_counts);
  write_input_grads(p, out, g);
  const DeferredLayout dl = deferred_layout(p, x.dtype);
  put(deferred.data, dl.dh, g.dh.data(), g.dh.size());
  put(deferred.data, dl.a_prime, g.a_prime.data(), g.a_prime.size());
}

template <class R>
void backward_weight_cpu(const ArgChecker& c, const MoEProblem& p, const TensorView& x, const TensorView& grad_out,
                         const BackwardOutputs& out, const void* saved_buf, const DeferredBuffer& deferred) {
  const ref::ForwardSaved<R> saved = load_saved<R>(c, p, saved_layout(p, x.dtype), saved_buf, kSavedArgument);
  const std::size_t P = static_cast<std::size_t>(saved.meta.num_pairs());
  const DeferredLayout dl = deferred_layout(p, x.dtype);
  const std::vector<R> dh = get_real<R>(deferred.data, dl.dh, P * static_cast<std::size_t>(p.w1_rows()));
  const std::vector<R> a_prime = get_real<R>(deferred.data, dl.a_prime, P * static_cast<std::size_t>(p.n));
  const std::vector<R> xs = detail::read_real<R>(x), go = detail::read_real<R>(grad_out);
  ref::ExpertGrads<R> g;
  ref::experts_weight_grads(ref::expert_shape(p), p.E, xs.data(), saved.meta, saved.scores.data(), dh.data(),
                            a_prime.data(), go.data(), p.has_b1, p.has_b2, g);
  write_weight_grads(p, out, g.dw1, g.db1, g.dw2, g.db2, saved.meta.expert_counts);
}

/// The workspace: at least `need` bytes (`formula` says which function sizes it), non-null where it holds any, and
/// aligned.
void check_workspace(const ArgChecker& c, const void* workspace, std::size_t bytes, std::size_t need,
                     const std::string& formula) {
  if (bytes < need)
    c.fail("buffers.workspace_bytes", "at least " + formula + " = " + bytes_str(need), bytes_str(bytes));
  if (workspace == nullptr && need > 0) c.fail("buffers.workspace", "a non-null pointer", "nullptr");
  check_buffer_start(c, "buffers.workspace", workspace);
}

void check_deferred(const ArgChecker& c, const MoEProblem& p, DType dt, const DeferredBuffer& deferred) {
  const std::size_t need = deferred_layout(p, dt).total_bytes;
  if (deferred.bytes < need)
    c.fail("deferred.bytes", "at least deferred_layout(problem, dtype).total_bytes = " + bytes_str(need),
           bytes_str(deferred.bytes));
  if (deferred.data == nullptr && need > 0) c.fail("deferred.data", "a non-null pointer", "nullptr");
  check_buffer_start(c, "deferred.data", deferred.data);
}

void check_saved(const ArgChecker& c, const MoEProblem& p, DType dt, const void* saved, std::size_t bytes,
                 const SavedArgNames& names) {
  const std::size_t need = saved_layout(p, dt).total_bytes;
  if (bytes < need)
    c.fail(names.bytes, "at least saved_layout(problem, dtype).total_bytes = " + bytes_str(need), bytes_str(bytes));
  if (saved == nullptr) c.fail(names.data, "the buffer forward() filled", "nullptr");
  check_buffer_start(c, names.data, saved);
}

/// W1's gradients (w1, and b1 with a bias), or their absence where they come from another call (`why_absent`).
void check_w1_grads(const ArgChecker& c, const MoEProblem& p, DType dt, const Device& dev, const LayerWeightGrads& gw,
                    const char* why_absent = nullptr) {
  if (why_absent) {
    c.absent(gw.w1, "outputs.grad_weights.w1", why_absent);
    c.absent(gw.b1, "outputs.grad_weights.b1", why_absent);
    return;
  }
  check_w1_view(c, p, gw.w1, "outputs.grad_weights.w1", dt, dev, true);
  if (p.has_b1) c.grad_tensor(gw.b1, "outputs.grad_weights.b1", {p.E, p.w1_rows()}, dt, dev);
  else c.absent(gw.b1, "outputs.grad_weights.b1", "problem.has_b1 is false");
}

void check_w2_grads(const ArgChecker& c, const MoEProblem& p, DType dt, const Device& dev, const LayerWeightGrads& gw) {
  c.grad_tensor(gw.w2, "outputs.grad_weights.w2", {p.E, p.d, p.n}, dt, dev);
  if (p.has_b2) c.grad_tensor(gw.b2, "outputs.grad_weights.b2", {p.E, p.d}, dt, dev);
  else c.absent(gw.b2, "outputs.grad_weights.b2", "problem.has_b2 is false");
}

void check_weight_grads(const ArgChecker& c, const MoEProblem& p, DType dt, const Device& dev,
                        const LayerWeightGrads& gw) {
  check_w1_grads(c, p, dt, dev, gw);
  check_w2_grads(c, p, dt, dev, gw);
}

void check_input_grads(const ArgChecker& c, const MoEProblem& p, DType dt, const Device& dev, const TensorView& x,
                       const LayerWeights& w, const BackwardInputs& bin, const BackwardOutputs& out) {
  c.tensor(bin.grad_out, "inputs.grad_out", {p.T, p.d}, dt, dev);
  if (p.routing == RoutingMode::kCallerSupplied)
    c.absent(bin.grad_router_logits, "inputs.grad_router_logits", "routing 'caller' has no router logits");
  else if (!bin.grad_router_logits.empty())
    c.tensor(bin.grad_router_logits, "inputs.grad_router_logits", {p.T, p.E}, dt, dev);
  c.tensor(out.grad_x, "outputs.grad_x", {p.T, p.d}, dt, dev);
  const LayerWeightGrads& gw = out.grad_weights;
  if (p.routing != RoutingMode::kCallerSupplied || !gw.router_weight.empty())
    c.grad_tensor(gw.router_weight, "outputs.grad_weights.router_weight", {p.E, p.d}, dt, dev);
  if (p.routing == RoutingMode::kCallerSupplied)
    c.tensor(out.grad_scores, "outputs.grad_scores", {p.num_pairs}, score_dtype(dt), dev);
  else
    c.absent(out.grad_scores, "outputs.grad_scores", "only routing 'caller' has caller-supplied scores");
  check_router_gemm_strides(c, p, dev,
                            {{&x, "x"}, {&w.router_weight, "weights.router_weight"}, {&out.grad_x, "outputs.grad_x"},
                             {&gw.router_weight, "outputs.grad_weights.router_weight"}});
}

}  // namespace

void forward(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
             const ForwardOutputs& out, const ForwardBuffers& buffers, void* stream) {
  const ArgChecker c("forward", "x");
  const DType dt = validate_inputs(c, p, x, w, routing, stream);
  c.tensor(out.out, "outputs.out", {p.T, p.d}, dt, x.device);
  if (p.routing == RoutingMode::kCallerSupplied)
    c.absent(out.router_logits, "outputs.router_logits", "routing 'caller' has no router");
  else
    c.tensor(out.router_logits, "outputs.router_logits", {p.T, p.E}, dt, x.device);
  c.tensor(out.expert_counts, "outputs.expert_counts", {p.E}, DType::kInt32, x.device);
  check_router_gemm_strides(c, p, x.device,
                            {{&x, "x"}, {&w.router_weight, "weights.router_weight"},
                             {&out.router_logits, "outputs.router_logits"}});
  const std::size_t saved_need = saved_layout(p, dt).total_bytes;
  if (buffers.saved_bytes < saved_need)
    c.fail("buffers.saved_bytes", "at least saved_layout(problem, dtype).total_bytes = " + bytes_str(saved_need),
           bytes_str(buffers.saved_bytes));
  if (buffers.saved == nullptr && saved_need > 0) c.fail("buffers.saved", "a non-null pointer", "nullptr");
  check_buffer_start(c, "buffers.saved", buffers.saved);
  check_workspace(c, buffers.workspace, buffers.workspace_bytes, forward_workspace_bytes(p, dt, x.device),
                  "forward_workspace_bytes(...)");
  check_no_aliasing(c,
                    {bytes_of(out.out, "outputs.out"), bytes_of(out.router_logits, "outputs.router_logits"),
                     bytes_of(out.expert_counts, "outputs.expert_counts"),
                     bytes_of(buffers.saved, buffers.saved_bytes, "buffers.saved"),
                     bytes_of(buffers.workspace, buffers.workspace_bytes, "buffers.workspace")},
                    layer_inputs(x, w, routing));
#ifdef MACHMOE_WITH_CUDA
  if (x.device.type == DeviceType::kCUDA) {
    // Index values stay on the device (checking them here would synchronise); out-of-range pairs are skipped, and
    // with index checking on, recorded and raised at the next entry (include/machmoe/index_checking.hpp).
    gpu::raise_recorded_index_violation(x.device.index, "forward", stream);
    gpu::forward_cuda(p, x, w, routing, out, buffers, stream);
    return;
  }
#endif
  if (p.routing == RoutingMode::kCallerSupplied) validate_routing_values(c, p, *routing);

  if (dt == DType::kFP64) forward_cpu<double>(p, x, w, routing, out, buffers);
  else forward_cpu<float>(p, x, w, routing, out, buffers);
}

void backward(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
              const BackwardInputs& bin, const BackwardOutputs& out, const BackwardBuffers& buffers, void* stream) {
  const ArgChecker c("backward", "x");
  const DType dt = validate_inputs(c, p, x, w, routing, stream);
  const Device dev = x.device;
  check_input_grads(c, p, dt, dev, x, w, bin, out);
  if (out.w1_grads_later) {
    // dH must outlive this call where finish_backward_w1() finds it: over the saved H, which only a consumed buffer
    // of the default cache mode offers (input-only mode keeps no H; its dH lives in the workspace).
    if (!buffers.consume_saved)
      c.fail("outputs.w1_grads_later", "false, or buffers.consume_saved = true (dH is left over the saved H)",
             "true with consume_saved = false");
    if (p.cache != CacheMode::kPreActivation)
      c.fail("outputs.w1_grads_later", "false in input-only cache mode (the saved buffer holds no H for dH to take)",
             "true");
    check_w1_grads(c, p, dt, dev, out.grad_weights, "W1's gradients come from finish_backward_w1()");
  } else {
    check_w1_grads(c, p, dt, dev, out.grad_weights);
  }
  check_w2_grads(c, p, dt, dev, out.grad_weights);
  check_saved(c, p, dt, buffers.saved, buffers.saved_bytes, kSavedInBuffers);
  check_workspace(c, buffers.workspace, buffers.workspace_bytes,
                  backward_workspace_bytes(p, dt, dev, buffers.consume_saved),
                  std::string("backward_workspace_bytes(..., consume_saved = ") +
                      (buffers.consume_saved ? "true" : "false") + ")");
  {
    const CallerBytes saved = bytes_of(buffers.saved, buffers.saved_bytes, "buffers.saved");  // written if consumed
    std::vector<CallerBytes> written = backward_outputs(out), read = layer_inputs(x, w, routing);
    written.push_back(bytes_of(buffers.workspace, buffers.workspace_bytes, "buffers.workspace"));
    (buffers.consume_saved ? written : read).push_back(saved);
    read.push_back(bytes_of(bin.grad_out, "inputs.grad_out"));
    read.push_back(bytes_of(bin.grad_router_logits, "inputs.grad_router_logits"));
    check_no_aliasing(c, written, read);
  }
#ifdef MACHMOE_WITH_CUDA
  if (dev.type == DeviceType::kCUDA) {
    gpu::raise_recorded_index_violation(dev.index, "backward", stream);
    gpu::backward_cuda(p, x, w, routing, bin, out, buffers, stream);
    return;
  }
#endif
  if (p.routing == RoutingMode::kCallerSupplied) validate_routing_values(c, p, *routing);

  if (dt == DType::kFP64) backward_cpu<double>(c, p, x, w, routing, bin, out, buffers);
  else backward_cpu<float>(c, p, x, w, routing, bin, out, buffers);
}

void backward_input(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
                    const BackwardInputs& bin, const BackwardOutputs& out, const BackwardBuffers& buffers,
                    const DeferredBuffer& deferred, void* stream) {
  const ArgChecker c("backward_input", "x");
  const DType dt = validate_inputs(c, p, x, w, routing, stream);
  const Device dev = x.device;
  check_input_grads(c, p, dt, dev, x, w, bin, out);
  if (out.w1_grads_later) c.fail("outputs.w1_grads_later", "false (backward() only)", "true");
  const LayerWeightGrads& gw = out.grad_weights;
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&gw.w1, "outputs.grad_weights.w1"},
                                {&gw.b1, "outputs.grad_weights.b1"}, {&gw.w2, "outputs.grad_weights.w2"},
                                {&gw.b2, "outputs.grad_weights.b2"}})
    c.absent(*t, name, "expert weight gradients come from backward_weight()");
  if (buffers.consume_saved)
    c.fail("buffers.consume_saved", "false (backward_weight() reads the saved buffer after backward_input())",
           "true");
  check_saved(c, p, dt, buffers.saved, buffers.saved_bytes, kSavedInBuffers);
  check_workspace(c, buffers.workspace, buffers.workspace_bytes, backward_input_workspace_bytes(p, dt, dev),
                  "backward_input_workspace_bytes(...)");
  check_deferred(c, p, dt, deferred);
  check_no_aliasing(c,
                    joined(backward_outputs(out),
                           {bytes_of(buffers.workspace, buffers.workspace_bytes, "buffers.workspace"),
                            bytes_of(deferred.data, deferred.bytes, "deferred.data")}),
                    joined(layer_inputs(x, w, routing),
                           {bytes_of(buffers.saved, buffers.saved_bytes, "buffers.saved"),
                            bytes_of(bin.grad_out, "inputs.grad_out"),
                            bytes_of(bin.grad_router_logits, "inputs.grad_router_logits")}));
#ifdef MACHMOE_WITH_CUDA
  if (dev.type == DeviceType::kCUDA) {
    gpu::raise_recorded_index_violation(dev.index, "backward_input", stream);
    gpu::backward_input_cuda(p, x, w, bin, out, buffers, deferred, stream);
    return;
  }
#endif
  if (p.routing == RoutingMode::kCallerSupplied) validate_routing_values(c, p, *routing);
  if (dt == DType::kFP64) backward_input_cpu<double>(c, p, x, w, routing, bin, out, buffers, deferred);
  else backward_input_cpu<float>(c, p, x, w, routing, bin, out, buffers, deferred);
}

void backward_weight(const MoEProblem& p, const TensorView& x, const LayerWeights& w, const RoutingTriples* routing,
                     const TensorView& grad_out, const BackwardOutputs& out, const void* saved,
                     std::size_t saved_bytes, const DeferredBuffer& deferred, void* stream) {
  const ArgChecker c("backward_weight", "x");
  const DType dt = validate_inputs(c, p, x, w, routing, stream);
  const Device dev = x.device;
  c.tensor(grad_out, "grad_out", {p.T, p.d}, dt, dev);
  check_weight_grads(c, p, dt, dev, out.grad_weights);
  c.absent(out.grad_x, "outputs.grad_x", "the input gradient comes from backward_input()");
  c.absent(out.grad_scores, "outputs.grad_scores", "score gradients come from backward_input()");
  c.absent(out.grad_weights.router_weight, "outputs.grad_weights.router_weight",
           "the router's gradient comes from backward_input()");
  if (out.w1_grads_later) c.fail("outputs.w1_grads_later", "false (backward() only)", "true");
  check_saved(c, p, dt, saved, saved_bytes, kSavedArgument);
  check_deferred(c, p, dt, deferred);
  check_no_aliasing(c, backward_outputs(out),
                    joined(layer_inputs(x, w, routing),
                           {bytes_of(saved, saved_bytes, "saved"), bytes_of(grad_out, "grad_out"),
                            bytes_of(deferred.data, deferred.bytes, "deferred.data")}));
#ifdef MACHMOE_WITH_CUDA
  if (dev.type == DeviceType::kCUDA) {
    gpu::raise_recorded_index_violation(dev.index, "backward_weight", stream);
    gpu::backward_weight_cuda(p, x, grad_out, out, saved, deferred, stream);
    return;
  }
#endif
  if (dt == DType::kFP64) backward_weight_cpu<double>(c, p, x, grad_out, out, saved, deferred);
  else backward_weight_cpu<float>(c, p, x, grad_out, out, saved, deferred);
}

void finish_backward_w1(const MoEProblem& p, const TensorView& x, const LayerWeights& w,
                        const RoutingTriples* routing, const BackwardOutputs& out, const void* saved,
                        std::size_t saved_bytes, void* stream) {
  const ArgChecker c("finish_backward_w1", "x");
  const DType dt = validate_inputs(c, p, x, w, routing, stream);
  const Device dev = x.device;
  if (p.cache != CacheMode::kPreActivation)
    c.fail("problem.cache", "preact (dH is left over the saved H only in the default cache mode)",
           cache_mode_name(p.cache));
  check_w1_grads(c, p, dt, dev, out.grad_weights);
  const char* from_backward = "the other gradients come from backward()";
  c.absent(out.grad_x, "outputs.grad_x", from_backward);
  c.absent(out.grad_scores, "outputs.grad_scores", from_backward);
  c.absent(out.grad_weights.router_weight, "outputs.grad_weights.router_weight", from_backward);
  c.absent(out.grad_weights.w2, "outputs.grad_weights.w2", from_backward);
  c.absent(out.grad_weights.b2, "outputs.grad_weights.b2", from_backward);
  check_saved(c, p, dt, saved, saved_bytes, kSavedArgument);
  check_no_aliasing(c, backward_outputs(out),
                    joined(layer_inputs(x, w, routing), {bytes_of(saved, saved_bytes, "saved")}));
#ifdef MACHMOE_WITH_CUDA
  if (dev.type == DeviceType::kCUDA) {
    gpu::raise_recorded_index_violation(dev.index, "finish_backward_w1", stream);
    gpu::finish_backward_w1_cuda(p, x, out, saved, stream);
    return;
  }
#endif
  if (dt == DType::kFP64) finish_backward_w1_cpu<double>(c, p, x, out, saved);
  else finish_backward_w1_cpu<float>(c, p, x, out, saved);
}

}  // namespace machmoe
