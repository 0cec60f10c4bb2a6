#!/usr/bin/env bash
# Session 57 call B: token rounding's bounded select, main / v1 (block bounds preloaded) / v2 (v1 + the preloaded steps'
# kept keys loaded together). Working tree = v2. Tests on v2; ncu and T8's stage on all three.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TR=src/gpu/token_rounding_kernels.cu
st build
bash scripts/setup.sh > "$OUT/setup.log" 2>&1
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build exit $?"; tail -n 1 "$OUT/build.log"
cp build/bin/machmoe-bench /tmp/bench_v2
st gf_v2
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='*TokenRounding*' > "$OUT/gf_v2.log" 2>&1
echo "gf exit $?"; grep -v "reference GEMM" "$OUT/gf_v2.log" | tail -n 3
for v in v1 main; do
  st "rebuild $v"
  cp .gl/tr_$v.cu $TR && cmake --build build --target machmoe-bench > "$OUT/build_$v.log" 2>&1; echo "exit $?"
  cp build/bin/machmoe-bench /tmp/bench_$v
done
cp .gl/tr_v2.cu $TR
st ncu
for cfg in "--T 16384 --d 1536 --n 256 --E 512 --K 8" "--config 1.4B-256" "--config 30B-256"; do for rep in 1 2; do for v in main v1 v2; do
  ncu --clock-control none -k "regex:tr_(select|emit|keys)" --launch-count 3 \
    --metrics gpu__time_duration.sum,sm__inst_executed.sum,launch__registers_per_thread \
    /tmp/bench_$v $cfg --routing token_rounding --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 > /tmp/n.txt 2>&1
  echo "-- $cfg $v rep $rep"
  grep -E "tr_[a-z_]*kernel|gpu__time|sm__inst|registers" /tmp/n.txt | grep -v "==PROF==" | sed 's/(const.*//' | cut -c1-110
done; done; done > "$OUT/ncu.txt" 2>&1
python3 - "$OUT/ncu.txt" <<'PY'
import sys,re
cur=None; kern=None; res={}
for l in open(sys.argv[1]):
    if l.startswith('-- '): cur=l[3:].strip(); continue
    m=re.search(r'(tr_[a-z_]+kernel)',l)
    if m: kern=m.group(1); continue
    if 'gpu__time_duration' in l and kern:
        res.setdefault(cur,[]).append((kern,l.split()[-1]))
for k,v in res.items(): print(k, ' '.join(f"{a.replace('_kernel','')}={b}" for a,b in v))
PY
st tab
for r in 1 2; do for cfg in "sw512=--T 16384 --d 1536 --n 256 --E 512 --K 8" "1.4B-256=--config 1.4B-256"; do
  for v in main v1 v2 topk; do
    b=/tmp/bench_$v; route=token_rounding; [ $v = topk ] && b=/tmp/bench_main && route=topk
    echo "== round $r ${cfg%%=*} $v"
    $b ${cfg#*=} --routing $route --iters 10 --warmup 3 --stage-runs 3 --warmup-ms 300 --time-ms 300 2>&1 |
      grep -E "^  (forward|backward) |forward/(token_rounding|topk|routing)"
  done; done; done > "$OUT/tab.txt" 2>&1
grep -E "^==|forward/(token_rounding|topk_scores|routing_metadata)" "$OUT/tab.txt" | tr -s ' ' | paste -s -d' ' | sed 's/==/\n==/g' 
st layers
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$PWD/build/lib/libmachmoe_torch.so" PYTHONPATH="$PWD/python" \
  timeout 120 python3 .gl/layers.py 1.4B-256 7B-256 > "$OUT/layers.txt" 2>&1; echo "layers exit $?"; cat "$OUT/layers.txt" | tail -n 16
st done
