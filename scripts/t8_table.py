#!/usr/bin/env python3
"""T8's table from machmoe-bench output: token rounding against top-K, per configuration, on forward + backward and on
the routing stage (docs/TARGETS.md, T8).

Input: the text machmoe-bench prints (any number of files, runs of both routings of a configuration in any order,
each `config ...` block with its `forward`/`backward` rows and its stage table). A configuration run more than once
per routing gives one row per round, in order. The routing stage is token rounding's `forward/token_rounding`
against top-K's `forward/topk_scores + forward/routing_metadata` (both build the forward's chunk plan inside them; a
`forward/y_chunk_plan` stage, where present, is added to its side).

Usage: python3 scripts/t8_table.py FILE... (scripts/gpu_check.sh t8 writes the files and calls it).
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_text beside this file, however it is loaded
from bench_text import config_runs  # noqa: E402

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


def rows(all_runs):
    """Pairs each configuration's k-th token-rounding run with its k-th top-K run."""
    by = {}
    order = []
    for r in all_runs:
        key = r["name"]
        if key not in by:
            by[key] = {"token_rounding": [], "topk": []}
            order.append(key)
        by[key][r["routing"]].append(r)
    for key in order:
        tr, tk = by[key]["token_rounding"], by[key]["topk"]
        for i, (a, b) in enumerate(zip(tr, tk)):
            yield key + (f", round {i + 1}" if i > 0 else ""), a, b


def table(all_runs):
    lines = ["| config | token rounding fwd + bwd ms | top-K fwd + bwd ms | top-K / token rounding | "
             "token rounding slower by | routing stage ms, TR / top-K |",
             "|---|---|---|---|---|---|"]
    for name, a, b in rows(all_runs):
        ta, tb = a["forward"] + a["backward"], b["forward"] + b["backward"]
        slower = f"{100 * (ta / tb - 1):.1f} %" if ta > tb else "faster"
        stage = (f"{a['routing_stage']:.3f} / {b['routing_stage']:.3f} = {a['routing_stage'] / b['routing_stage']:.2f}×"
                 if b["routing_stage"] > 0 else "-")
        lines.append(f"| {name} | {a['forward']:.3f} + {a['backward']:.3f} = {ta:.3f} | "
                     f"{b['forward']:.3f} + {b['backward']:.3f} = {tb:.3f} | {tb / ta:.3f} | {slower} | {stage} |")
    return "\n".join(lines)


def main(paths):
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    all_runs = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            all_runs += runs(f.read())
    print(table(all_runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
