#!/usr/bin/env bash
# Session 66, call C (on B's warm machine, build/ from call B): every main row on the landed code, top-K, both cache
# modes, 300 ms windows; compute-sanitizer memcheck and racecheck of the layer tests that run the gather-sum over
# chunks of tokens and over caller pairs out of range, and memcheck of pytest's combine_rows GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
  > "$OUT/clocks_C.csv" 2>&1 &
SMI=$!
ninja -C build > "$OUT/build_check.log" 2>&1; echo "build up to date: exit $? ($(grep -c 'Building' "$OUT/build_check.log") objects rebuilt)"
for cache in preact input_only; do
  st "all configs, $cache"
  timeout 200 ./build/bin/machmoe-bench --all-configs --routing topk --cache $cache --warmup-ms 300 --time-ms 300 \
    --json "$OUT/all_$cache.json" > "$OUT/all_$cache.txt" 2>&1
  echo "exit $?"
done
kill $SMI
st sanitizer
SF='GpuLayerProperties.DxInChunksOfTokensIsBitwiseOnePass:GpuLayerProperties.OutOfRangeCallerPairsAreSkipped' \
  timeout 250 bash scripts/ab.sh san
st "memcheck, pytest combine_rows"
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 120 compute-sanitizer --tool memcheck \
  --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -m gpu tests/python/test_combine_rows.py \
  > "$OUT/sanitize_pytest_combine.log" 2>&1
echo "exit $? $(grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_pytest_combine.log" | tr '\n' ' ')"
xz -9 "$OUT/clocks_C.csv"
bash scripts/ab.sh pack
st done
