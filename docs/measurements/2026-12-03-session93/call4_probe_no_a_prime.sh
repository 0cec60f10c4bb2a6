#!/usr/bin/env bash
# Session 93, call 4 (one H200): how much of the dH kernel's time is writing A' (the dW2 GEMM's operand, s act(H))?
# Session 91's traffic probe found the dH kernel held by its bytes on the 1.4B and 7B rows, and A' is 20 % of the
# bytes it streams; a design where dW2 forms A' from H in its own producer would take that write out of the dH kernel.
# Before building that: probe_no_a_prime.diff (a probe, not for landing) skips the A' passes of the dH epilogue when
# MACHMOE_PROBE_NO_APRIME is set (the buffers' slots still turn over, as for an edge tile's columns past n), so one
# binary gives both sides. ncu cycles of the dH kernel (one launch a run, sides A B B A) on five rows, then the layer
# with both sides in turn (dW2 then reads a stale A': its time, not its values, is what counts here).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=docs/measurements/2026-12-03-session93
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git apply --check $D/probe_no_a_prime.diff 2>/dev/null && git apply $D/probe_no_a_prime.diff
git diff --stat
touch src/gpu/hopper/*
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st ncu
python3 scripts/ncu_ab.py run --kernel EpilogueActivationGrad --launches 1 \
  --configs 1.4B-256,1.4B-1024,7B-256,7B-1024,120B-2048 --side full --side noap:MACHMOE_PROBE_NO_APRIME=1 \
  --timeout 60 --out "$OUT/call4_ncu.csv" > "$OUT/call4_ncu.log" 2>&1
echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/call4_ncu.csv" | tee "$OUT/call4_ncu_table.md"
log="$OUT/call4_layer.txt"; : > "$log"
for cfg in 1.4B-256 1.4B-1024 7B-256; do
  for side in full noap noap full; do
    [ $(( $(date +%s) - S )) -lt 540 ] || { echo "out of time before $cfg $side"; break 2; }
    echo "=== $cfg $side" >> "$log"
    if [ $side = noap ]; then export MACHMOE_PROBE_NO_APRIME=1; else unset MACHMOE_PROBE_NO_APRIME; fi
    ./build/bin/machmoe-bench --config $cfg --routing topk --warmup-ms 300 --time-ms 300 >> "$log" 2>&1 || echo "exit $?"
  done
done
unset MACHMOE_PROBE_NO_APRIME
awk '/^=== /{key=$2" "$3} /^  backward /{b=$2" ("$5")"}
     /backward\/dh_kernel/{d=$2} /backward\/dw2/{printf "%-16s backward %s  dh_kernel %s  dw2 %s\n", key, b, d, $2}' "$log" \
  | tee "$OUT/call4_layer_summary.txt"
st done
