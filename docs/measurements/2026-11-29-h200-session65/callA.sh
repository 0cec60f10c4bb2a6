#!/usr/bin/env bash
# Session 65, call A (fresh lease): main (base, from $AB_BASE_TAR) and wip/dh-epilogue-64bit-smem (the GLU dH
# epilogue's two gate/up pairs of a block read and written back as one 8-byte shared-memory access) built side by
# side; the dH kernel's GPU tests on the branch; ncu of one dH launch (unlocked clock: time, instructions, shared-memory
# wavefronts) on two rows; the layer, base against new, four rows, two rounds, 300 ms windows, order alternating; then
# where 1.4B (256,128,8)'s backward pass outlasts its stages (base: default dX~ chunks against one chunk).
#   git archive --prefix=base/ main -o base_main.tar -- . ':!docs'   (untracked, not ignored: it travels)
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export AB_BASE_TAR=${AB_BASE_TAR:-$PWD/base_main.tar}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_A.csv" 2>&1 &
SMI=$!
st "base (background) and new"
bash scripts/ab.sh basebg build | tail -n 2
st gtest
timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperDh*:HopperEdgeTiles.DhKernel*:GpuLayerProperties.WideDhTile*' 2>&1 |
  grep -v "reference GEMM" | tail -n 2
bash scripts/ab.sh basewait | tail -n 1
bench_of() { case $1 in base) echo /tmp/base/build/bin/machmoe-bench;; new) echo ./build/bin/machmoe-bench;; esac; }
st ncu
for cfg in 1.4B-256 120B-2048; do for side in base new; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:EpilogueActivationGrad" \
    --launch-skip 1 --launch-count 1 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes_read.sum \
    "$(bench_of $side)" --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > /tmp/ncu.txt 2>&1
  echo "-- $cfg $side rc=$? $(grep -E 'gpu__time|inst_executed|wavefronts|dram__bytes' /tmp/ncu.txt | tr -s ' ' | tr '\n' ' ')"
done; done 2>&1 | tee "$OUT/ncu_dh.txt"
st layer
one() {  # cfg side [extra args]
  local cfg=$1 side=$2; shift 2
  timeout 60 "$(bench_of $side)" --config $cfg --routing topk --iters 5 --warmup 2 --stage-runs 5 --warmup-ms 300 \
    --time-ms 300 "$@" > /tmp/o.txt 2>&1
  echo "== $cfg $side $* rc=$? | $(grep -E '^  backward ' /tmp/o.txt | tr -s ' ') | $(grep -E 'they add up' /tmp/o.txt | tr -s ' ' | cut -d' ' -f3-) | dh $(grep dh_kernel /tmp/o.txt | tr -s ' ' | cut -d' ' -f3,11)"
  cat /tmp/o.txt >> "$OUT/bench_raw.txt"
}
for r in 1 2; do for cfg in 1.4B-256 7B-256 30B-1024 120B-2048; do
  order="base new"; [ $r = 2 ] && order="new base"
  for side in $order; do one $cfg $side; done
done; done 2>&1 | tee "$OUT/layer.txt"
st "backward pass against its stages, 1.4B (256,128,8)"
for r in 1 2; do one 1.4B-256 base --dx-chunks 1; one 1.4B-256 base; done 2>&1 | tee "$OUT/gap.txt"
kill $SMI
xz -9 "$OUT/bench_raw.txt" "$OUT/clocks_A.csv"
st done
