#!/usr/bin/env python3
"""T8's table from machmoe-bench output: token rounding against top-K, per configuration, on forward + backward and on
the routing stage (docs/TARGETS.md, T8).

Input: the text machmoe-bench prints (any number of files, runs of both routings of a configuration in any order,
each `config ...` block with its `forward`/`backward` rows and its stage table). A configuration run more than once
per routing gives one row per round, in order. The routing stage is token rounding's `forward/token_rounding`
against top-K's `forward/topk_scores + forward/routing_metadata` (both build the forward's chunk plan inside them; a
`forward/y_chunk_plan` stage, where present, is added to its side).

Where a configuration has several pairs (runs in turn, `T8_IN_TURN=1 T8_ROUNDS=3` of scripts/gpu_check.sh t8), a second
table gives each of its pairs' figure and the figure on the means of its runs: T8's "at most 3 % slower" on a row near
the limit is judged there, not on one pair.

Usage: python3 scripts/t8_table.py FILE... (`.xz` files read as such; scripts/gpu_check.sh t8 writes the files and calls
it).
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_text beside this file, however it is loaded
from bench_text import config_runs, read_text  # noqa: E402

STAGE = re.compile(r"^\s+forward/(token_rounding|topk_scores|routing_metadata|y_chunk_plan)\s+([\d.]+) ms")


def runs(text):
    """One dict per config block, in order: name, routing, forward and backward ms, routing_stage ms (blocks without
    both passes dropped)."""
    def read_stage(line, run):
        m = STAGE.match(line)
        if m:
            run["routing_stage"] = run.get("routing_stage", 0.0) + float(m.group(2))
    out = config_runs(text, "routing", ("token_rounding", "topk"), read_stage)
    for r in out:
        r.setdefault("routing_stage", 0.0)
    return out


def pairs_by_config(all_runs):
    """{configuration: [(token-rounding run, top-K run), ...]} in first-seen order, each configuration's k-th
    token-rounding run paired with its k-th top-K run (a run without its partner is left out)."""
    by = {}
    for r in all_runs:
        by.setdefault(r["name"], {"token_rounding": [], "topk": []})[r["routing"]].append(r)
    return {key: list(zip(v["token_rounding"], v["topk"])) for key, v in by.items()}


def rows(all_runs):
    """(row name, token-rounding run, top-K run): a row a pair, the second and later ones named by their round."""
    for key, pairs in pairs_by_config(all_runs).items():
        for i, (a, b) in enumerate(pairs):
            yield key + (f", round {i + 1}" if i > 0 else ""), a, b


def total(run):
    return run["forward"] + run["backward"]


def slower_by(ta, tb):
    """Token rounding's forward + backward ta against top-K's tb, as the tables print it."""
    return f"{100 * (ta / tb - 1):.1f} %" if ta > tb else "faster"


def table(all_runs):
    lines = ["| config | token rounding fwd + bwd ms | top-K fwd + bwd ms | top-K / token rounding | "
             "token rounding slower by | routing stage ms, TR / top-K |",
             "|---|---|---|---|---|---|"]
    for name, a, b in rows(all_runs):
        ta, tb = total(a), total(b)
        slower = slower_by(ta, tb)
        stage = (f"{a['routing_stage']:.3f} / {b['routing_stage']:.3f} = {a['routing_stage'] / b['routing_stage']:.2f}×"
                 if b["routing_stage"] > 0 else "-")
        lines.append(f"| {name} | {a['forward']:.3f} + {a['backward']:.3f} = {ta:.3f} | "
                     f"{b['forward']:.3f} + {b['backward']:.3f} = {tb:.3f} | {tb / ta:.3f} | {slower} | {stage} |")
    return "\n".join(lines)


def means_table(all_runs):
    """A row for each configuration with two or more pairs: token rounding's figure in each pair, and on the means of
    its runs (forward + backward of each routing averaged over the pairs), with the range of the routing stage's
    ratio. None where no configuration has two pairs."""
    lines = ["| config | pairs | token rounding slower by, each pair | on the means (TR / top-K fwd + bwd ms) | "
             "routing stage, TR / top-K |",
             "|---|---|---|---|---|"]
    for name, pairs in pairs_by_config(all_runs).items():
        if len(pairs) < 2:
            continue
        each = ", ".join(slower_by(total(a), total(b)) for a, b in pairs)
        ta = sum(total(a) for a, _ in pairs) / len(pairs)
        tb = sum(total(b) for _, b in pairs) / len(pairs)
        ratios = [a["routing_stage"] / b["routing_stage"] for a, b in pairs if b["routing_stage"] > 0]
        stage = f"{min(ratios):.2f}–{max(ratios):.2f}×" if ratios else "-"
        lines.append(f"| {name} | {len(pairs)} | {each} | {slower_by(ta, tb)} ({ta:.3f} / {tb:.3f}) | {stage} |")
    return "\n".join(lines) if len(lines) > 2 else None


def main(paths):
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    all_runs = [r for p in paths for r in runs(read_text(p))]
    print(table(all_runs))
    means = means_table(all_runs)
    if means:
        print("\n" + means)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
