#!/usr/bin/env bash
# wip/dh-epilogue-batched-loads, call A (not yet run on a GPU): the dH epilogue's H pairs loaded kHLoadBatch blocks at
# a time before their dH stores (this branch: 4; variants 2 and 8) against main's pair-by-pair load/store. Needs
# $AB_BASE_TAR (default ./base_main.tar, untracked and not ignored so that it travels):
#   git archive --prefix=base/ main -o base_main.tar -- . ':!docs'
# Base and this branch built side by side, the variants' benches, the dH GPU tests on this branch, then ncu of one
# dH launch (unlocked clock) on five rows for every side. Call B (callB.sh) times the layer on the warm machine.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export AB_BASE_TAR=${AB_BASE_TAR:-$PWD/base_main.tar}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  > "$OUT/clocks_A.csv" 2>&1 &
SMI=$!
st "base (background) and this branch"
bash scripts/ab.sh basebg build | tail -n 3
st variants
f=src/gpu/hopper/epilogue_activation_grad.cuh
for b in 2 8; do
  sed "s/static constexpr int kHLoadBatch = 4;/static constexpr int kHLoadBatch = $b;/" $f > /tmp/v_b$b.cuh
  grep -c "kHLoadBatch = $b;" /tmp/v_b$b.cuh
done
VARIANT_FILE=$f VARIANTS="b2=/tmp/v_b2.cuh b8=/tmp/v_b8.cuh" bash scripts/ab.sh variants | tail -n 4
st gtest
timeout 150 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  --gtest_filter='HopperDh*:HopperEdgeTiles.DhKernel*:GpuLayerProperties.WideDhTile*' 2>&1 |
  grep -v "reference GEMM" | tail -n 3
bash scripts/ab.sh basewait | tail -n 1
st ncu
bench_of() { case $1 in base) echo /tmp/base/build/bin/machmoe-bench;; new) echo ./build/bin/machmoe-bench;; *) echo /tmp/bench_$1;; esac; }
for cfg in 1.4B-256 7B-256 1.4B-1024 30B-256 120B-2048; do for side in base new b2 b8; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k "regex:EpilogueActivationGrad" \
    --launch-skip 1 --launch-count 1 --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum \
    "$(bench_of $side)" --config $cfg --routing topk --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 --stage-runs 1 \
    > /tmp/ncu.txt 2>&1
  echo "-- $cfg $side rc=$? $(grep -E 'gpu__time|dram__bytes|inst_executed' /tmp/ncu.txt | tr -s ' ' | tr '\n' ' ')"
done; done 2>&1 | tee "$OUT/ncu_dh.txt"
kill $SMI
st done
