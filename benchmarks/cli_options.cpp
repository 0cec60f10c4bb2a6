#include "cli_options.hpp"

#include <cerrno>
#include <cstdlib>

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
  };
  return configs;
}

namespace {

[[noreturn]] void bad(const std::string& option, const std::string& expected, const std::string& got) {
  throw_argument_error("machmoe-bench", option, expected, got);
}

std::int64_t parse_int(const std::string& option, const std::string& text, std::int64_t lo) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < lo)
    bad(option, "an integer >= " + std::to_string(lo), "'" + text + "'");
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

}  // namespace

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
      "  --activation NAME    swiglu (default), geglu, reglu, relu_squared, relu, gelu, silu\n"
      "  --bias WHICH         none (default), b1, b2, both\n"
      "  --layout NAME        interleaved (default) or concatenated gate/up rows of W1 (GLU only)\n"
      "  --score NAME         softmax_topk (default), topk_softmax, topk_softmax_renorm\n"
      "  --routing NAME       topk (default) or token_rounding\n"
      "  --rounding NAME      nearest (default), up, down (token_rounding only)\n"
      "  --tile M             token-rounding tile, a positive multiple of 8 (default 128)\n"
      "  --cache NAME         preact (default: keep X and H) or input_only (keep X, recompute H)\n"
      "Run:\n"
      "  --backend NAME       auto (default: the GPU when one is present), gpu or cpu\n"
      "  --dtype NAME         GPU: bf16 (default), fp16, fp32; CPU reference: fp32 (default), fp64\n"
      "  --iters N            timed repetitions, median reported (default 10 on the GPU, 3 on the CPU)\n"
      "  --warmup N           untimed repetitions first (default 3 on the GPU, 1 on the CPU)\n"
      "  --all-configs        run the 12 main configurations (GPU) and print a summary table\n"
      "  --json PATH          also write the results as a JSON array to PATH\n"
      "  --profile            GPU: one more forward inside cudaProfilerStart/Stop, for\n"
      "                       ncu --profile-from-start off / nsys --capture-range=cudaProfilerApi\n"
      "  --seed N             random seed of the inputs (default 0)\n"
      "  --help               this text\n";
  return s;
}

Options parse_options(const std::vector<std::string>& args, bool have_gpu_backend) {
  Options o;
  std::string bias = "none", dtype, backend = "auto";
  bool sizes_overridden = false, iters_given = false, warmup_given = false;
  // First pass: the backend and the configuration, so that defaults and size overrides apply whatever the order.
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--backend") backend = args[i + 1];
  if (backend != "auto" && backend != "gpu" && backend != "cpu") bad("--backend", "one of {auto, gpu, cpu}", "'" + backend + "'");
  if (backend == "gpu" && !have_gpu_backend)
    bad("--backend", "auto or cpu (no GPU backend here: a CUDA build and a CUDA device are needed)", "'gpu'");
  o.backend = backend == "gpu" ? Backend::kGpu : backend == "cpu" ? Backend::kCpu : Backend::kAuto;
  o.gpu = have_gpu_backend && backend != "cpu";
  o.config_name = o.gpu ? "7B-256" : "cpu-small";
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--config") o.config_name = args[i + 1];
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

  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      continue;
    }
    if (a == "--all-configs") {
      o.all_configs = true;
      continue;
    }
    if (a == "--profile") {
      o.profile = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) bad("command line", "options starting with '--' (see --help)", "'" + a + "'");
    static const char* known[] = {"--config", "--T", "--d", "--n", "--E", "--K", "--activation", "--bias",
                                  "--layout", "--score", "--routing", "--rounding", "--tile", "--cache",
                                  "--dtype", "--iters", "--warmup", "--seed", "--backend", "--json"};
    bool is_known = false;
    for (const char* k : known) is_known = is_known || a == k;
    if (!is_known) bad("command line", "a known option (see --help)", "unknown option '" + a + "'");
    if (i + 1 >= args.size()) bad(a, "a value after " + a, "nothing");
    const std::string v = args[++i];
    if (a == "--config" || a == "--backend") continue;
    if (a == "--T") p.T = parse_int(a, v, 1), sizes_overridden = true;
    else if (a == "--d") p.d = parse_int(a, v, 1), sizes_overridden = true;
    else if (a == "--n") p.n = parse_int(a, v, 1), sizes_overridden = true;
    else if (a == "--E") p.E = parse_int(a, v, 1), sizes_overridden = true;
    else if (a == "--K") p.K = parse_int(a, v, 1), sizes_overridden = true;
    else if (a == "--activation") p.activation = parse_enum(a, v, parse_activation);
    else if (a == "--layout") p.weight_layout = parse_enum(a, v, parse_weight_layout);
    else if (a == "--score") p.score = parse_enum(a, v, parse_score_variant);
    else if (a == "--routing") p.routing = parse_enum(a, v, parse_routing_mode);
    else if (a == "--rounding") p.rounding = parse_enum(a, v, parse_rounding_rule);
    else if (a == "--tile") p.tile_m = parse_int(a, v, 1);
    else if (a == "--cache") p.cache = parse_enum(a, v, parse_cache_mode);
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(a, v, 1)), iters_given = true;
    else if (a == "--warmup") o.warmup = static_cast<int>(parse_int(a, v, 0)), warmup_given = true;
    else if (a == "--json") o.json_path = v;
    else if (a == "--seed") o.seed = static_cast<std::uint64_t>(parse_int(a, v, 0));
    else if (a == "--bias") {
      if (v != "none" && v != "b1" && v != "b2" && v != "both") bad(a, "one of {none, b1, b2, both}", "'" + v + "'");
      bias = v;
    } else if (a == "--dtype") {
      dtype = v;
    }
  }
  if (dtype.empty()) dtype = o.gpu ? "bf16" : "fp32";
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
  if (!iters_given) o.iters = o.gpu ? 10 : 3;
  if (!warmup_given) o.warmup = o.gpu ? 3 : 1;
  if (o.all_configs && !o.gpu)
    bad("--all-configs", "a GPU backend (the CPU reference would take hours on the main configurations)", "the CPU");
  if (o.profile && !o.gpu) bad("--profile", "a GPU backend (it marks a CUDA profiler capture range)", "the CPU");

  p.has_b1 = bias == "b1" || bias == "both";
  p.has_b2 = bias == "b2" || bias == "both";
  if (p.routing == RoutingMode::kCallerSupplied)
    bad("--routing", "topk or token_rounding (caller-supplied triples come from the API, not the command line)",
        "'caller'");
  if (sizes_overridden) o.config_name += " (sizes overridden)";
  validate_problem(p, "machmoe-bench");
  return o;
}

}  // namespace machmoe::bench

namespace machmoe::bench {

std::vector<Options> main_config_runs(const Options& base) {
  std::vector<Options> runs;
  for (const NamedConfig& c : named_configs()) {
    if (std::string(c.name) == "cpu-small") continue;
    Options o = base;
    o.config_name = c.name;
    o.problem.T = c.T, o.problem.d = c.d, o.problem.n = c.n, o.problem.E = c.E, o.problem.K = c.K;
    runs.push_back(o);
  }
  return runs;
}

}  // namespace machmoe::bench
