"""Kernel names and durations from `ncu --csv --metrics gpu__time_duration.sum` output, in launch order, with
the total. Usage: python3 scripts/ncu_kernel_times.py NCU_CSV"""
import csv
import sys


def main(path: str) -> None:
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]  # the CSV rows; the program's own output is interleaved
    rows = list(csv.DictReader(lines))
    total = 0.0
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
        us = value * scale[r["Metric Unit"]]
        total += us
        print(f"{us:10.1f} us  {r['Kernel Name'][:110]}")
    print(f"{total:10.1f} us  total of {len([r for r in rows if r.get('Metric Name') == 'gpu__time_duration.sum'])} kernels")


if __name__ == "__main__":
    main(sys.argv[1])
