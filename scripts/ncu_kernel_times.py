"""Kernel names and durations from `ncu --csv --metrics gpu__time_duration.sum[,dram__bytes_read.sum,
dram__bytes_write.sum]` output, in launch order, with the total; with the DRAM metrics also each kernel's bytes and
bandwidth. Usage: python3 scripts/ncu_kernel_times.py NCU_CSV"""
import csv
import sys
from typing import Dict

TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def main(path: str) -> None:
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]  # the CSV rows; the program's own output is interleaved
    kernels: Dict[str, Dict[str, float]] = {}
    names: Dict[str, str] = {}
    for r in csv.DictReader(lines):
        metric, unit = r.get("Metric Name"), r.get("Metric Unit", "")
        value = float(r["Metric Value"].replace(",", ""))
        key = r["ID"]
        names[key] = r["Kernel Name"]
        if metric == "gpu__time_duration.sum":
            kernels.setdefault(key, {})["us"] = value * TIME[unit]
        elif metric in ("dram__bytes_read.sum", "dram__bytes_write.sum"):
            kernels.setdefault(key, {})[metric.split(".")[0][-5:]] = value * BYTES[unit]
    total = 0.0
    for key, m in kernels.items():
        if "us" not in m:
            continue
        total += m["us"]
        dram = ""
        if "_read" in m and "write" in m:
            mb_r, mb_w = m["_read"] / 1e6, m["write"] / 1e6
            dram = f"  {mb_r:8.1f} MB read {mb_w:8.1f} MB written {(mb_r + mb_w) / 1e3 / (m['us'] / 1e6) / 1e3:6.2f} TB/s"
        print(f"{m['us']:10.1f} us{dram}  {names[key][:100]}")
    print(f"{total:10.1f} us  total of {sum(1 for m in kernels.values() if 'us' in m)} kernels")


if __name__ == "__main__":
    main(sys.argv[1])
