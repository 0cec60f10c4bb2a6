"""Warp-stall samples spent waiting on each mbarrier, from `ncu --page source --print-source sass --csv` (as
scripts/gpu_check.sh detail writes it): a wait is a SYNCS.PHASECHK.TRANS64.TRYWAIT and the predicated branch
(@!Pn BRA) that retries it within the next few instructions; both instructions' samples go to the barrier's
address expression. Usage: python3 ncu_barrier_waits.py FILE.sass.csv [--warps N]"""
import csv
import re
import sys


def main(path: str, warps: int) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    addr, src = header.index("Address"), header.index("Source")
    samples = header.index("Warp Stall Sampling (All Samples)")
    total = sum(int(r[samples] or 0) for r in data)
    waits, barrier, since = {}, None, 99
    for r in data:
        s, n = r[src], int(r[samples] or 0)
        m = re.search(r"TRYWAIT (P\d), \[([^\]]*)\]", s)
        if m:
            barrier, pred, since = m.group(2), m.group(1), 0
            waits[barrier] = waits.get(barrier, 0) + n
            continue
        since += 1
        if barrier and since <= 8 and re.search(rf"@!{pred}\s+BRA", s):
            waits[barrier] += n
    print(f"{path}: {total} samples over {warps} warps")
    for b, n in sorted(waits.items(), key=lambda x: -x[1])[:8]:
        print(f"  [{b}]  {n:7d}  {100 * n / total:5.1f} %")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[sys.argv.index("--warps") + 1]) if "--warps" in sys.argv else 12)
