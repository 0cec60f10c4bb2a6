#!/usr/bin/env bash
# Session 59 call B: main (+ the sleep calibration fix) built; overhead --layers with the fixed timer; the small rows'
# forward stages with and without Y chunks; an nsys trace of one forward on 1.4B-256; the overhead GPU tests.
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
AB=scripts/ab_token_rounding.sh
bash $AB build
st ovh
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 150 \
  python3 -m machmoe.benchmark.overhead --configs 1.4B-256,7B-256 --modes isolated --layers > "$OUT/ovh_main.txt" 2>&1
echo "overhead exit $?"; grep -E "^\| (1.4B|7B)-256 \| isolated|^\| [a-z_]+ \| " "$OUT/ovh_main.txt" | cut -c1-60,100-
st stages
for cfg in 1.4B-256 7B-256; do for yc in def 1; do
  a=(); [ $yc = 1 ] && a=(--y-chunks 1)
  ./build/bin/machmoe-bench --config $cfg --routing topk --iters 10 --warmup 3 --stage-runs 3 --warmup-ms 300 --time-ms 300 "${a[@]}" \
    > "$OUT/stages_${cfg}_y$yc.txt" 2>&1
  echo "== $cfg y$yc"; grep -E "^  (forward|backward) |forward/" "$OUT/stages_${cfg}_y$yc.txt"
done; done
st nsys
if command -v nsys > /dev/null; then
  for cfg in 1.4B-256 7B-256; do
  timeout 120 nsys profile -o /tmp/fw_$cfg --force-overwrite true --capture-range=cudaProfilerApi --trace=cuda \
    ./build/bin/machmoe-bench --config $cfg --routing topk --iters 3 --warmup 2 --stage-runs 1 --profile > /tmp/nsys_$cfg.log 2>&1
  echo "nsys $cfg exit $?"
  nsys stats --report cuda_gpu_trace --format csv -o "$OUT/trace_$cfg" /tmp/fw_$cfg.nsys-rep > /dev/null 2>&1; ls "$OUT" | grep trace_
  done
else echo "no nsys"; fi
st pytest
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/python/test_overhead_gpu.py 2>&1 | tail -n 3
st done
