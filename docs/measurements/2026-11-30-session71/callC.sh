#!/usr/bin/env bash
# Session 71, call C (the 2-GPU machine): the GPU tests after the last change to GPU code (the device check, the CPU
# reference's token-rounding order, machmoe-bench's JSON, the Python CLIs), within the session's last device minutes:
# the gtest GPU suite in three shards and pytest's one-GPU tests, as four jobs taken in turn by two workers, one per
# GPU; then one machmoe-bench run with --json to check the new fields.
set -uo pipefail
OUT=${OUT:-/tmp/out}; export OUT; mkdir -p "$OUT"
root=$PWD
bash scripts/ab.sh build 2>&1 | tail -n 2
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so
job() {  # job <name> on the GPU of CUDA_VISIBLE_DEVICES
  case "$1" in
    pyg) timeout 280 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/python \
           > "$OUT/pytest_gpu.log" 2>&1; echo "pyg exit $?: $(tail -n 1 "$OUT/pytest_gpu.log")";;
    g*) s=${1#g}; GTEST_TOTAL_SHARDS=3 GTEST_SHARD_INDEX=$s timeout 280 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
           > "$OUT/gtest_s$s.log" 2>&1; echo "gtest shard $s of 3 exit $?: $(grep -v 'reference GEMM' "$OUT/gtest_s$s.log" | tail -n 1)";;
  esac
}
queue=/tmp/jobq; printf '%s\n' pyg g0 g1 g2 > $queue; : > /tmp/jobq.lock
worker() {  # takes jobs from the queue until it is empty
  while :; do
    j=$(flock /tmp/jobq.lock sh -c 'head -n 1 /tmp/jobq; sed -i 1d /tmp/jobq')
    [ -n "$j" ] || break
    CUDA_VISIBLE_DEVICES=$1 job "$j"
  done
}
worker 1 > "$OUT/worker1.txt" 2>&1 &
w1=$!
worker 0 > "$OUT/worker0.txt" 2>&1
wait $w1; cat "$OUT"/worker*.txt
./build/bin/machmoe-bench --config 7B-256 --warmup-ms 100 --time-ms 100 --json "$OUT/bench_7b.json" 2>/dev/null |
  grep -E "^  (forward|backward) "; echo "bench exit ${PIPESTATUS[0]}"
python3 -c "import json,sys; d=json.load(open('$OUT/bench_7b.json')); r=d[0]; print({k: r.get(k) for k in ('backend','routing','bias','layout','score','tile','cache','dx_chunks','y_chunks')})" 2>&1 | tail -n 2
grep -h -E "FAILED|Failure" "$OUT"/gtest_s*.log | head -n 20; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -n 20
for f in "$OUT"/gtest_s*.log "$OUT/pytest_gpu.log"; do xz -f "$f"; done
