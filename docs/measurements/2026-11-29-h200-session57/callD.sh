#!/usr/bin/env bash
# Session 57 call D: token rounding's probabilities by one reciprocal a row (working tree) against main (.gl/tr_main.cu):
# ncu of the keys and backward kernels, T8's stage and forward/backward.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TR=src/gpu/token_rounding_kernels.cu
st build
bash scripts/setup.sh > "$OUT/setup.log" 2>&1
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build.log"
cp build/bin/machmoe-bench /tmp/bench_rcp
st "rebuild main"
cp .gl/tr_main.cu $TR && cmake --build build --target machmoe-bench > "$OUT/build_main.log" 2>&1; echo "exit $?"
cp build/bin/machmoe-bench /tmp/bench_main
cp .gl/tr_rcp.cu $TR  # (build/ is rebuilt from this by the next call's build step)
st ncu
for cfg in "--T 16384 --d 1536 --n 256 --E 512 --K 8" "--config 1.4B-256"; do for rep in 1 2; do for v in main rcp; do
  ncu --clock-control none -k "regex:tr_(keys|backward)" --launch-count 2 \
    --metrics gpu__time_duration.sum,sm__inst_executed.sum \
    /tmp/bench_$v $cfg --routing token_rounding --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > /tmp/n.txt 2>&1
  echo "-- $cfg $v rep $rep"
  grep -E "tr_[a-z_]*kernel|gpu__time|sm__inst" /tmp/n.txt | grep -v "==PROF==" | sed 's/(const.*//;s/(machmoe::Score.*//' | cut -c1-110
done; done; done > "$OUT/ncu.txt" 2>&1
python3 - "$OUT/ncu.txt" <<'PY'
import sys,re
cur=None; kern=None; res={}
for l in open(sys.argv[1]):
    if l.startswith('-- '): cur=l[3:].strip(); continue
    m=re.search(r'(tr_[a-z_]+kernel)',l)
    if m: kern=m.group(1); continue
    if kern and ('gpu__time_duration' in l or 'sm__inst_executed' in l):
        res.setdefault(cur,[]).append((kern + ('_us' if 'time' in l else '_inst'), l.split()[-1]))
for k,v in res.items(): print(k, ' '.join(f"{a.replace('_kernel','')}={b}" for a,b in v))
PY
st tab
for cfg in "sw512=--T 16384 --d 1536 --n 256 --E 512 --K 8" "1.4B-256=--config 1.4B-256"; do
  for v in main rcp topk; do
    b=/tmp/bench_$v; route=token_rounding; [ $v = topk ] && b=/tmp/bench_main && route=topk
    echo "== ${cfg%%=*} $v"
    $b ${cfg#*=} --routing $route --iters 10 --warmup 3 --stage-runs 3 --warmup-ms 300 --time-ms 300 2>&1 |
      grep -E "^  (forward|backward) |forward/(token_rounding|topk|routing)|backward/router_backward"
  done; done > "$OUT/tab.txt" 2>&1
grep -E "^==|^  (forward|backward) |forward/(token_rounding|topk_scores|routing_metadata)|router_backward" "$OUT/tab.txt" | tr -s ' ' | paste -s -d' ' | sed 's/==/\n==/g'
echo
st done
