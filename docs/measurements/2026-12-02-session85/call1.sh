#!/usr/bin/env bash
# Session 85, call 1 (one H200, fresh): token rounding's keys kernel (warp a token) with each exp(x - max) kept in the
# shared tile, the probability keys made in place and the chosen keys written by a lane a selection (where each slot
# branched between a TC score and a probability), slots past the row as -inf in the maximum, the logits copy by
# 16-byte chunks. Sides: main (main's file, third_party/variants/tr_main.cu) and new (this checkout). The
# token-rounding and router GPU tests on new; ncu times and instruction counts of the keys kernel on the rows that
# take the warp kernel; ncu --set full of new's keys kernel at E = 512 (SASS hot spots); T8's comparison of both
# sides on the E = 512 sweep row.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
st variants
VARIANTS="main=third_party/variants/tr_main.cu" bash scripts/ab.sh variants 2>&1 | grep -E "exit"
KEEP=new bash scripts/ab.sh keep | grep kept
st gf; GF="*TokenRounding*:*RouterKernels*" bash scripts/ab.sh gf 2>&1 | tail -n 3
E512="E512=--T:16384:--d:1536:--n:256:--E:512:--K:8"
E256="E256=--T:16384:--d:4096:--n:1024:--E:256:--K:4"
st ncu
KCFGS="$E512 30B-256 $E256" NSIDES="main new" NREPS=2 KLC=1 KRX=tr_keys bash scripts/ab.sh ncu > /dev/null 2>&1
cp "$OUT/ncu.txt" "$OUT/call1_ncu.txt"; grep -E "^-- |gpu__time|sm__inst|registers" "$OUT/call1_ncu.txt" | head -60
st detail
timeout 120 ncu --clock-control none -k regex:tr_keys --launch-count 1 --set full -f -o "$OUT/keys_new" \
  /tmp/bench_new --T 16384 --d 1536 --n 256 --E 512 --K 8 --routing token_rounding --iters 1 --warmup 0 \
  --warmup-ms 0 --time-ms 0 --stage-runs 1 > /dev/null 2>&1
ncu -i "$OUT/keys_new.ncu-rep" --page source --print-source sass --csv > "$OUT/call1_keys_new_sass.csv" 2>&1
ncu -i "$OUT/keys_new.ncu-rep" --print-details all > "$OUT/call1_keys_new_details.txt" 2>&1
grep -E "Duration|Executed Ipc|Issue Slots Busy|Registers Per|Achieved Occupancy" "$OUT/call1_keys_new_details.txt" | head
python3 scripts/ncu_hotspots.py "$OUT/call1_keys_new_sass.csv" --top 15
rm -f "$OUT/keys_new.ncu-rep"
st tab
[ $(( $(date +%s) - S )) -lt 420 ] && TCFGS="$E512" SIDES="main new" ROUNDS=2 TAB_ARGS="--warmup-ms 300 --time-ms 300" \
  bash scripts/ab.sh tab > /dev/null 2>&1
cp "$OUT/tab.txt" "$OUT/call1_tab.txt"; grep -E "^== |forward/(token_rounding|topk)|^  (forward|backward) " "$OUT/call1_tab.txt" | head -40
rm -f "$OUT/ncu.txt" "$OUT/tab.txt" "$OUT"/build*.log
(cd "$OUT" && xz -f call1_keys_new_sass.csv call1_keys_new_details.txt)
st done
