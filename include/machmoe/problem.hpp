// What one MoE layer computes: sizes and every option of the layer. Shared by the CPU reference, the GPU
// runtime and the bindings, so one description means one function everywhere (docs/SPEC.md).
#pragma once

#include <cstdint>
#include <string>

namespace machmoe {

/// Expert activation. GLU activations act on a (gate, up) pair: a = act(gate) * up, and W1 has 2n rows per
/// expert. Non-GLU activations act elementwise on n pre-activations, and W1 has n rows per expert.
enum class Activation : int {
  kSwiGLU,       // silu(g) * u
  kGeGLU,        // gelu_tanh(g) * u
  kReGLU,        // relu(g) * u
  kReLUSquared,  // relu(h)^2
  kReLU,         // relu(h)
  kGELU,         // gelu with the tanh approximation
  kSiLU,         // h * sigmoid(h)
  // gpt-oss's expert MLP (HF transformers GptOssExperts), a GLU with clamps and a shifted up:
  //   g' = min(g, limit), u' = clamp(u, -limit, limit), a = g' sigmoid(alpha g') (u' + 1)
  // with alpha = MoEProblem::swiglu_alpha, limit = MoEProblem::swiglu_limit (1.702 and 7 in gpt-oss).
  kGptOssSwiGLU,
};

/// gpt-oss's defaults for the parameters of Activation::kGptOssSwiGLU (HF GptOssExperts.alpha, config.swiglu_limit).
inline constexpr double kGptOssSwiGLUAlpha = 1.702;
inline constexpr double kGptOssSwiGLULimit = 7.0;
bool is_glu(Activation act);

/// Where the gate and up rows of a GLU expert's W1 (2n x d) live.
enum class WeightLayout : int {
  kInterleaved,   // rows alternate gate_0, up_0, gate_1, up_1, ...
  kConcatenated,  // rows [0, n) are gate, rows [n, 2n) are up (HF gate_up_proj / vLLM convention)
};

/// How router scores are made from the logits z_t (all variants select the top-K logits, ties to the lower
/// expert index).
enum class ScoreVariant : int {
  kSoftmaxOverTopK,       // s_k = softmax over the K selected logits (SonicMoE default)
  kTopKOfSoftmax,         // s_k = softmax(z_t)[i_k] over all E experts (Qwen3 style, no renormalisation)
  kTopKOfSoftmaxRenorm,   // s_k = softmax(z_t)[i_k] / sum_j softmax(z_t)[i_j]
};

enum class RoutingMode : int {
  kTopK,            // token choice: each token picks its top-K experts
  kTokenRounding,   // token choice, then each expert's count rounded to a multiple of tile_m (docs/SPEC.md §5)
  kCallerSupplied,  // the caller gives (token, expert, score) triples, token-sorted
};

/// Token-rounding rule per expert (docs/SPEC.md §5.2).
enum class RoundingRule : int {
  kNearest,  // NR-f: round up iff strictly closer to the upper tile multiple (ties round down)
  kUp,       // always up: pad with the best-scored non-chosen tokens
  kDown,     // always down: drop the worst-scored chosen tokens of the last partial tile
};

/// What the forward keeps for the backward.
enum class CacheMode : int {
  kPreActivation,  // keep X and H (pre-activation): 2Td + 4TKn bytes + metadata in bf16 (default)
  kInputOnly,      // keep only X; H is recomputed in the backward (one more up-projection GEMM)
};

/// Documented limits. Routing metadata is int32 on the device; expert ids must fit the 16-bit key of the
/// deterministic metadata build.
struct Limits {
  static constexpr std::int64_t kMaxExperts = 65536;
  static constexpr std::int64_t kMaxPairs = 2147483647;  // T*K (and token-rounded pair counts) < 2^31
  static constexpr std::int64_t kMaxTokens = 2147483647;
  static constexpr std::int64_t kMaxDim = 1 << 20;         // d and n
  static constexpr std::int64_t kMaxTileM = 4096;
  static constexpr std::int64_t kMaxDxChunks = 1024;
};

struct MoEProblem {
  std::int64_t T = 0;  // tokens; 0 is valid (empty outputs, zero weight gradients, no kernel launched)
  std::int64_t d = 0;  // hidden size
  std::int64_t n = 0;  // expert intermediate size (per half for GLU)
  std::int64_t E = 0;  // experts
  std::int64_t K = 0;  // experts per token (top-K). For caller-supplied routing: the maximum per token.
  Activation activation = Activation::kSwiGLU;
  // Parameters of Activation::kGptOssSwiGLU: sigmoid(alpha g) in the gate, the clamp limit (finite alpha, limit > 0;
  // +inf turns the clamps off). Other activations have no parameters: these must then keep their defaults, so that
  // a limit meant for gpt-oss is not silently ignored by a layer built with another activation.
  double swiglu_alpha = kGptOssSwiGLUAlpha;
  double swiglu_limit = kGptOssSwiGLULimit;
  bool has_b1 = false;  // expert bias of the up-projection, (E, 2n) or (E, n)
  bool has_b2 = false;  // expert bias of the down-projection, (E, d)
  WeightLayout weight_layout = WeightLayout::kInterleaved;
  ScoreVariant score = ScoreVariant::kSoftmaxOverTopK;
  RoutingMode routing = RoutingMode::kTopK;
  RoundingRule rounding = RoundingRule::kNearest;  // token rounding only
  std::int64_t tile_m = 128;                       // token rounding only: M, a positive multiple of 8
  CacheMode cache = CacheMode::kPreActivation;
  std::int64_t num_pairs = 0;  // caller-supplied routing only: number of (token, expert, score) triples (0: out = 0)
  // GPU backward memory: the per-pair input gradient dX~ (P x d, the backward's largest transient when d > n) is
  // computed and summed into dX in this many chunks of tokens, holding one chunk's rows at a time
  // (memory.hpp, backward_dx_chunks). 0: the heuristic; 1: all at once. Results are bitwise the same for every
  // value; more chunks cost a partial GEMM tile per expert and chunk.
  std::int64_t dx_chunks = 0;
  // GPU forward memory: the down-projection's output Y (P x d, the forward's largest transient when d > n) is
  // computed and summed into the output in this many chunks of tokens (memory.hpp, forward_y_chunks). 0: the
  // heuristic; 1: all at once. Results are bitwise the same for every value.
  std::int64_t y_chunks = 0;

  /// Rows of W1 per expert: 2n for GLU activations, n otherwise.
  std::int64_t w1_rows() const;
  /// Routed (token, expert) pairs the layer can produce: T*K for top-K, the caller's count for caller-supplied
  /// routing, and an upper bound for token rounding by its rule (down: T*K; nearest: each expert with a partial tile
  /// adds at most tile_m/2 - 1 pairs; up: at most tile_m - 1; never more than T*E), which is what buffers must be
  /// sized for since the exact count is only known on the device.
  std::int64_t max_pairs() const;
  /// Whether the router's logits must be kept for the backward: top-K of the full softmax without
  /// renormalisation, and token rounding, have a dense gradient over all E logits.
  bool keeps_router_logits() const;
  /// Whether the gradient of the router's logits is nonzero only at each token's K selections: top-K routing with
  /// a score that is renormalised over the selections (every score variant but top-K of the full softmax). The
  /// backward then sums the router's term of dX from the pairs (memory.hpp, router_pair_terms).
  bool logit_grad_at_selections() const;
  /// Whether the routing produces a variable number of experts per token (per-token offsets needed).
  bool variable_k() const;
  std::string to_string() const;
};

/// Throws machmoe::Error naming the field, what was expected and what was given. The option fields are checked
/// to hold one of their enum's values (a value cast from an unchecked integer may hold any int), before any check
/// that depends on them.
void validate_problem(const MoEProblem& problem, const char* where = "validate_problem");

// Names used by the command line, the bindings and error messages, and their inverses (which throw
// machmoe::Error listing the accepted names).
const char* activation_name(Activation v);
const char* weight_layout_name(WeightLayout v);
const char* score_variant_name(ScoreVariant v);
const char* routing_mode_name(RoutingMode v);
const char* rounding_rule_name(RoundingRule v);
const char* cache_mode_name(CacheMode v);
Activation parse_activation(const std::string& s);
WeightLayout parse_weight_layout(const std::string& s);
ScoreVariant parse_score_variant(const std::string& s);
RoutingMode parse_routing_mode(const std::string& s);
RoundingRule parse_rounding_rule(const std::string& s);
CacheMode parse_cache_mode(const std::string& s);

// Integer codes of the options (the enums' values), as bindings carry them (the PyTorch operators' `int`
// arguments). Each returns the enum when `code` is one of its values; otherwise it throws machmoe::Error naming
// `where` and `arg`, listing every valid name with its value, and printing `code`. They take the full 64-bit
// value, so a code that does not fit an int (2^32, say) is rejected rather than wrapped onto a valid one.
Activation activation_from_code(std::int64_t code, const std::string& where, const std::string& arg);
WeightLayout weight_layout_from_code(std::int64_t code, const std::string& where, const std::string& arg);
ScoreVariant score_variant_from_code(std::int64_t code, const std::string& where, const std::string& arg);
RoutingMode routing_mode_from_code(std::int64_t code, const std::string& where, const std::string& arg);
RoundingRule rounding_rule_from_code(std::int64_t code, const std::string& where, const std::string& arg);
CacheMode cache_mode_from_code(std::int64_t code, const std::string& where, const std::string& arg);

}  // namespace machmoe
