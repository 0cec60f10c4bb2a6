#!/usr/bin/env python3
"""T7's table from machmoe-bench output: the recompute mode (`--cache input_only`) against the default (`--cache
preact`) on forward + backward, per configuration (docs/TARGETS.md, T7: at most 1.20), with each mode's activation
memory (measured) and peak.

Input: the text machmoe-bench prints (any number of files), each `config ...` block with its `forward`/`backward`
rows and its activation-memory line (`.xz` files read as such).

    python3 scripts/t7_table.py FILE...          a row per configuration: its first run in each mode
    python3 scripts/t7_table.py --pairs FILE...  runs in the order default, recompute, recompute, default (A B B A) per
                                                 configuration: T7 of the A B pair, of the B A pair and of the means

`bash scripts/gpu_check.sh t7` writes the files and calls it.
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_text beside this file, however it is loaded
from bench_text import config_runs, read_text  # noqa: E402

MEMORY = re.compile(r"activation memory: accounted [\d.]+ MiB, measured ([\d.]+) MiB; peak ([\d.]+) MiB")


def runs(text):
    """One dict per config block, in order: name, cache, forward and backward ms, activation and peak MiB (blocks
    without both passes dropped)."""
    def read_memory(line, run):
        m = MEMORY.search(line)
        if m:
            run["activation"], run["peak"] = float(m.group(1)), float(m.group(2))
    return config_runs(text, "cache", ("preact", "input_only"), read_memory)


def _total(r):
    return r["forward"] + r["backward"]


def _names(all_runs):
    return list(dict.fromkeys(r["name"] for r in all_runs))


def _memory(r, key):
    return f"{r[key]:.0f}" if key in r else "-"


def table(all_runs):
    """A row per configuration with a run in each mode: the first of each."""
    lines = ["| config | default fwd + bwd ms | recompute fwd + bwd ms | recompute / default (T7) | "
             "activation MiB, default / recompute | peak MiB, default / recompute |",
             "|---|---|---|---|---|---|"]
    for name in _names(all_runs):
        d = next((r for r in all_runs if r["name"] == name and r["cache"] == "preact"), None)
        c = next((r for r in all_runs if r["name"] == name and r["cache"] == "input_only"), None)
        if d is None or c is None:
            continue
        lines.append(f"| {name} | {d['forward']:.3f} + {d['backward']:.3f} = {_total(d):.3f} | "
                     f"{c['forward']:.3f} + {c['backward']:.3f} = {_total(c):.3f} | {_total(c) / _total(d):.3f} | "
                     f"{_memory(d, 'activation')} / {_memory(c, 'activation')} | "
                     f"{_memory(d, 'peak')} / {_memory(c, 'peak')} |")
    return "\n".join(lines)


def pairs_table(all_runs):
    """A row per configuration with two runs in each mode, taken as A B B A: each pair's ratio and the means'."""
    lines = ["| config | default, A B B A ms | recompute ms | T7 of the A B pair, the B A pair | T7 of the means |",
             "|---|---|---|---|---|"]
    for name in _names(all_runs):
        d = [_total(r) for r in all_runs if r["name"] == name and r["cache"] == "preact"]
        c = [_total(r) for r in all_runs if r["name"] == name and r["cache"] == "input_only"]
        if len(d) < 2 or len(c) < 2:
            continue
        d, c = d[:2], c[:2]
        lines.append(f"| {name} | {d[0]:.3f}, {d[1]:.3f} | {c[0]:.3f}, {c[1]:.3f} | {c[0] / d[0]:.3f}, "
                     f"{c[1] / d[1]:.3f} | {sum(c) / sum(d):.3f} |")
    return "\n".join(lines)


def main(argv):
    pairs = argv[:1] == ["--pairs"]
    paths = argv[1:] if pairs else argv
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    all_runs = [r for p in paths for r in runs(read_text(p))]
    print(pairs_table(all_runs) if pairs else table(all_runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
