#!/usr/bin/env bash
# Session 108, call 1 (landed code, 88c5c5a; GPU code of 9fa8350): build; T8 on the four rows that decide it (both
# routings back to back, 300 ms windows); then every kernel of one forward + backward by ncu with its DRAM bytes
# (unlocked clocks) on the small rows, top-K and token rounding: the routing kernels' times and the dH kernel's bytes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/s108; mkdir -p "$W"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu_call1.txt"
MACHMOE_JOBS=16 bash scripts/build.sh > "$W/build.log" 2>&1; st "build exit $?"
grep -E "error" "$W/build.log" | head -5
T8_MAIN='1.4B-256 7B-512' T8_SWEEPS='16384:4096:1024:256:4 16384:1536:256:512:8' T8_MAIN_MS=300 T8_SWEEP_MS=300 \
  T8_DEADLINE_S=100 OUT=$W bash scripts/gpu_check.sh t8 > "$W/t8_log.txt" 2>&1
st "t8 exit $?"
cp "$W/t8_table.txt" "$OUT/t8_table_call1.txt"; xz -c "$W/t8_raw.txt" > "$OUT/t8_raw_call1.txt.xz"
cat "$OUT/t8_table_call1.txt"
for cfg in 1.4B-256 7B-256 7B-512; do
  for routing in topk token_rounding; do
    f="$W/ncu_${cfg}_${routing}.csv"
    timeout 150 ncu --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
      ./build/bin/machmoe-bench --config "$cfg" --routing "$routing" --iters 3 --warmup 1 --warmup-ms 0 --time-ms 0 \
      --stage-runs 1 --profile > "$f" 2>&1
    echo "== $cfg $routing (exit $?)"
    python3 scripts/ncu_kernel_times.py "$f" > "$W/kernels_${cfg}_${routing}.txt" 2>&1
    cut -c1-150 "$W/kernels_${cfg}_${routing}.txt" | head -60
  done
done > "$OUT/ncu_kernels_call1.txt" 2>&1
st "ncu done"
tar -C "$W" -cJf "$OUT/raw_call1.tar.xz" $(cd "$W" && ls *.csv *.txt 2>/dev/null)
st total
