#!/usr/bin/env bash
# Session 82, call C (warm): every kernel's duration (ncu, --clock-control none, one forward + backward) of both
# routings on 1.4B (1024,32,2) and (512,64,4), where token rounding's routing stage is 1.7-2.0x top-K's; then T14's
# module-against-C++ figures on the 12 main rows as far as the call's time allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
[ -f build/bin/machmoe-bench ] || bash scripts/ab.sh build 2>&1 | grep -E "exit"
st ncu
for cfg in 1.4B-1024 1.4B-512 1.4B-256; do for routing in token_rounding topk; do
  timeout 60 ncu --clock-control none --launch-count 24 --csv --page raw --metrics gpu__time_duration.sum \
    ./build/bin/machmoe-bench --config $cfg --routing $routing --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
    --stage-runs 1 2>/dev/null > /tmp/ncu_${cfg}_${routing}.csv
  python3 - "$cfg" "$routing" /tmp/ncu_${cfg}_${routing}.csv <<'PY' | tee -a "$OUT/callC_kernels.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[3])) if len(r) > 5]
hdr = rows[0]; k = hdr.index("Kernel Name"); t = hdr.index("gpu__time_duration.sum")
for r in rows[2:]:
    print(sys.argv[1], sys.argv[2], r[k][:70], r[t])
PY
done; done
st overhead
left=$(( 570 - ($(date +%s) - S) ))
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout "$left" \
  python3 -m machmoe.benchmark.overhead --configs main --modes isolated --json "$OUT/callC_overhead.json" \
  > "$OUT/callC_overhead.txt" 2>&1
echo "overhead exit $?"; tail -n 16 "$OUT/callC_overhead.txt"
st done
