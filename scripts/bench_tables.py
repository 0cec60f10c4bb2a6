#!/usr/bin/env python3
"""Markdown tables from machmoe-bench's JSON output (`--json PATH`), in the form docs/BENCHMARKS.md quotes them.

  python3 scripts/bench_tables.py stages RUN.json
      One row per configuration: the two passes (ms and efficiency against the cuBLAS bound), what the stage table
      adds up to over each pass (1.0: the stages account for the pass; since session 61 the instrumented runs last
      --time-ms like the passes, so they do within a few %), and each expert GEMM's stage with cuBLAS's time for the
      same GEMM over it, plus the routing stages' sum (ROUTING_STAGES below).
  python3 scripts/bench_tables.py passes RUN.json [RECOMPUTE.json]
      One row per configuration: the two passes and their sum, activation memory (accounted by the layer, and the
      driver's measurement) and the peak over forward + backward, in MiB; with a second run of the recompute mode
      (`--cache input_only`), its forward + backward over RUN's (T7) and its memory beside RUN's.
  python3 scripts/bench_tables.py compare BASE.json OTHER.json
      One row per configuration in both files (matched by the sizes and every option but the cache mode: OPTIONS
      below): forward + backward of each and OTHER over BASE; e.g. T7 with BASE the default cache and OTHER
      `--cache input_only` (docs/TARGETS.md). A configuration of the same sizes run with other options is not
      compared: its row says which options differ ("not recorded": a JSON from before the benchmark recorded them).
"""
import json
import re
import sys

# machmoe-bench's main configurations are named <model>-<n>; the docs name them <model> (n,E,K).
MAIN_NAME = re.compile(r"^(1\.4B|7B|30B|120B)-\d+$")
GEMM_STAGES = (("up-projection", "forward/up_projection"), ("down-projection", "forward/down_projection"),
               ("dH kernel", "backward/dh_kernel"), ("dX̃", "backward/dx_expanded"), ("dW1", "backward/dw1"),
               ("dW2", "backward/dw2"))
# The routing stages: the router GEMM, the selection (top-K, token rounding or the caller's pairs), the metadata and,
# where it is a stage of its own, the plan of the forward's chunks of tokens.
ROUTING_STAGES = ("forward/router_gemm", "forward/topk_scores", "forward/routing_metadata", "forward/token_rounding",
                  "forward/caller_routing", "forward/y_chunk_plan")


def row_name(run):
    """'1.4B (256,128,8)' for a main configuration, '(T,d,n,E,K)' for any other."""
    m = MAIN_NAME.match(run["config"])
    if m:
        return f"{m.group(1)} ({run['n']},{run['E']},{run['K']})"
    return "({},{},{},{},{})".format(run["T"], run["d"], run["n"], run["E"], run["K"])


def stage_sums(run):
    """(forward, backward) sums of the stage table: the benchmark's own since session 61, else added up here."""
    if "stage_sum_forward_ms" in run:
        return run["stage_sum_forward_ms"], run["stage_sum_backward_ms"]
    stages = run.get("stages_ms", {})
    fwd = sum(ms for s, ms in stages.items() if s.startswith("forward/"))
    return fwd, sum(stages.values()) - fwd


def stages_table(runs):
    lines = ["| config | forward ms (eff.) | backward ms (eff.) | stages / passes, fwd · bwd (runs) | " +
             " | ".join(name for name, _ in GEMM_STAGES) + " | routing ms |",
             "|---" * (5 + len(GEMM_STAGES)) + "|"]
    for r in runs:
        fwd, bwd = stage_sums(r)
        stages, cublas = r.get("stages_ms", {}), r.get("cublas_stage_ms", {})
        cells = []
        for _, key in GEMM_STAGES:
            ms = stages.get(key)
            if not ms:
                cells.append("-")
            elif cublas.get(key):
                cells.append(f"{ms:.3f} ({cublas[key] / ms:.2f})")
            else:
                cells.append(f"{ms:.3f}")
        routing = sum(stages.get(s, 0.0) for s in ROUTING_STAGES)
        lines.append(f"| {row_name(r)} | {r['forward_ms']:.3f} ({r['efficiency_forward']:.3f}) | "
                     f"{r['backward_ms']:.3f} ({r['efficiency_backward']:.3f}) | "
                     f"{fwd / r['forward_ms']:.3f} · {bwd / r['backward_ms']:.3f} ({r.get('stage_runs', '-')}) | " +
                     " | ".join(cells) + f" | {routing:.3f} |")
    return "\n".join(lines)


MIB = 1024.0 * 1024.0


def passes_table(runs, recompute_runs=None):
    others = {}
    for r in recompute_runs or []:
        others.setdefault(match_key(r), []).append(r)
    with_other = recompute_runs is not None
    header = "| config | forward ms (eff.) | backward ms (eff.) | forward + backward ms |"
    if with_other:
        header += (" recompute mode: forward + backward ms (over the default's, T7) | activation MiB, accounted /"
                   " measured: default · recompute | peak MiB: default · recompute |")
    else:
        header += " activation MiB, accounted / measured | peak MiB |"
    lines = [header, "|---" * (7 if with_other else 6) + "|"]

    def memory(r):
        return (f"{r['activation_bytes_accounted'] / MIB:.1f} / {r['activation_bytes_measured'] / MIB:.0f}",
                f"{r['peak_bytes'] / MIB:.0f}")

    for r in runs:
        total = r["forward_ms"] + r["backward_ms"]
        line = (f"| {row_name(r)} | {r['forward_ms']:.3f} ({r['efficiency_forward']:.3f}) | "
                f"{r['backward_ms']:.3f} ({r['efficiency_backward']:.3f}) | {total:.3f} |")
        act, peak = memory(r)
        if with_other:
            o = others.get(match_key(r), [None])[0]
            if o is None:
                line += f" - | {act} · - | {peak} · - |"
            else:
                o_total = o["forward_ms"] + o["backward_ms"]
                o_act, o_peak = memory(o)
                line += f" {o_total:.3f} ({o_total / total:.3f}) | {act} · {o_act} | {peak} · {o_peak} |"
        else:
            line += f" {act} | {peak} |"
        lines.append(line)
    return "\n".join(lines)


# The options of a run that change what is timed, as machmoe-bench's JSON records them (bench::problem_json_members),
# but the cache mode, which `passes` and `compare` exist to set against each other. Older JSON lacks some (the GPU's
# recorded neither routing, bias, score, layout, tile, rounding, chunks nor the swiglu parameters at first): a missing
# option only matches a missing one, so a run of unknown options is never paired with one of known options.
OPTIONS = ("activation", "swiglu_alpha", "swiglu_limit", "bias", "layout", "score", "routing", "rounding", "tile",
           "dx_chunks", "y_chunks", "dtype", "grad_dtype", "accumulate_grads")


def sizes(run):
    return (run["T"], run["d"], run["n"], run["E"], run["K"])


def match_key(run):
    """What must agree for two runs to be compared: the sizes and every option but the cache mode."""
    return sizes(run) + tuple(run.get(k) for k in OPTIONS)


def option_differences(a, b):
    """'routing topk / token_rounding, bias none / both' for the options in which runs a and b differ."""
    def text(run, k):
        return str(run[k]) if k in run else "not recorded"
    return ", ".join(f"{k} {text(a, k)} / {text(b, k)}" for k in OPTIONS
                     if a.get(k) != b.get(k) or (k in a) != (k in b))


def compare_table(base_runs, other_runs):
    others = {}
    for r in other_runs:
        others.setdefault(match_key(r), []).append(r)
    lines = ["| config | base: forward + backward ms | other: forward + backward ms | other / base |",
             "|---|---|---|---|"]
    for b in base_runs:
        tb = b["forward_ms"] + b["backward_ms"]
        matches = others.get(match_key(b), [])
        for o in matches[:1]:
            to = o["forward_ms"] + o["backward_ms"]
            lines.append(f"| {row_name(b)} | {b['forward_ms']:.3f} + {b['backward_ms']:.3f} = {tb:.3f} | "
                         f"{o['forward_ms']:.3f} + {o['backward_ms']:.3f} = {to:.3f} | {to / tb:.3f} |")
        if matches:
            continue
        # The same sizes run with other options: say so rather than pair unlike runs (or drop the row silently).
        unlike = [o for o in other_runs if sizes(o) == sizes(b)]
        if unlike:
            lines.append(f"| {row_name(b)} | {b['forward_ms']:.3f} + {b['backward_ms']:.3f} = {tb:.3f} | - | "
                         f"not compared, options differ (base / other): {option_differences(b, unlike[0])} |")
    return "\n".join(lines)


def load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def main(argv):
    if len(argv) == 2 and argv[0] == "stages":
        print(stages_table(load(argv[1])))
        return 0
    if len(argv) in (2, 3) and argv[0] == "passes":
        print(passes_table(load(argv[1]), load(argv[2]) if len(argv) == 3 else None))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        print(compare_table(load(argv[1]), load(argv[2])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
