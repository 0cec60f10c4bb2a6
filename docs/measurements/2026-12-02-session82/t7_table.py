#!/usr/bin/env python3
"""T7's table from machmoe-bench output: the recompute mode (--cache input_only) against the default (--cache preact),
forward + backward, per configuration (docs/TARGETS.md, T7), with each mode's activation memory.

  python3 t7_table.py FILE          one row per configuration: its first run in each mode
  python3 t7_table.py --pairs FILE  runs in the order default, recompute, recompute, default per configuration:
                                    the ratio of each adjacent pair (A B and B A) and of the means
"""
import re
import sys

CONFIG = re.compile(r"^config (\S+) \(.*cache=(preact|input_only)")
PASS = re.compile(r"^\s+(forward|backward)\s+([\d.]+)\s")
MEM = re.compile(r"activation memory: accounted ([\d.]+) MiB, measured ([\d.]+) MiB; peak ([\d.]+) MiB")


def runs(text):
    out, cur = [], None
    for line in text.splitlines():
        m = CONFIG.match(line)
        if m:
            cur = {"name": m.group(1), "cache": m.group(2)}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = PASS.match(line)
        if m and m.group(1) not in cur:
            cur[m.group(1)] = float(m.group(2))
        m = MEM.search(line)
        if m:
            cur["act"], cur["peak"] = float(m.group(2)), float(m.group(3))
    return [r for r in out if "forward" in r and "backward" in r]


def main(argv):
    pairs = argv[:1] == ["--pairs"]
    text = "".join(open(f).read() for f in argv[1 if pairs else 0:])
    rs = runs(text)
    names = list(dict.fromkeys(r["name"] for r in rs))
    total = lambda r: r["forward"] + r["backward"]
    if not pairs:
        print("| config | default fwd + bwd ms | recompute fwd + bwd ms | recompute / default (T7) | activation MiB, "
              "default / recompute | peak MiB, default / recompute |")
        print("|---|---|---|---|---|---|")
        for n in names:
            d = next((r for r in rs if r["name"] == n and r["cache"] == "preact"), None)
            c = next((r for r in rs if r["name"] == n and r["cache"] == "input_only"), None)
            if not d or not c:
                continue
            print(f"| {n} | {d['forward']:.3f} + {d['backward']:.3f} = {total(d):.3f} | {c['forward']:.3f} + "
                  f"{c['backward']:.3f} = {total(c):.3f} | {total(c) / total(d):.3f} | {d.get('act', 0):.0f} / "
                  f"{c.get('act', 0):.0f} | {d.get('peak', 0):.0f} / {c.get('peak', 0):.0f} |")
        return
    print("| config | default, A B B A ms | recompute ms | T7 of the A B pair, the B A pair | T7 of the means |")
    print("|---|---|---|---|---|")
    for n in names:
        seq = [r for r in rs if r["name"] == n]
        d = [total(r) for r in seq if r["cache"] == "preact"]
        c = [total(r) for r in seq if r["cache"] == "input_only"]
        if len(d) < 2 or len(c) < 2:
            continue
        print(f"| {n} | {d[0]:.3f}, {d[1]:.3f} | {c[0]:.3f}, {c[1]:.3f} | {c[0] / d[0]:.3f}, {c[1] / d[1]:.3f} | "
              f"{(sum(c) / len(c)) / (sum(d) / len(d)):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
