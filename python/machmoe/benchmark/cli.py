"""python -m machmoe.benchmark: machmoe against what users run today, on one device, with JSON, PNG plots and
Markdown tables. `--help` lists the options; docs/BENCHMARKS.md says how the published figures were produced."""
import argparse
import datetime
import json
import math
import os
import shlex
import sys
from typing import List, Optional

import torch

from . import configs as C
from . import impls as I
from .peers import PEERS, available
from .plots import make_plots
from .progress import Progress
from .report import add_speedups, markdown, read_json, verdict, write_json
from .runner import Settings, _versions, device_info, merge_rounds, run_config
from .baselines import copy_bandwidth

EXIT_MACHMOE_FAILED = 1
EXIT_USAGE = 2
EXIT_T10 = 3

ALL_IMPLS = list(I.IN_PROCESS) + [I.BOUND]


def parser() -> argparse.ArgumentParser:
    names = ", ".join(C.ALL)
    p = argparse.ArgumentParser(
        prog="python -m machmoe.benchmark", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmarks machmoe (default, recompute mode, token rounding) against a torch._grouped_mm MoE, a "
                    "per-expert loop MoE, the cuBLAS bound and any installed peer (sonicmoe, scattermoe, megablocks) "
                    "on the same weights: forward, backward and forward+backward ms and TFLOP/s, allocator memory, "
                    "speed-ups, and agreement with a float64 reference (exit status 3 if machmoe exceeds T10).",
        epilog=f"configurations: {names}\ngroups: {', '.join(C.GROUPS)}\n"
               f"implementations: {', '.join(ALL_IMPLS)}; peers: {', '.join(PEERS)}\n"
               "exit status: 0 ok (baseline/peer failures are reported, not fatal); 1 a machmoe row failed; "
               "2 usage error; 3 machmoe disagrees with the float64 reference beyond T10")
    p.add_argument("--configs", default="", help="comma-separated names or groups (default: the 12 main "
                   "configurations, both token-rounding sweeps and the odd-shape rows; on the CPU the tiny ones)")
    p.add_argument("--quick", action="store_true", help="a small subset and fewer repetitions")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32", "fp64"],
                   help="data type (default bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--impls", default=",".join(ALL_IMPLS), help="in-process implementations to run")
    p.add_argument("--peers", default="auto", help="auto (every installed peer), none, or a comma-separated list")
    p.add_argument("--warmup", type=int, default=None, help="untimed repetitions (default 3; --quick 2; CPU 1)")
    p.add_argument("--iters", type=int, default=None, help="timed repetitions, median (default 10; --quick 5; CPU 3)")
    p.add_argument("--warmup-ms", type=float, default=None,
                   help="GPU: untimed repetitions for at least this many ms before each timing, so each is taken at "
                        "the clock the board holds under sustained load at its power cap (default 1000; --quick 300)")
    p.add_argument("--time-ms", type=float, default=None,
                   help="GPU: timed repetitions for at least this many ms, at least --iters of them, the median "
                        "reported (default 1000; --quick 300)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every implementation and peer this many times in turn per configuration and report the "
                        "median round (a GPU at its power cap runs slower in some phases than in others: rounds spread "
                        "those phases over every implementation; per-round times in the JSON)")
    p.add_argument("--check-tokens", type=int, default=4096, help="tokens in the float64 check (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per peer and configuration")
    p.add_argument("--out-dir", default="machmoe-benchmark", help="where the JSON, plots and Markdown go")
    p.add_argument("--json", default=None, help="JSON path (default OUT_DIR/results.json); plots go next to it")
    p.add_argument("--markdown", default=None, help="Markdown path (default next to the JSON, results.md)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress display (default: a bar on a terminal, "
                   "else one timestamped line per step on stderr, for batch logs)")
    p.add_argument("--append", action="store_true",
                   help="continue the run in the JSON: keep its configurations, run only the selected ones it does "
                        "not hold yet (a long run split over several invocations); same device, dtype and "
                        "implementations required")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    return p


def _split(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _usage(message: str) -> int:
    print(f"machmoe.benchmark: {message}", file=sys.stderr)
    return EXIT_USAGE


def _output_dir_problem(flag: str, path: str) -> Optional[str]:
    """Why the file `path` could not be written at the end of the run (checked before it), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path} is a directory"
    if not os.path.isdir(folder):
        return f"{flag} {path}: its directory {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {path}: its directory {folder} is not writable"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.list:
        for c in C.ALL.values():
            print(f"{c.name:16s} group={c.group:14s} T={c.T} d={c.d} n={c.n} E={c.E} K={c.K}")
        return 0
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tdev = torch.device(device)
    except (RuntimeError, ValueError):
        return _usage(f"--device: expected cuda, cuda:N or cpu, got {device!r}")
    if tdev.type not in ("cuda", "cpu"):
        return _usage(f"--device: expected cuda, cuda:N or cpu, got {device!r}")
    if tdev.type == "cuda" and not torch.cuda.is_available():
        return _usage(f"--device {device} but no CUDA device is available")
    if tdev.type == "cuda" and tdev.index is not None:
        # Events record on the current device's stream (baselines.time_ms): cuda:N is made the current device, or
        # they would time nothing on cuda:0 while the work ran on cuda:N.
        torch.cuda.set_device(tdev)
    cpu = tdev.type == "cpu"
    dtype = a.dtype or ("fp32" if cpu else "bf16")
    if cpu and dtype not in ("fp32", "fp64"):
        print("machmoe.benchmark: on the CPU the dtype is fp32 or fp64 (machmoe's CPU reference)", file=sys.stderr)
        return EXIT_USAGE
    if a.configs and not _split(a.configs):  # "" is the default set; "," names none
        return _usage(f"--configs {a.configs!r} names no configuration")
    try:
        cfgs = C.select(a.configs, quick=a.quick, device="cpu" if cpu else "cuda")
    except ValueError as e:
        print(f"machmoe.benchmark: {e}", file=sys.stderr)
        return EXIT_USAGE
    impls = _split(a.impls)
    if not impls:
        return _usage(f"--impls {a.impls!r} names no implementation; known: {ALL_IMPLS}")
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        print(f"machmoe.benchmark: unknown implementation(s) {unknown}; known: {ALL_IMPLS}", file=sys.stderr)
        return EXIT_USAGE
    installed = available()
    if a.peers == "auto":
        peers = installed
    elif a.peers == "none":
        peers = []
    else:
        peers = _split(a.peers)
        if not peers:
            return _usage(f"--peers {a.peers!r} names no peer (none: run without peers)")
        missing = [q for q in peers if q not in PEERS or q not in installed]
        if missing:
            print(f"machmoe.benchmark: peer(s) {missing} not installed or unknown (installed: {installed or 'none'})",
                  file=sys.stderr)
            return EXIT_USAGE
    if cpu and peers:
        print(f"machmoe.benchmark: peers {peers} run on CUDA only; skipped on the CPU", file=sys.stderr)
        peers = []
    if a.rounds < 1:
        print(f"machmoe.benchmark: --rounds must be at least 1, got {a.rounds}", file=sys.stderr)
        return EXIT_USAGE
    for flag, v, least in (("--iters", a.iters, 1), ("--warmup", a.warmup, 0), ("--check-tokens", a.check_tokens, 0)):
        if v is not None and v < least:
            return _usage(f"{flag} must be at least {least}, got {v}")
    warmup = a.warmup if a.warmup is not None else (1 if cpu else 2 if a.quick else 3)
    iters = a.iters if a.iters is not None else (3 if cpu else 5 if a.quick else 10)
    for flag, v in (("--warmup-ms", a.warmup_ms), ("--time-ms", a.time_ms)):
        if v is not None and (v < 0 or not math.isfinite(v)):
            print(f"machmoe.benchmark: {flag} must be a finite number >= 0, got {v}", file=sys.stderr)
            return EXIT_USAGE
    warmup_ms = a.warmup_ms if a.warmup_ms is not None else (0.0 if cpu else 300.0 if a.quick else 1000.0)
    time_ms = a.time_ms if a.time_ms is not None else (0.0 if cpu else 300.0 if a.quick else 1000.0)
    s = Settings(device=device, dtype=dtype, warmup=warmup, iters=iters, warmup_ms=warmup_ms, time_ms=time_ms,
                 check_tokens=a.check_tokens, seed=a.seed, impls=impls, peers=peers, peer_timeout=a.peer_timeout)

    json_path = a.json or os.path.join(a.out_dir, "results.json")
    out_dir = os.path.dirname(os.path.abspath(json_path))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        return _usage(f"cannot create the output directory {out_dir}: {e}")
    md_path = a.markdown or os.path.join(out_dir, "results.md")
    # Before the run, not after it: the results are written at its end.
    for flag, path in (("--json", json_path), ("--markdown", md_path)):
        problem = _output_dir_problem(flag, path)
        if problem:
            return _usage(problem)
    doc = {"schema": 1, "command": "python -m machmoe.benchmark " + " ".join(shlex.quote(x) for x in argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device_info(s), "versions": _versions(), "settings": {
               "device": device, "dtype": dtype, "warmup": warmup, "iters": iters, "warmup_ms": warmup_ms,
               "time_ms": time_ms, "rounds": a.rounds,
               "check_tokens": a.check_tokens,
               "seed": a.seed, "impls": impls, "peers": peers, "peers_installed": installed},
           "definitions": {
               "flops": "model FLOPs (GLU): forward 6*P*n*d, backward 12*P*n*d, P = routed pairs (docs/TARGETS.md)",
               "activation_bytes": "allocator bytes left allocated by the forward, minus the output, plus the input "
                                   "X (docs/TARGETS.md); forward_retained_bytes includes the output; router logits "
                                   "count only where the implementation keeps them for its backward (since "
                                   "2026-11-30: before, those it returned were counted too)",
               "peak_bytes": "max_memory_allocated over forward+backward minus what was allocated before (inputs, "
                             "parameters); gradients allocated by the backward included",
               "speedup_over": "other row's time / machmoe row's time (>1: machmoe faster)",
               "speedup_rounds": "with --rounds R > 1: that ratio in each round, the two timed in turn in the round",
               "cublas_bound": "benchmarks/gpu_bench.cu's bound: batched cuBLAS GEMMs at T_e = TK/E rows, plus "
                               "(TKd + Td) elements of the dtype (bf16: 2 bytes each) at the measured copy "
                               "bandwidth"},
           "configs": []}
    if a.append and os.path.exists(json_path):
        previous = read_json(json_path)
        prev_s = previous.get("settings", {})
        # (files from before warmup_ms / time_ms existed were timed without them: 0)
        clash = [k for k in ("device", "dtype", "impls", "peers", "seed", "warmup", "iters", "warmup_ms", "time_ms",
                             "rounds", "check_tokens")
                 if prev_s.get(k, 1 if k == "rounds" else 0.0 if k.endswith("_ms") else
                               Settings.check_tokens if k == "check_tokens" else None) != doc["settings"][k]]
        if previous.get("device", {}).get("name") != doc["device"].get("name"):
            print(f"machmoe.benchmark: --append: {json_path} was measured on {previous.get('device', {}).get('name')!r}, "
                  f"this is {doc['device'].get('name')!r}", file=sys.stderr)
            return EXIT_USAGE
        # Rows measured with other software would be labelled with this run's versions.
        clash_v = [k for k in sorted(set(previous.get("versions", {})) | set(doc["versions"]))
                   if previous.get("versions", {}).get(k) != doc["versions"].get(k)]
        if clash_v:
            was = ", ".join(f"{k} {previous.get('versions', {}).get(k)!r}" for k in clash_v)
            now = ", ".join(f"{k} {doc['versions'].get(k)!r}" for k in clash_v)
            print(f"machmoe.benchmark: --append: {json_path} was measured with other versions ({was}; now {now})",
                  file=sys.stderr)
            return EXIT_USAGE
        if clash:
            now_s = doc["settings"]
            was = ", ".join(f"{k}={prev_s.get(k)!r}" for k in clash)
            now = ", ".join(f"{k}={now_s[k]!r}" for k in clash)
            print(f"machmoe.benchmark: --append: {json_path} was run with other settings ({was}; now {now})",
                  file=sys.stderr)
            return EXIT_USAGE
        doc["configs"] = list(previous.get("configs", []))
        doc["command"] = previous.get("command", "") + " && " + doc["command"]
        doc["appended"] = previous.get("appended", []) + [doc["date"]]
        doc["date"] = previous.get("date", doc["date"])
        done = {e["config"]["name"] for e in doc["configs"]}
        skipped = [c.name for c in cfgs if c.name in done]
        cfgs = [c for c in cfgs if c.name not in done]
        if skipped:
            print(f"machmoe.benchmark: --append: already in {json_path}: {', '.join(skipped)}")
    progress = Progress(len(cfgs) * (len(impls) + len(peers)) * a.rounds, enabled=not a.no_progress)
    copy_bw = None
    try:
        if I.BOUND in impls:
            copy_bw = copy_bandwidth(s.torch_device, None, s.warmup_ms, s.time_ms)
            doc["device"]["copy_bandwidth_GBps"] = copy_bw * 1e-9
        for cfg in cfgs:
            entry = merge_rounds([run_config(cfg, s, progress, copy_bw) for _ in range(a.rounds)])
            add_speedups(entry)
            doc["configs"].append(entry)
            write_json(doc, json_path)  # after every configuration: a crash loses at most the one in flight
    finally:
        progress.close()
    v = verdict(doc["configs"])
    doc["verdict"] = v
    doc["plots"] = {"skipped": "--no-plots"} if a.no_plots else make_plots(doc, out_dir)
    if "files" in doc["plots"]:  # names next to the JSON, so that the folder can be moved (docs/measurements/...)
        doc["plots"]["files"] = [os.path.relpath(f, out_dir) for f in doc["plots"]["files"]]
    write_json(doc, json_path)
    with open(md_path, "w") as f:
        f.write(markdown(doc) + "\n")
    print(markdown(doc))
    print(f"\nmachmoe.benchmark: JSON {json_path}; Markdown {md_path}")
    if "skipped" in doc["plots"]:
        print(f"machmoe.benchmark: plots skipped: {doc['plots']['skipped']}")
    else:
        print("machmoe.benchmark: plots " + ", ".join(os.path.join(out_dir, f) for f in doc["plots"]["files"]))
    for line in v["other_failures"]:
        print(f"machmoe.benchmark: (not fatal) {line}", file=sys.stderr)
    if v["machmoe_agreement_failures"]:
        print("\n" + "=" * 100 + "\nmachmoe.benchmark: FAILED: machmoe disagrees with the float64 reference beyond "
              "T10 (docs/TARGETS.md):", file=sys.stderr)
        for line in v["machmoe_agreement_failures"]:
            print("  " + line, file=sys.stderr)
        print("=" * 100, file=sys.stderr)
        return EXIT_T10
    if v["machmoe_failures"]:
        print("machmoe.benchmark: FAILED: machmoe rows did not run:", file=sys.stderr)
        for line in v["machmoe_failures"]:
            print("  " + line, file=sys.stderr)
        return EXIT_MACHMOE_FAILED
    return 0
