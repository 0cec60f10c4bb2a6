#!/usr/bin/env python3
"""Which stages of machmoe-bench moved between two sets of runs: e.g. an earlier session's raw output against today's,
to catch a kernel that got slower as a side effect of a change to another. Session 86 found by such a comparison, made
by hand, that session 85's change to token rounding's keys kernel had slowed its router backward 0.044 -> 0.055 ms on
1.4B (256,128,8), a kernel that shares its row code; this script makes the comparison for every stage.

  python3 scripts/stage_diff.py [--min-rel 0.10] [--min-pass-share 0.02] [--min-ms 0.003] [--all] BEFORE... -- AFTER...

Each side is any number of files of machmoe-bench's text output (`.xz` files are read as such), such as
`scripts/gpu_check.sh t8`'s t8_raw.txt. Runs are matched by configuration and by every option on the `config` line
(routing, cache mode, score, rounding, ...): the median of each stage and pass over a side's runs of a configuration
is compared with the other side's. A row is printed where both sides have the stage and it moved by at least --min-ms
(stages are printed in µs steps, so a small stage's last digit is noise) and by at least --min-rel of its earlier time
or --min-pass-share of its pass's earlier time (forward or backward): a long stage that moved by a few per cent of
itself can still be a sizeable share of the pass (session 88: dX~ 3.583 -> 3.907 ms on 30B (1024,64,4), 9 % of the
stage but 2.7 % of the backward, which --min-rel alone did not show). Single runs of a stage no change touched moved
by 1-1.2 % of the forward between sessions 84 and 86 and by up to 3.6 % between sessions 87 and 88 (the
up-projection, on other leases): a row shown by its share alone asks for runs in turn (or the other routing as a
control) before it counts. --all prints every stage the two sides share. Configurations on one side only are listed
after the table.
"""
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_text beside this file, however it is loaded
from bench_text import PASS, read_text  # noqa: E402

CONFIG = re.compile(r"^config (\S+)( \(sizes overridden\))? \((.*)\)$")
STAGE = re.compile(r"^\s+((?:forward|backward)/\w+)\s+([\d.]+) ms")


def run_key(name, overridden, options):
    """(row name, options): the row named by its sizes where they were given on the command line, as the T7 and T8
    tables name them; options: every key=value of the config line but the sizes, in their order."""
    fields = dict(kv.split("=", 1) for kv in options.split(", ")[0].split() if "=" in kv)
    if overridden:
        name = "({},{},{},{},{})".format(*(fields[k] for k in ("T", "d", "n", "E", "K")))
    rest = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("T", "d", "n", "E", "K"))
    return name, rest


def stage_times(text):
    """{(row, options): {stage: [ms per run]}} over the `config` blocks of one output; the passes as 'pass/forward'
    and 'pass/backward'."""
    out = {}
    cur = None
    for line in text.splitlines():
        m = CONFIG.match(line)
        if m:
            cur = out.setdefault(run_key(m.group(1), m.group(2), m.group(3)), {})
            seen = set()
            continue
        if cur is None:
            continue
        m = PASS.match(line)
        if m and m.group(1) not in seen:  # the pass table's row (a stage line starts with forward/ or backward/)
            seen.add(m.group(1))
            cur.setdefault("pass/" + m.group(1), []).append(float(m.group(2)))
            continue
        m = STAGE.match(line)
        if m:
            cur.setdefault(m.group(1), []).append(float(m.group(2)))
    return out


def merge(sides):
    total = {}
    for times in sides:
        for key, stages in times.items():
            dst = total.setdefault(key, {})
            for stage, values in stages.items():
                dst.setdefault(stage, []).extend(values)
    return total


def diff(before, after, min_rel=0.10, min_ms=0.003, every=False, min_pass_share=0.02):
    """Rows (row, options, stage, before median, runs, after median, runs) where the stage moved enough."""
    rows = []
    for key in after:
        if key not in before:
            continue
        for stage, values in after[key].items():
            if stage not in before[key]:
                continue
            a, b = statistics.median(before[key][stage]), statistics.median(values)
            moved = abs(b - a)
            # a pass row is measured against --min-rel alone (as a share of itself it would always count)
            pass_runs = [] if stage.startswith("pass/") else before[key].get("pass/" + stage.split("/", 1)[0], [])
            large = moved >= min_rel * a or (bool(pass_runs) and moved >= min_pass_share * statistics.median(pass_runs))
            if every or (moved >= min_ms and large):
                rows.append((key[0], key[1], stage, a, len(before[key][stage]), b, len(values)))
    return rows


def varying(keys):
    """The option names whose value differs between the runs of `keys`, or which some runs lack (the others need no
    column)."""
    parsed = [dict(kv.split("=", 1) for kv in options.split()) for _, options in keys]
    names = set().union(*parsed) if parsed else set()
    return {k for k in names if len({p.get(k) for p in parsed}) > 1}


def table(rows, shown=None):
    """shown: the option names to print (all where None)."""
    lines = ["| config | options | stage | before ms (runs) | after ms (runs) | after / before |",
             "|---|---|---|---|---|---|"]
    for name, options, stage, a, na, b, nb in rows:
        if shown is not None:
            options = " ".join(kv for kv in options.split() if kv.split("=", 1)[0] in shown) or "-"
        ratio = f"{b / a:.2f}" if a > 0 else "-"
        lines.append(f"| {name} | {options} | {stage} | {a:.3f} ({na}) | {b:.3f} ({nb}) | {ratio} |")
    return "\n".join(lines)


def main(argv):
    args = list(argv)
    options = {"--min-rel": "min_rel", "--min-ms": "min_ms", "--min-pass-share": "min_pass_share"}
    thresholds, every = {}, False  # diff()'s defaults where not given
    while args and args[0].startswith("--") and args[0] != "--":
        flag = args.pop(0)
        if flag == "--all":
            every = True
        elif flag in options and args:
            thresholds[options[flag]] = float(args.pop(0))
        else:
            print(f"stage_diff: unknown option {flag}\n{__doc__}", file=sys.stderr)
            return 2
    if "--" not in args or args.index("--") == 0 or args.index("--") == len(args) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    cut = args.index("--")
    before = merge(stage_times(read_text(p)) for p in args[:cut])
    after = merge(stage_times(read_text(p)) for p in args[cut + 1:])
    shown = varying(list(before) + list(after))
    print(table(diff(before, after, every=every, **thresholds), shown))
    same = sorted({kv.split("=", 1)[0] for key in after for kv in key[1].split()} - shown)
    print(f"\n(options the same in every run: {', '.join(same) or 'none'})")
    for label, one, other in (("before", before, after), ("after", after, before)):
        only = sorted({k[0] for k in one if k not in other})
        if only:
            print(f"only {label} (configurations with runs on that side alone): " + ", ".join(only))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
