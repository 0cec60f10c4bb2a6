#!/usr/bin/env bash
# Session 91, call 3 (the same H200, warm after call 2): T14 on today's code, the `MoE` module against the C++ layer on
# the 12 main rows (`python -m machmoe.benchmark.overhead --configs main --modes isolated`, both sides in one run);
# then T7 with the two cache modes in turn (A B B A) on the rows nearest its limit, as far as the call's time allows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
[ -x build/bin/machmoe-bench ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
st overhead
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 380 \
  python3 -m machmoe.benchmark.overhead --configs main --modes isolated --json "$OUT/call3_overhead.json" \
  > "$OUT/call3_overhead.txt" 2>&1
echo "overhead exit $?"; tail -n 18 "$OUT/call3_overhead.txt"
st "t7 in turn"
: > "$OUT/call3_t7_in_turn_raw.txt"
for row in 30B-1024 120B-2048 120B-1024 120B-512; do
  for cache in preact input_only input_only preact; do
    [ $(( $(date +%s) - S )) -lt 560 ] || break 2
    timeout 60 ./build/bin/machmoe-bench --config "$row" --cache "$cache" --routing topk --warmup-ms 300 --time-ms 300 \
      --iters 10 --warmup 3 --stage-runs 3 >> "$OUT/call3_t7_in_turn_raw.txt" 2>&1
  done
done
python3 scripts/t7_table.py --pairs "$OUT/call3_t7_in_turn_raw.txt" | tee "$OUT/call3_t7_in_turn_table.md"
xz -f "$OUT/call3_t7_in_turn_raw.txt"
st done
