"""A/B of GPU kernels by ncu's cycle counts: two or more sides (environment settings and/or machmoe-bench binaries),
each kernel launch matching a regex timed under ncu at the unlocked clock, the sides alternating.

Under the board's power cap a benchmark stage's time moves by 3-6 % between rounds of one binary (docs/BENCHMARKS.md,
session 72), more than the changes worth measuring; a kernel's elapsed cycles under ncu, one launch at a time, repeat
within 0.1-0.5 % (session 73). This is the measurement sessions 72 and 73 wrote by hand in each device script.

On the GPU machine:

    python3 scripts/ncu_ab.py run --kernel MainloopVarlenK --launches 2 --labels dW2,dW1 \\
        --configs 120B-2048,7B-256 --side old:MACHMOE_X=0 --side new:MACHMOE_X=1 --out ncu_ab.csv
    python3 scripts/ncu_ab.py run ... --side main@/tmp/bench_main --side variant@/tmp/bench_variant ...

A side is NAME[:VAR=VALUE[,VAR=VALUE...]][@BINARY] (BINARY: default build/bin/machmoe-bench). A configuration is a
name of machmoe-bench's (7B-256) or NAME=OPTIONS with the options joined by ':' (sweep=--T:16384:--d:4096:--n:1024:
--E:256:--K:4); NAME labels its runs. Each round runs the
sides in order and then in reverse (A B B A), so a drift of the clock over the run falls on both alike. The output
file holds, per run, a line `== ncu CONFIG SIDE` and ncu's raw CSV rows of its launches.

Anywhere (also on files of the earlier hand-written form, whose side names have spaces):

    python3 scripts/ncu_ab.py table ncu_ab.csv [--labels dW2,dW1]

prints a Markdown table: per configuration and launch (by its index in a run, or its label), each side's elapsed
cycles (min-max over its runs, in millions) and instructions, and each later side's mean cycles against the first's.
"""
import argparse
import csv
import lzma
import os
import re
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

METRICS = ("gpc__cycles_elapsed.max", "gpu__time_duration.sum", "smsp__inst_executed.sum")
DEFAULT_BENCH = "build/bin/machmoe-bench"
RAW_ROW = re.compile(r'^"(ID|\d)')  # ncu's raw CSV: its header row and one row per launch (not the units row)


class Side:
    def __init__(self, spec: str):
        name, _, binary = spec.partition("@")
        name, _, env = name.partition(":")
        if not name:
            raise ValueError(f"side {spec!r}: no name (expected NAME[:VAR=VALUE,...][@BINARY])")
        self.name = name
        self.binary = binary or DEFAULT_BENCH
        self.env: Dict[str, str] = {}
        for item in filter(None, env.split(",")):
            var, eq, value = item.partition("=")
            if not eq or not var:
                raise ValueError(f"side {spec!r}: {item!r} is not VAR=VALUE")
            self.env[var] = value


def config_args(spec: str) -> Tuple[str, List[str]]:
    """(label, machmoe-bench options) of a configuration: a named one, or NAME=OPT:VALUE:... for explicit sizes."""
    name, eq, options = spec.partition("=")
    if not name or (eq and not options):
        raise ValueError(f"configuration {spec!r}: expected NAME or NAME=--OPTION:VALUE:...")
    return name, (options.split(":") if eq else ["--config", name])


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def read_runs(text: str) -> List[Tuple[str, str, List[Dict[str, str]]]]:
    """(config, side, launch rows) per run, in file order. A run starts at '== ncu CONFIG SIDE...'; its rows are
    ncu's raw CSV, a header row (first cell "ID") and one row per launch."""
    runs: List[Tuple[str, str, List[Dict[str, str]]]] = []
    header: Optional[List[str]] = None
    for line in text.splitlines():
        if line.startswith("== ncu "):
            words = line.split()
            if len(words) < 4:
                raise ValueError(f"run line without a configuration and a side: {line!r}")
            runs.append((words[2], " ".join(words[3:]), []))
            continue
        if not line.startswith('"'):
            continue
        row = next(csv.reader([line]))
        if row[0] == "ID":
            header = row
            continue
        if not runs or header is None or not row[0].isdigit():
            continue  # units row, or rows before any run line
        runs[-1][2].append(dict(zip(header, row)))
    return runs


def table(runs, labels: Optional[List[str]] = None) -> str:
    data: Dict[Tuple[str, int], Dict[str, List[Tuple[float, float]]]] = {}
    configs: List[str] = []
    sides: List[str] = []
    for config, side, rows in runs:
        if config not in configs:
            configs.append(config)
        if side not in sides:
            sides.append(side)
        for i, row in enumerate(rows):
            missing = [m for m in ("gpc__cycles_elapsed.max", "smsp__inst_executed.sum") if m not in row]
            if missing:
                raise ValueError(f"{config} {side}: the ncu rows lack {', '.join(missing)}")
            cell = data.setdefault((config, i), {}).setdefault(side, [])
            cell.append((_number(row["gpc__cycles_elapsed.max"]) / 1e6, _number(row["smsp__inst_executed.sum"]) / 1e6))
    if not data:
        raise ValueError("no ncu launch rows in the file")
    head = ["config, launch"] + [f"{s}: M cycles (instructions, M)" for s in sides]
    head += [f"{s} against {sides[0]}" for s in sides[1:]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in configs:
        launches = sorted(i for (c, i) in data if c == config)
        for i in launches:
            cells = data[(config, i)]
            label = labels[i] if labels and i < len(labels) else f"launch {i}"
            row = [f"{config}, {label}"]
            for s in sides:
                v = cells.get(s)
                row.append(f"{min(c for c, _ in v):.3f}–{max(c for c, _ in v):.3f} ({v[0][1]:.1f})" if v else "–")
            base = cells.get(sides[0])
            for s in sides[1:]:
                v = cells.get(s)
                if base and v:
                    change = statistics.mean(c for c, _ in v) / statistics.mean(c for c, _ in base) - 1
                    row.append(f"{100 * change:+.1f} %")
                else:
                    row.append("–")
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def run(args) -> int:
    sides = [Side(s) for s in args.side]
    if len(sides) < 2:
        print("ncu_ab: run needs two sides or more (--side)", file=sys.stderr)
        return 2
    order = []
    for r in range(args.rounds):
        order += sides + sides[::-1]
    configs = [config_args(c) for c in args.configs.split(",")]
    with open(args.out, "a") as out:
        for config, config_options in configs:
            for side in order:
                cmd = ["ncu", "--clock-control", "none", "--kernel-name-base", "demangled", "-k", f"regex:{args.kernel}",
                       "--launch-skip", str(args.skip), "--launch-count", str(args.launches), "--csv", "--page", "raw",
                       "--metrics", ",".join(METRICS), side.binary] + config_options + ["--iters", "1", "--warmup", "0",
                       "--warmup-ms", "0", "--time-ms", "0", "--stage-runs", "1"] + args.bench_args
                proc = subprocess.run(cmd, env={**os.environ, **side.env}, capture_output=True, text=True,
                                      timeout=args.timeout)
                out.write(f"== ncu {config} {side.name}\n")
                rows = [l for l in proc.stdout.splitlines() if RAW_ROW.match(l)]  # header and launch rows
                out.write("\n".join(rows) + ("\n" if rows else ""))
                out.flush()
                if proc.returncode != 0 or len(rows) < 2:
                    print(f"ncu_ab: {config} {side.name}: ncu exit {proc.returncode}, {max(len(rows) - 1, 0)} launches",
                          file=sys.stderr)
                    print(proc.stderr[-2000:], file=sys.stderr)
                    return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="time the sides under ncu (on the GPU machine)")
    r.add_argument("--kernel", required=True, help="regex of the demangled kernel name (namespaces included)")
    r.add_argument("--launches", type=int, default=2, help="launches per run (default 2)")
    r.add_argument("--skip", type=int, default=0, help="matching launches skipped first (default 0)")
    r.add_argument("--configs", required=True,
                   help="machmoe-bench configurations, comma-separated: NAME or NAME=--OPTION:VALUE:...")
    r.add_argument("--side", action="append", default=[], help="NAME[:VAR=VALUE,...][@BINARY], two or more")
    r.add_argument("--rounds", type=int, default=1, help="rounds of A B ... B A (default 1)")
    r.add_argument("--timeout", type=int, default=120, help="seconds per ncu run (default 120)")
    r.add_argument("--out", required=True, help="file the runs are appended to")
    r.add_argument("bench_args", nargs="*", help="more machmoe-bench options, after --")
    t = sub.add_parser("table", help="the Markdown table of a run file (.xz too)")
    t.add_argument("file")
    t.add_argument("--labels", help="names of the launches of a run, comma-separated (e.g. dW2,dW1)")
    args = p.parse_args(argv)
    if args.command == "run":
        try:
            return run(args)
        except ValueError as e:
            print(f"ncu_ab: {e}", file=sys.stderr)
            return 2
    opener = lzma.open if args.file.endswith(".xz") else open
    with opener(args.file, "rt") as f:
        text = f.read()
    try:
        print(table(read_runs(text), args.labels.split(",") if args.labels else None))
    except ValueError as e:
        print(f"ncu_ab: {args.file}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
