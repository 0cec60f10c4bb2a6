"""The SASS instructions where a kernel's warps stall most, from Nsight Compute's source page:

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > sass.csv
    python3 scripts/ncu_hotspots.py sass.csv [--top 25]

Per kernel in the file (ncu writes one CSV table per profiled launch, each with its own header row), the instructions
with the most warp-stall samples, their share of the kernel's samples and the largest per-reason columns ncu gives
for them. Which instruction stalls tells a producer-bound pipeline (consumers waiting on the 'full' barrier), an
MMA-bound one (the producer waiting on 'empty'), or an exposed epilogue (stores, barriers after the mainloop) apart,
which the whole-kernel stall breakdown cannot: it mixes the producer's and the consumers' warps.

With a build compiled with -lineinfo, the source lines instead (every file's lines, summed over their instructions):

    ncu -i REPORT.ncu-rep --page source --print-source cuda --csv > cuda.csv
    python3 scripts/ncu_hotspots.py cuda.csv --by-line [--top 25]

With --barriers, the samples spent waiting on each mbarrier instead: a wait is the SYNCS.PHASECHK.TRANS64.TRYWAIT
and the predicated branch (@!Pn BRA) that retries it a few instructions on, both counted for the barrier's address
expression. In the Hopper kernels the ring's 'full' barriers lie below its 'empty' ones (mainloop_varlen_m.cuh), so
the two addresses tell the consumers' wait for operands from the producer's wait for a free slot."""
import argparse
import csv
import io
import re
import sys
from typing import Dict, List, Optional


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def tables(text: str) -> List[List[Dict[str, str]]]:
    """The CSV tables of the file: a table starts at a header row (its first cell is "Address" or "#")."""
    out: List[List[Dict[str, str]]] = []
    block: List[str] = []
    for line in text.splitlines():
        if not line.startswith('"'):
            continue  # the profiled program's own output and ncu's log lines
        first = next(csv.reader([line]))[0]
        if first in ("Address", "#") and block:
            out.append(list(csv.DictReader(io.StringIO("\n".join(block)))))
            block = []
        block.append(line)
    if block:
        out.append(list(csv.DictReader(io.StringIO("\n".join(block)))))
    return [t for t in out if t]


def _sample_columns(rows: List[Dict[str, str]]):
    """(the stall-sample column, the instruction column), or (None, a message naming the columns there are)."""
    columns = list(rows[0].keys())
    total_col = next((c for c in columns if c.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        return None, f"no 'Warp Stall Sampling (All Samples)' column; columns: {', '.join(columns)}"
    source_col = next((c for c in columns if c in ("Source", "SASS")), columns[1] if len(columns) > 1 else columns[0])
    return total_col, source_col


def hotspots(rows: List[Dict[str, str]], top: int) -> str:
    total_col, source_col = _sample_columns(rows)
    if total_col is None:
        return source_col
    columns = list(rows[0].keys())
    skip = {total_col, source_col, "Address", "#"}
    reason_cols = [c for c in columns if c not in skip and "Sampling" not in c
                   and any(_number(r.get(c, "")) not in (None, 0.0) for r in rows[:2000])]
    total = sum(_number(r[total_col]) or 0.0 for r in rows)
    ranked = sorted(rows, key=lambda r: _number(r[total_col]) or 0.0, reverse=True)[:top]
    lines = [f"{'samples':>8} {'share':>6}  instruction  [largest other columns]"]
    for r in ranked:
        n = _number(r[total_col]) or 0.0
        extra = sorted(((c, _number(r[c]) or 0.0) for c in reason_cols), key=lambda kv: kv[1], reverse=True)[:3]
        detail = ", ".join(f"{c}={v:g}" for c, v in extra if v)
        lines.append(f"{n:8.0f} {100 * n / total if total else 0:5.1f}%  {r.get('Address', '')} "
                     f"{r[source_col].strip()[:90]}  [{detail}]")
    lines.append(f"{total:8.0f} samples in the kernel")
    return "\n".join(lines)


_TRYWAIT = re.compile(r"TRYWAIT (P\d), \[([^\]]*)\]")
_RETRY_WINDOW = 8  # instructions after a TRYWAIT within which its retry branch sits


def barrier_waits(rows: List[Dict[str, str]], top: int) -> str:
    """Stall samples per mbarrier waited on (see the module's doc), largest first, with their share of the kernel's."""
    total_col, source_col = _sample_columns(rows)
    if total_col is None:
        return source_col
    waits: Dict[str, float] = {}
    barrier, pred, since = None, None, _RETRY_WINDOW + 1
    total = 0.0
    for r in rows:
        src, n = r[source_col], _number(r[total_col]) or 0.0
        total += n
        m = _TRYWAIT.search(src)
        if m:
            pred, barrier, since = m.group(1), m.group(2), 0
            waits[barrier] = waits.get(barrier, 0.0) + n
            continue
        since += 1
        if barrier is not None and since <= _RETRY_WINDOW and re.search(rf"@!{pred}\s+BRA\b", src):
            waits[barrier] += n
    lines = [f"{'samples':>8} {'share':>6}  barrier (address expression of the wait)"]
    for b, n in sorted(waits.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        lines.append(f"{n:8.0f} {100 * n / total if total else 0:5.1f}%  [{b}]")
    lines.append(f"{total:8.0f} samples in the kernel")
    return "\n".join(lines)


def line_hotspots(text: str, top: int, column: str = "Warp Stall Sampling (All") -> str:
    """The CUDA source lines with the most of `column` (a prefix of a column's name: warp-stall samples by default,
    or e.g. "Instructions Executed"), from the cuda source page: a "File Path" row names the file of the rows that
    follow (line number, source, ..., values)."""
    rows = []
    path = "?"
    header: Optional[List[str]] = None
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        if rec[0] == "File Path":
            path = rec[1].split("/")[-1]
            continue
        if rec[0] == "Line No":
            header = rec
            continue
        if header is None or not rec[0].isdigit():
            continue
        col = next((i for i, c in enumerate(header) if c.startswith(column)), None)
        if col is None:  # say so: a page without metric columns (ncu gave one in session 55) would print nothing
            return f"no column starting with {column!r}; the page's columns: {', '.join(header)}"
        if col >= len(rec):
            continue
        n = _number(rec[col]) or 0.0
        if n:
            rows.append((n, f"{path}:{rec[0]}", rec[1].strip()[:100]))
    total = sum(r[0] for r in rows)
    lines = [f"{column[:24]:>24} {'share':>6}  file:line  source"]
    for n, where, src in sorted(rows, reverse=True)[:top]:
        lines.append(f"{n:24.0f} {100 * n / total if total else 0:5.1f}%  {where}  {src}")
    lines.append(f"{total:24.0f} in all on source lines")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=25, help="instructions per kernel (default 25)")
    p.add_argument("--by-line", action="store_true", help="the input is the cuda source page: rank source lines")
    p.add_argument("--barriers", action="store_true", help="samples spent waiting on each mbarrier (sass page)")
    p.add_argument("--column", default="Warp Stall Sampling (All",
                   help="with --by-line: rank by the column whose name starts with this (default: stall samples)")
    a = p.parse_args(argv)
    with open(a.csv) as f:
        text = f.read()
    if a.by_line:
        print(line_hotspots(text, a.top, a.column))
        return 0
    found = tables(text)
    if not found:
        print(f"{a.csv}: no CSV table found", file=sys.stderr)
        return 1
    for i, t in enumerate(found):
        print(f"== launch {i + 1} of {len(found)}")
        print(barrier_waits(t, a.top) if a.barriers else hotspots(t, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
