#!/usr/bin/env bash
# Session 94, call 2 (a fresh H200; main with fused_gather_sum_probe.diff applied): the gather-sum fused into the GEMM's epilogue (MACHMOE_FUSED_GATHER_SUM=1, a
# probe switch) built, checked bitwise against the separate gather-sum through the module (fused_check.py), and
# timed against it, the two in turn (A B B A), on four main rows.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=docs/measurements/2026-12-03-session94
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=$PWD/python
st equivalence
MACHMOE_FUSED_GATHER_SUM=0 timeout 120 python3 $M/fused_check.py save /tmp/sep.pt 2>&1 | tail -3
MACHMOE_FUSED_GATHER_SUM=1 timeout 120 python3 $M/fused_check.py save /tmp/fused.pt 2>&1 | tail -3
python3 $M/fused_check.py compare /tmp/sep.pt /tmp/fused.pt > "$OUT/call2_equivalence.txt" 2>&1
echo "compare exit $?"; tail -n 1 "$OUT/call2_equivalence.txt"; grep -c DIFFERENT "$OUT/call2_equivalence.txt"
st bench
for cfg in ${CFGS:-1.4B-256 7B-256 30B-256 120B-512}; do
  for side in 0 1 1 0; do
    echo "== $cfg fused=$side"
    MACHMOE_FUSED_GATHER_SUM=$side timeout 90 ./build/bin/machmoe-bench --config $cfg --routing topk --warmup-ms 300 \
      --time-ms 300 2>&1 | grep -E "^  (forward|backward) |down_projection|aggregation|dx_expanded|y_chunk|dx_chunk"
  done
done > "$OUT/call2_bench.txt" 2>&1
grep -E "==|^  (forward|backward) " "$OUT/call2_bench.txt"
st done
