#include "machmoe/problem.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "machmoe/error.hpp"

namespace machmoe {

bool is_glu(Activation act) {
  return act == Activation::kSwiGLU || act == Activation::kGeGLU || act == Activation::kReGLU ||
         act == Activation::kGptOssSwiGLU;
}

std::int64_t MoEProblem::w1_rows() const { return is_glu(activation) ? 2 * n : n; }

bool MoEProblem::keeps_router_logits() const {
  return routing == RoutingMode::kTokenRounding ||
         (routing == RoutingMode::kTopK && score == ScoreVariant::kTopKOfSoftmax);
}

bool MoEProblem::logit_grad_at_selections() const {
  return routing == RoutingMode::kTopK && score != ScoreVariant::kTopKOfSoftmax;
}

bool MoEProblem::variable_k() const { return routing != RoutingMode::kTopK; }

std::int64_t MoEProblem::max_pairs() const {
  switch (routing) {
    case RoutingMode::kTopK: return T * K;
    case RoutingMode::kCallerSupplied: return num_pairs;
    case RoutingMode::kTokenRounding: {
      // Only experts with a partial tile can grow, at most min(E, T*K) of them, and no expert can take more than
      // T tokens. By rule, the pairs an expert with f token choices can add (down = floor_M(f), up = the capped
      // upper count, both within one tile of f):
      //   down:    none.
      //   up:      up - f <= tile_m - 1.
      //   nearest: it rounds up only when up - f < f - down, and (up - f) + (f - down) <= tile_m (= tile_m when up
      //            is not capped at T; less when it is), so up - f < tile_m / 2: at most tile_m / 2 - 1 (tile_m is
      //            even).
      if (rounding == RoundingRule::kDown) return T * K;
      const std::int64_t per_expert = rounding == RoundingRule::kUp ? tile_m - 1 : tile_m / 2 - 1;
      const std::int64_t partial = std::min(E, T * K);
      return std::min(T * K + partial * per_expert, T * E);
    }
  }
  return 0;
}

// ---- names ---------------------------------------------------------------------------------------------------

namespace {
template <class Enum, std::size_t N>
struct NameTable {
  Enum value[N];
  const char* name[N];
};

const NameTable<Activation, 8> kActivations{
    {Activation::kSwiGLU, Activation::kGeGLU, Activation::kReGLU, Activation::kReLUSquared, Activation::kReLU,
     Activation::kGELU, Activation::kSiLU, Activation::kGptOssSwiGLU},
    {"swiglu", "geglu", "reglu", "relu_squared", "relu", "gelu", "silu", "gptoss_swiglu"}};
const NameTable<WeightLayout, 2> kLayouts{{WeightLayout::kInterleaved, WeightLayout::kConcatenated},
                                          {"interleaved", "concatenated"}};
const NameTable<ScoreVariant, 3> kScores{
    {ScoreVariant::kSoftmaxOverTopK, ScoreVariant::kTopKOfSoftmax, ScoreVariant::kTopKOfSoftmaxRenorm},
    {"softmax_topk", "topk_softmax", "topk_softmax_renorm"}};
const NameTable<RoutingMode, 3> kRoutings{
    {RoutingMode::kTopK, RoutingMode::kTokenRounding, RoutingMode::kCallerSupplied},
    {"topk", "token_rounding", "caller"}};
const NameTable<RoundingRule, 3> kRoundings{{RoundingRule::kNearest, RoundingRule::kUp, RoundingRule::kDown},
                                            {"nearest", "up", "down"}};
const NameTable<CacheMode, 2> kCaches{{CacheMode::kPreActivation, CacheMode::kInputOnly},
                                      {"preact", "input_only"}};

template <class Enum, std::size_t N>
const char* name_of(const NameTable<Enum, N>& table, Enum v) {
  for (std::size_t i = 0; i < N; ++i)
    if (table.value[i] == v) return table.name[i];
  return "unknown";
}

template <class Enum, std::size_t N>
Enum parse(const NameTable<Enum, N>& table, const std::string& s, const char* what) {
  std::string accepted;
  for (std::size_t i = 0; i < N; ++i) {
    if (s == table.name[i]) return table.value[i];
    accepted += (i ? ", " : "") + std::string(table.name[i]);
  }
  throw_argument_error("parse", what, "one of {" + accepted + "}", "'" + s + "'");
}

/// "{swiglu = 0, geglu = 1, ...}": the names with the integer codes a binding passes.
template <class Enum, std::size_t N>
std::string codes_of(const NameTable<Enum, N>& table) {
  std::string s;
  for (std::size_t i = 0; i < N; ++i)
    s += (i ? ", " : "") + std::string(table.name[i]) + " = " + std::to_string(static_cast<int>(table.value[i]));
  return "{" + s + "}";
}

/// The enum value whose code is `code`, compared as 64-bit integers so that no wider code wraps onto a valid one.
template <class Enum, std::size_t N>
Enum from_code(const NameTable<Enum, N>& table, std::int64_t code, const std::string& where, const std::string& arg,
               const char* type) {
  for (std::size_t i = 0; i < N; ++i)
    if (static_cast<std::int64_t>(static_cast<int>(table.value[i])) == code) return table.value[i];
  throw_argument_error(where, arg, std::string("a ") + type + " code, one of " + codes_of(table),
                       std::to_string(code));
}

template <class Enum, std::size_t N>
void check_code(const NameTable<Enum, N>& table, Enum v, const char* where, const char* field, const char* type) {
  from_code(table, static_cast<int>(v), where, field, type);
}
}  // namespace

const char* activation_name(Activation v) { return name_of(kActivations, v); }
const char* weight_layout_name(WeightLayout v) { return name_of(kLayouts, v); }
const char* score_variant_name(ScoreVariant v) { return name_of(kScores, v); }
const char* routing_mode_name(RoutingMode v) { return name_of(kRoutings, v); }
const char* rounding_rule_name(RoundingRule v) { return name_of(kRoundings, v); }
const char* cache_mode_name(CacheMode v) { return name_of(kCaches, v); }
Activation parse_activation(const std::string& s) { return parse(kActivations, s, "activation"); }
WeightLayout parse_weight_layout(const std::string& s) { return parse(kLayouts, s, "weight_layout"); }
ScoreVariant parse_score_variant(const std::string& s) { return parse(kScores, s, "score"); }
RoutingMode parse_routing_mode(const std::string& s) { return parse(kRoutings, s, "routing"); }
RoundingRule parse_rounding_rule(const std::string& s) { return parse(kRoundings, s, "rounding"); }
CacheMode parse_cache_mode(const std::string& s) { return parse(kCaches, s, "cache"); }

Activation activation_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kActivations, code, where, arg, "machmoe::Activation");
}
WeightLayout weight_layout_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kLayouts, code, where, arg, "machmoe::WeightLayout");
}
ScoreVariant score_variant_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kScores, code, where, arg, "machmoe::ScoreVariant");
}
RoutingMode routing_mode_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kRoutings, code, where, arg, "machmoe::RoutingMode");
}
RoundingRule rounding_rule_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kRoundings, code, where, arg, "machmoe::RoundingRule");
}
CacheMode cache_mode_from_code(std::int64_t code, const std::string& where, const std::string& arg) {
  return from_code(kCaches, code, where, arg, "machmoe::CacheMode");
}

std::string MoEProblem::to_string() const {
  std::ostringstream os;
  os << "T=" << T << " d=" << d << " n=" << n << " E=" << E << " K=" << K << " activation=" << activation_name(activation);
  if (activation == Activation::kGptOssSwiGLU) os << "(alpha=" << swiglu_alpha << ",limit=" << swiglu_limit << ")";
  os << " bias=" << (has_b1 ? "b1" : "") << (has_b1 && has_b2 ? "+" : "") << (has_b2 ? "b2" : "")
     << (!has_b1 && !has_b2 ? "none" : "") << " layout=" << weight_layout_name(weight_layout)
     << " score=" << score_variant_name(score) << " routing=" << routing_mode_name(routing);
  if (routing == RoutingMode::kTokenRounding) os << " rounding=" << rounding_rule_name(rounding) << " tile_m=" << tile_m;
  if (routing == RoutingMode::kCallerSupplied) os << " pairs=" << num_pairs;
  os << " cache=" << cache_mode_name(cache);
  if (dx_chunks != 0) os << " dx_chunks=" << dx_chunks;
  if (y_chunks != 0) os << " y_chunks=" << y_chunks;
  return os.str();
}

// ---- validation ----------------------------------------------------------------------------------------------

static void check_range(const char* where, const char* field, std::int64_t v, std::int64_t lo, std::int64_t hi,
                        const std::string& why = "") {
  if (v < lo || v > hi)
    throw_argument_error(where, field,
                         "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" + why,
                         std::to_string(v));
}

/// Each option holds one of its enum's values. A MoEProblem filled from an unchecked integer (a binding, a file)
/// may hold any int, and every later check and the backends switch on these fields, so they come first: an invalid
/// activation must be reported as such, not as the W1 shape it would imply.
static void validate_options(const MoEProblem& p, const char* where) {
  check_code(kActivations, p.activation, where, "problem.activation", "machmoe::Activation");
  check_code(kLayouts, p.weight_layout, where, "problem.weight_layout", "machmoe::WeightLayout");
  check_code(kScores, p.score, where, "problem.score", "machmoe::ScoreVariant");
  check_code(kRoutings, p.routing, where, "problem.routing", "machmoe::RoutingMode");
  check_code(kRoundings, p.rounding, where, "problem.rounding", "machmoe::RoundingRule");
  check_code(kCaches, p.cache, where, "problem.cache", "machmoe::CacheMode");
}

static std::string number(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

/// alpha and limit belong to gptoss_swiglu. With another activation they must keep their defaults: a caller who sets
/// a limit and forgets the activation would otherwise train an unclamped model without being told.
static void validate_activation_parameters(const MoEProblem& p, const char* where) {
  if (p.activation == Activation::kGptOssSwiGLU) {
    // The kernels (and the reference in fp32) compute with them as floats: a finite double beyond float's range
    // would become inf (alpha: NaN outputs), a limit below its smallest normal 0 or a denormal.
    constexpr double kFloatMax = std::numeric_limits<float>::max(), kFloatMin = std::numeric_limits<float>::min();
    if (!(std::fabs(p.swiglu_alpha) <= kFloatMax))  // also refuses NaN and inf
      throw_argument_error(where, "problem.swiglu_alpha",
                           "a finite real number of at most " + number(kFloatMax) + " in magnitude (a float)",
                           number(p.swiglu_alpha));
    if (!(p.swiglu_limit == std::numeric_limits<double>::infinity() ||
          (p.swiglu_limit >= kFloatMin && p.swiglu_limit <= kFloatMax)))  // also refuses NaN
      throw_argument_error(where, "problem.swiglu_limit",
                           "a real number > 0 that a float holds, in [" + number(kFloatMin) + ", " +
                               number(kFloatMax) + "] (+inf: no clamping)",
                           number(p.swiglu_limit));
    return;
  }
  // Built only on failure: the sizing functions (memory.hpp) validate the problem on every call.
  const auto why = [&] {
    return " (swiglu_alpha and swiglu_limit are parameters of activation 'gptoss_swiglu' only; this problem has "
           "activation '" + std::string(activation_name(p.activation)) + "')";
  };
  // Compared bitwise with the defaults on purpose: any other value was set by someone who meant it.
  if (!(p.swiglu_alpha == kGptOssSwiGLUAlpha))
    throw_argument_error(where, "problem.swiglu_alpha", "the default " + number(kGptOssSwiGLUAlpha) + why(),
                         number(p.swiglu_alpha));
  if (!(p.swiglu_limit == kGptOssSwiGLULimit))
    throw_argument_error(where, "problem.swiglu_limit", "the default " + number(kGptOssSwiGLULimit) + why(),
                         number(p.swiglu_limit));
}

void validate_problem(const MoEProblem& p, const char* where) {
  // T = 0 is ordinary work (an expert-parallel rank that received no tokens, a loader's last empty shard): the layer
  // returns empty outputs and zero weight gradients.
  check_range(where, "problem.T", p.T, 0, Limits::kMaxTokens);
  check_range(where, "problem.d", p.d, 1, Limits::kMaxDim);
  check_range(where, "problem.n", p.n, 1, Limits::kMaxDim);
  check_range(where, "problem.dx_chunks", p.dx_chunks, 0, Limits::kMaxDxChunks, " (0: the heuristic)");
  check_range(where, "problem.y_chunks", p.y_chunks, 0, Limits::kMaxDxChunks, " (0: the heuristic)");
  check_range(where, "problem.E", p.E, 1, Limits::kMaxExperts, " (expert ids are 16-bit in the metadata build)");
  check_range(where, "problem.K", p.K, 1, p.E, " (1 <= K <= E)");
  validate_options(p, where);
  if (!is_glu(p.activation) && p.weight_layout != WeightLayout::kInterleaved)
    throw_argument_error(where, "problem.weight_layout",
                         "'interleaved' for the non-GLU activation '" + std::string(activation_name(p.activation)) +
                             "' (a gate/up layout applies only to swiglu, geglu, reglu, gptoss_swiglu)",
                         "'" + std::string(weight_layout_name(p.weight_layout)) + "'");
  validate_activation_parameters(p, where);
  if (p.routing == RoutingMode::kTokenRounding) {
    if (p.tile_m < 8 || p.tile_m > Limits::kMaxTileM || p.tile_m % 8 != 0)
      throw_argument_error(where, "problem.tile_m",
                           "a positive multiple of 8 up to " + std::to_string(Limits::kMaxTileM),
                           std::to_string(p.tile_m));
  }
  if (p.routing == RoutingMode::kCallerSupplied) {
    check_range(where, "problem.num_pairs", p.num_pairs, 0, std::min<std::int64_t>(Limits::kMaxPairs, p.T * p.K),
                " (at most K pairs per token, fewer than 2^31 in all)");
  } else if (p.num_pairs != 0) {
    throw_argument_error(where, "problem.num_pairs", "0 unless routing is 'caller' (the router decides the pairs)",
                         std::to_string(p.num_pairs));
  }
  // T*K and the padded token-rounding count index int32 metadata on the device.
  if (p.T > Limits::kMaxPairs / p.K || p.max_pairs() > Limits::kMaxPairs)
    throw_argument_error(where, "problem.T*K",
                         "at most " + std::to_string(Limits::kMaxPairs) + " routed pairs (int32 routing metadata)",
                         std::to_string(p.T) + "*" + std::to_string(p.K) + " (max pairs " +
                             std::to_string(p.max_pairs()) + ")");
}

}  // namespace machmoe
