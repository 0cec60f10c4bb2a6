#include "cli_options.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <system_error>

#include "machmoe/error.hpp"

namespace machmoe::bench {

const std::vector<NamedConfig>& named_configs() {
  static const std::vector<NamedConfig> configs = {
      {"1.4B-256", 40960, 768, 256, 128, 8, ""},     {"1.4B-512", 40960, 768, 512, 64, 4, ""},
      {"1.4B-1024", 40960, 768, 1024, 32, 2, ""},    {"7B-256", 24576, 1536, 256, 128, 8, ""},
      {"7B-512", 24576, 1536, 512, 64, 4, ""},       {"7B-1024", 24576, 1536, 1024, 32, 2, ""},
      {"30B-256", 32768, 4096, 256, 256, 16, ""},    {"30B-512", 32768, 4096, 512, 128, 8, ""},
      {"30B-1024", 32768, 4096, 1024, 64, 4, ""},    {"120B-512", 32768, 4096, 512, 256, 16, ""},
      {"120B-1024", 32768, 4096, 1024, 128, 8, ""},  {"120B-2048", 32768, 4096, 2048, 64, 4, ""},
      {"cpu-small", 1536, 384, 64, 32, 4, "7B-256 scaled down (T/16, d/4, n/4, E/4, K/2) for the CPU reference"},
      // Odd shapes (target T13): gpt-oss experts, d = n = 2880 (edge tiles: not a multiple of 128), beside the nearest
      // multiple of 128 (2944); the same rows as the Python benchmark's "odd" group.
      {"gptoss20b-2880", 16384, 2880, 2880, 32, 4, "gpt-oss-20b experts: d = n = 2880, edge tiles (T13)"},
      {"gptoss20b-2944", 16384, 2944, 2944, 32, 4, "gptoss20b-2880 at the nearest multiple of 128 (T13)"},
      {"gptoss120b-2880", 16384, 2880, 2880, 128, 4, "gpt-oss-120b experts: d = n = 2880, edge tiles (T13)"},
      {"gptoss120b-2944", 16384, 2944, 2944, 128, 4, "gptoss120b-2880 at the nearest multiple of 128 (T13)"},
  };
  return configs;
}

namespace {

[[noreturn]] void bad(const std::string& option, const std::string& expected, const std::string& got) {
  throw_argument_error("machmoe-bench", option, expected, got);
}

/// A real number written in full (std::strtod over the whole text; "inf" is accepted, for --swiglu-limit).
double parse_real(const std::string& option, const std::string& text) {
  char* end = nullptr;
  const double v = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) bad(option, "a real number", "'" + text + "'");
  return v;
}

template <class F>
auto parse_enum(const std::string& option, const std::string& text, F&& f) {
  try {
    return f(text);
  } catch (const Error& e) {
    std::string msg = e.what();
    const std::string key = "expected ";
    const auto pos = msg.find(key);
    bad(option, pos == std::string::npos ? "a valid value" : msg.substr(pos + key.size(), msg.find(", got") - pos - key.size()),
        "'" + text + "'");
  }
}

const IntegerOption* integer_option(const std::string& name) {
  for (const IntegerOption& o : integer_options())
    if (name == o.name) return &o;
  return nullptr;
}

const char* const kFlags[] = {"--help", "-h", "--all-configs", "--profile", "--accumulate-grads"};
const char* const kTextOptions[] = {"--config", "--activation", "--bias", "--layout", "--score", "--routing",
                                    "--rounding", "--cache", "--dtype", "--backend", "--json", "--swiglu-alpha",
                                    "--swiglu-limit", "--grad-dtype"};
// Options that set one size of the problem, which --all-configs would overwrite.
const char* const kSizeOptions[] = {"--config", "--T", "--d", "--n", "--E", "--K"};

bool one_of(const std::string& a, const char* const* first, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    if (a == first[i]) return true;
  return false;
}
template <std::size_t N>
bool one_of(const std::string& a, const char* const (&list)[N]) {
  return one_of(a, list, N);
}

}  // namespace

const std::vector<IntegerOption>& integer_options() {
  // Each bound is what the library or the run can take: sizes as validate_problem allows them (K <= E and the
  // T*K pair limit are checked with the whole problem), repetitions so that a run ends.
  static const std::vector<IntegerOption> options = {
      {"--T", 1, Limits::kMaxTokens, "tokens"},
      {"--d", 1, Limits::kMaxDim, "hidden size"},
      {"--n", 1, Limits::kMaxDim, "expert intermediate size"},
      {"--E", 1, Limits::kMaxExperts, "experts"},
      {"--K", 1, Limits::kMaxExperts, "experts per token, at most E"},
      {"--tile", 8, Limits::kMaxTileM, "token-rounding tile, a multiple of 8"},
      {"--dx-chunks", 0, Limits::kMaxDxChunks, "chunks of tokens of the backward's dX~ (0: the heuristic)"},
      {"--y-chunks", 0, Limits::kMaxDxChunks, "chunks of tokens of the forward's Y (0: the heuristic)"},
      {"--iters", 1, kMaxRepetitions, "timed repetitions"},
      {"--warmup", 0, kMaxRepetitions, "untimed repetitions"},
      {"--warmup-ms", 0, kMaxWarmupMs, "milliseconds of untimed repetitions (GPU)"},
      {"--time-ms", 0, kMaxWarmupMs, "milliseconds of timed repetitions (GPU)"},
      {"--stage-runs", 1, kMaxStageRuns,
       "least instrumented runs of the stage timings (which also last --time-ms), median per stage"},
      {"--seed", 0, std::numeric_limits<std::int64_t>::max(), "random seed"},
      {"--sm-margin", 0, kMaxSmMargin, "SMs the expert GEMMs leave to other streams (GPU)"},
  };
  return options;
}

std::int64_t parse_integer(const std::string& option, const std::string& text, std::int64_t lo, std::int64_t hi) {
  const std::string expected = "a decimal integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  // std::from_chars takes exactly [-]digits (no '+', spaces, exponent or base prefix) and reports overflow, so
  // "4294967296" is read as itself, never wrapped to fit a narrower type.
  std::int64_t v = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  const std::from_chars_result r = std::from_chars(first, last, v, 10);
  if (r.ec == std::errc::result_out_of_range) bad(option, expected, "'" + text + "' (beyond the 64-bit range)");
  if (text.empty() || r.ec != std::errc() || r.ptr != last) bad(option, expected + " (digits only)", "'" + text + "'");
  if (v < lo || v > hi) bad(option, expected, "'" + text + "'");
  return v;
}

std::string usage() {
  std::string s =
      "usage: machmoe-bench [options]\n"
      "\n"
      "Runs one MoE layer forward and backward with the best backend available and prints the configuration,\n"
      "timings, model FLOPs and the memory accounting: on the GPU when one is present, else the CPU reference.\n"
      "\n"
      "Problem:\n"
      "  --config NAME        a named configuration (default: cpu-small without a GPU backend):\n";
  for (const NamedConfig& c : named_configs()) {
    s += "                         " + std::string(c.name) + "  T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) +
         " n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K);
    if (*c.note) s += "  (" + std::string(c.note) + ")";
    s += "\n";
  }
  s +=
      "  --T N, --d N, --n N, --E N, --K N\n"
      "                       override one size of the configuration\n"
      "  --activation NAME    swiglu (default), geglu, reglu, relu_squared, relu, gelu, silu, gptoss_swiglu\n"
      "  --swiglu-alpha X, --swiglu-limit X\n"
      "                       gptoss_swiglu's alpha and clamp limit (default 1.702 and 7; inf: no clamp)\n"
      "  --bias WHICH         none (default), b1, b2, both\n"
      "  --layout NAME        interleaved (default) or concatenated gate/up rows of W1 (GLU only)\n"
      "  --score NAME         softmax_topk (default), topk_softmax, topk_softmax_renorm\n"
      "  --routing NAME       topk (default) or token_rounding\n"
      "  --rounding NAME      nearest (default), up, down (token_rounding only)\n"
      "  --tile M             token-rounding tile, a multiple of 8 (default 128; token_rounding only)\n"
      "  --cache NAME         preact (default: keep X and H) or input_only (keep X, recompute H)\n"
      "  --dx-chunks N        backward: dX~ in N chunks of tokens (default 0: the library's heuristic; 1: one pass)\n"
      "  --y-chunks N         forward: Y in N chunks of tokens (default 0: the library's heuristic; 1: one pass)\n"
      "Gradients:\n"
      "  --grad-dtype NAME    GPU: the weight gradients' dtype, data (default: the data dtype) or fp32\n"
      "  --accumulate-grads   add the weight gradients into their buffers (gradient accumulation, e.g. an fp32\n"
      "                       main_grad with --grad-dtype fp32) instead of overwriting them\n"
      "Run:\n"
      "  --backend NAME       auto (default: the GPU when one is present), gpu or cpu\n"
      "  --dtype NAME         GPU: bf16 (default), fp16, fp32; CPU reference: fp32 (default), fp64\n"
      "  --iters N            timed repetitions, median reported (default 10 on the GPU, 3 on the CPU)\n"
      "  --time-ms N          GPU: and timed repetitions until N ms have passed (default 1000; 0: --iters only)\n"
      "  --warmup N           untimed repetitions first (default 3 on the GPU, 1 on the CPU)\n"
      "  --warmup-ms N        GPU: and untimed repetitions until N ms have passed, before every timed\n"
      "                       measurement (the layer's passes, each cuBLAS GEMM of the bound, the copy\n"
      "                       bandwidth), so each is timed at the clock a sustained load holds under the\n"
      "                       board's power cap (default 1000; 0: the --warmup count only)\n"
      "  --stage-runs N       GPU: at least N instrumented forward+backward runs behind the stage table, and\n"
      "                       more until --time-ms has passed (the clock swings under the power cap), median\n"
      "                       per stage (default 5; one run's stage figures spread by up to 15 %), each queued\n"
      "                       behind an uninstrumented forward+backward so that every stage is GPU time\n"
      "  --sm-margin N        GPU: the layer's expert GEMMs leave N SMs to other streams (set_sm_margin;\n"
      "                       default: MACHMOE_SM_MARGIN, else 0); the cuBLAS bound still uses every SM\n"
      "  --all-configs        run the 12 main configurations (GPU) and print a summary table\n"
      "  --json PATH          also write the results as a JSON array to PATH\n"
      "  --profile            GPU: one more forward and backward inside cudaProfilerStart/Stop, for\n"
      "                       ncu --profile-from-start off / nsys --capture-range=cudaProfilerApi;\n"
      "                       before it, the forward and the backward each 20 times back to back\n"
      "                       (ms each against one timed call) and the host's time to enqueue a call;\n"
      "                       after the stage runs, each pass called alone 20 times with its stages\n"
      "                       against the queued ones (where the GPU waited for the host)\n"
      "  --seed N             random seed of the inputs (default 0)\n"
      "  --help               this text (whatever other options are given)\n"
      "\n"
      "Numbers are decimal integers (digits, no sign, exponent or spaces) in these ranges:\n";
  for (const IntegerOption& o : integer_options())
    s += "  " + std::string(o.name) + std::string(12 - std::string(o.name).size(), ' ') + "[" + std::to_string(o.lo) +
         ", " + std::to_string(o.hi) + "]  " + o.what + "\n";
  s += "Each option may be given once.\n";
  return s;
}

Options parse_options(const std::vector<std::string>& args, bool have_gpu_backend) {
  Options o;
  // --help wins over everything else on the command line (unknown, repeated or invalid options, a --backend this
  // machine cannot run): asking for the usage never fails. A value of an option ("--json -h") is not a flag.
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      o.help = true;
      return o;
    }
    if (one_of(args[i], kTextOptions) || integer_option(args[i])) ++i;  // skip its value
  }
  // Pass 1: split the command line into flags and option values. Unknown options, a missing value and an option
  // given twice (one of the two values would be ignored) are errors before anything is interpreted.
  std::map<std::string, std::string> given;
  std::set<std::string> flags_given;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (one_of(a, kFlags)) {
      // Like an option with a value, a flag given twice is a mistake of the command line (usage(): "Each option may
      // be given once").
      if (!flags_given.insert(a).second) bad(a, "the option once", "it twice");
      o.all_configs = o.all_configs || a == "--all-configs";
      o.profile = o.profile || a == "--profile";
      o.accumulate_grads = o.accumulate_grads || a == "--accumulate-grads";
      continue;
    }
    if (a.rfind("--", 0) != 0) bad("command line", "options starting with '--' (see --help)", "'" + a + "'");
    if (!one_of(a, kTextOptions) && !integer_option(a))
      bad("command line", "a known option (see --help)", "unknown option '" + a + "'");
    if (i + 1 >= args.size()) bad(a, "a value after " + a, "nothing");
    const std::string& v = args[++i];
    const auto [it, first_time] = given.emplace(a, v);
    if (!first_time) bad(a, "the option once", "it twice ('" + it->second + "', then '" + v + "')");
  }
  auto has = [&](const char* name) { return given.count(name) != 0; };
  auto text = [&](const char* name, const std::string& fallback) { return has(name) ? given.at(name) : fallback; };
  auto integer = [&](const IntegerOption& opt) { return parse_integer(opt.name, given.at(opt.name), opt.lo, opt.hi); };

  const std::string backend = text("--backend", "auto");
  if (backend != "auto" && backend != "gpu" && backend != "cpu") bad("--backend", "one of {auto, gpu, cpu}", "'" + backend + "'");
  if (backend == "gpu" && !have_gpu_backend)
    bad("--backend", "auto or cpu (no GPU backend here: a CUDA build and a CUDA device are needed)", "'gpu'");
  o.backend = backend == "gpu" ? Backend::kGpu : backend == "cpu" ? Backend::kCpu : Backend::kAuto;
  o.gpu = have_gpu_backend && backend != "cpu";
  if (o.all_configs)
    for (const char* size : kSizeOptions)
      if (has(size))
        bad(size, "no configuration or size option with --all-configs (it runs the 12 main configurations as named)",
            "'" + given.at(size) + "'");
  o.config_name = text("--config", o.gpu ? "7B-256" : "cpu-small");
  const NamedConfig* cfg = nullptr;
  std::string names;
  for (const NamedConfig& c : named_configs()) {
    if (o.config_name == c.name) cfg = &c;
    names += (names.empty() ? "" : ", ") + std::string(c.name);
  }
  if (!cfg) bad("--config", "one of {" + names + "}", "'" + o.config_name + "'");
  MoEProblem& p = o.problem;
  p.T = cfg->T;
  p.d = cfg->d;
  p.n = cfg->n;
  p.E = cfg->E;
  p.K = cfg->K;

  bool sizes_overridden = false;
  for (const IntegerOption& opt : integer_options()) {
    if (!has(opt.name)) continue;
    const std::int64_t v = integer(opt);
    const std::string name = opt.name;
    if (name == "--T") p.T = v, sizes_overridden = true;
    else if (name == "--d") p.d = v, sizes_overridden = true;
    else if (name == "--n") p.n = v, sizes_overridden = true;
    else if (name == "--E") p.E = v, sizes_overridden = true;
    else if (name == "--K") p.K = v, sizes_overridden = true;
    else if (name == "--tile") {
      if (v % 8 != 0) bad(name, "a multiple of 8 in [8, " + std::to_string(opt.hi) + "]", "'" + given.at(name) + "'");
      p.tile_m = v;
    } else if (name == "--dx-chunks") p.dx_chunks = v;
    else if (name == "--y-chunks") p.y_chunks = v;
    else if (name == "--iters") o.iters = static_cast<int>(v);  // <= kMaxRepetitions: fits an int
    else if (name == "--warmup") o.warmup = static_cast<int>(v);
    else if (name == "--warmup-ms") o.warmup_ms = static_cast<int>(v);
    else if (name == "--time-ms") o.timed_ms = static_cast<int>(v);
    else if (name == "--stage-runs") o.stage_runs = static_cast<int>(v);
    else if (name == "--seed") o.seed = static_cast<std::uint64_t>(v);
    else if (name == "--sm-margin") o.sm_margin = static_cast<int>(v);  // <= kMaxSmMargin: fits an int
  }
  if (has("--activation")) p.activation = parse_enum("--activation", given.at("--activation"), parse_activation);
  for (const char* param : {"--swiglu-alpha", "--swiglu-limit"}) {
    if (!has(param)) continue;
    // Like the library (validate_problem): parameters of gptoss_swiglu only, so a run never ignores one.
    if (p.activation != Activation::kGptOssSwiGLU)
      bad(param, "--activation gptoss_swiglu with it (it is a parameter of that activation only)",
          "'" + given.at(param) + "' with activation '" + activation_name(p.activation) + "'");
    (std::string(param) == "--swiglu-alpha" ? p.swiglu_alpha : p.swiglu_limit) = parse_real(param, given.at(param));
  }
  if (has("--layout")) p.weight_layout = parse_enum("--layout", given.at("--layout"), parse_weight_layout);
  if (has("--score")) p.score = parse_enum("--score", given.at("--score"), parse_score_variant);
  if (has("--routing")) p.routing = parse_enum("--routing", given.at("--routing"), parse_routing_mode);
  if (has("--rounding")) p.rounding = parse_enum("--rounding", given.at("--rounding"), parse_rounding_rule);
  if (has("--cache")) p.cache = parse_enum("--cache", given.at("--cache"), parse_cache_mode);
  if (p.routing == RoutingMode::kCallerSupplied)
    bad("--routing", "topk or token_rounding (caller-supplied triples come from the API, not the command line)",
        "'caller'");
  // The rounding rule and the tile only mean something to token rounding; accepting them otherwise would let a
  // run silently measure something else than what was asked for.
  for (const char* tr_only : {"--rounding", "--tile"})
    if (has(tr_only) && p.routing != RoutingMode::kTokenRounding)
      bad(tr_only, "--routing token_rounding with it (it applies to token rounding only)",
          "'" + given.at(tr_only) + "' with routing '" + routing_mode_name(p.routing) + "'");
  const std::string bias = text("--bias", "none");
  if (bias != "none" && bias != "b1" && bias != "b2" && bias != "both")
    bad("--bias", "one of {none, b1, b2, both}", "'" + bias + "'");
  if (has("--json")) {
    o.json_path = given.at("--json");
    if (o.json_path.empty()) bad("--json", "a file path", "''");
  }

  const std::string dtype = text("--dtype", o.gpu ? "bf16" : "fp32");
  if (o.gpu) {
    if (dtype == "bf16") o.dtype = DType::kBF16;
    else if (dtype == "fp16") o.dtype = DType::kFP16;
    else if (dtype == "fp32") o.dtype = DType::kFP32;
    else bad("--dtype", "bf16, fp16 or fp32 on the GPU", "'" + dtype + "'");
  } else {
    if (dtype == "fp32") o.dtype = DType::kFP32;
    else if (dtype == "fp64") o.dtype = DType::kFP64;
    else bad("--dtype", "fp32 or fp64 on the CPU reference", "'" + dtype + "'");
  }
  o.grad_dtype = o.dtype;
  if (has("--grad-dtype")) {
    const std::string g = given.at("--grad-dtype");
    if (!o.gpu)
      bad("--grad-dtype", "a GPU backend (the CPU reference keeps its gradients in the data dtype)", "the CPU");
    if (g == "fp32") o.grad_dtype = DType::kFP32;
    else if (g != "data") bad("--grad-dtype", "data or fp32", "'" + g + "'");
  }
  if (!has("--iters")) o.iters = o.gpu ? 10 : 3;
  if (!has("--warmup")) o.warmup = o.gpu ? 3 : 1;
  for (const char* gpu_only : {"--warmup-ms", "--time-ms"})
    if (has(gpu_only) && !o.gpu)
      bad(gpu_only, "a GPU backend (it times the board at the clock of a sustained load)", "the CPU");
  // The CPU reference has no stage table: a --stage-runs it would ignore is refused like the other GPU timings.
  if (has("--stage-runs") && !o.gpu)
    bad("--stage-runs", "a GPU backend (it sets the instrumented runs of the GPU's stage table)", "the CPU");
  if (!has("--warmup-ms")) o.warmup_ms = o.gpu ? static_cast<int>(kGpuWarmupMs) : 0;
  if (!has("--time-ms")) o.timed_ms = o.gpu ? static_cast<int>(kGpuTimedMs) : 0;
  if (o.all_configs && !o.gpu)
    bad("--all-configs", "a GPU backend (the CPU reference would take hours on the main configurations)", "the CPU");
  if (o.profile && !o.gpu) bad("--profile", "a GPU backend (it marks a CUDA profiler capture range)", "the CPU");
  if (has("--sm-margin") && !o.gpu)
    bad("--sm-margin", "a GPU backend (it cuts the expert GEMMs' grids; the CPU reference has none)", "the CPU");

  p.has_b1 = bias == "b1" || bias == "both";
  p.has_b2 = bias == "b2" || bias == "both";
  if (sizes_overridden) o.config_name += " (sizes overridden)";
  validate_problem(p, "machmoe-bench");
  return o;
}

}  // namespace machmoe::bench

namespace machmoe::bench {

namespace {

/// A real number as JSON: the shortest text that reads back as the same double; "inf"/"-inf"/"nan" as strings.
std::string json_real(double v) {
  if (std::isnan(v)) return "\"nan\"";
  if (std::isinf(v)) return v > 0 ? "\"inf\"" : "\"-inf\"";
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace

std::string problem_json_members(const Options& o) {
  const MoEProblem& p = o.problem;
  const char* bias = p.has_b1 ? (p.has_b2 ? "both" : "b1") : (p.has_b2 ? "b2" : "none");
  auto str = [](const char* key, const std::string& v) { return "\"" + std::string(key) + "\":\"" + v + "\""; };
  auto num = [](const char* key, const std::string& v) { return "\"" + std::string(key) + "\":" + v; };
  return str("activation", activation_name(p.activation)) + "," + num("swiglu_alpha", json_real(p.swiglu_alpha)) +
         "," + num("swiglu_limit", json_real(p.swiglu_limit)) + "," + str("bias", bias) + "," +
         str("layout", weight_layout_name(p.weight_layout)) + "," + str("score", score_variant_name(p.score)) + "," +
         str("routing", routing_mode_name(p.routing)) + "," + str("rounding", rounding_rule_name(p.rounding)) + "," +
         num("tile", std::to_string(p.tile_m)) + "," + str("cache", cache_mode_name(p.cache)) + "," +
         num("dx_chunks", std::to_string(p.dx_chunks)) + "," + num("y_chunks", std::to_string(p.y_chunks)) + "," +
         str("grad_dtype", dtype_name(o.grad_dtype)) + "," +
         num("accumulate_grads", o.accumulate_grads ? "true" : "false");
}

int write_json(const std::string& path, const std::vector<std::string>& objects) {
  if (path.empty()) return 0;
  auto fail = [&](const char* what, int err) {
    std::fprintf(stderr, "error: cannot %s --json file '%s': %s\n", what, path.c_str(),
                 err ? std::strerror(err) : "I/O error");
    return 1;
  };
  errno = 0;
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return fail("open", errno);
  std::fputs("[\n", f);
  for (std::size_t i = 0; i < objects.size(); ++i)
    std::fprintf(f, "  %s%s\n", objects[i].c_str(), i + 1 < objects.size() ? "," : "");
  std::fputs("]\n", f);
  // Buffered writes fail late (a full disk shows at the flush): check the stream, then the close.
  errno = 0;
  const bool flushed = std::fflush(f) == 0 && !std::ferror(f);
  const int flush_errno = errno;
  errno = 0;
  const bool closed = std::fclose(f) == 0;
  if (!flushed) return fail("write", flush_errno);
  if (!closed) return fail("close", errno);
  return 0;
}

std::string cpu_run_gpu_line(const Options& o, int gpus, const std::string& description) {
  if (gpus <= 0) return "gpu:      none found; running the CPU reference";
  return "gpu:      " + description +
         (o.backend == Backend::kCpu ? " (not used: --backend cpu; running the CPU reference)"
                                     : " (not used; running the CPU reference)");
}

std::vector<Options> main_config_runs(const Options& base) {
  std::vector<Options> runs;
  for (const NamedConfig& c : named_configs()) {
    if (*c.note) continue;  // the CPU default and the odd-shape rows are not main configurations
    Options o = base;
    o.config_name = c.name;
    o.problem.T = c.T, o.problem.d = c.d, o.problem.n = c.n, o.problem.E = c.E, o.problem.K = c.K;
    runs.push_back(o);
  }
  return runs;
}

}  // namespace machmoe::bench
