#!/usr/bin/env bash
# Written in session 68 (its device time was spent), not run: the GPU check single_row_strides_and_dispatch_modes.diff
# needs before it may land. One device call on a fresh lease, about 6 minutes: apply the diff, build (with the
# PyTorch operators), the two new pytest GPU tests and the new gtest (E = 512 and 1024 against float64), then pytest's
# whole GPU suite. The diff touches no CUDA source (the binding's views, a Python flag, tests), so the whole gtest GPU
# binary is not rerun.
set -uo pipefail
cd "$(dirname "$0")/../../.."
P=docs/measurements/2026-11-30-session68-prepared
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git apply "$P/single_row_strides_and_dispatch_modes.diff" 2>/dev/null || patch -p1 -s < "$P/single_row_strides_and_dispatch_modes.diff" ||
  { echo "the diff does not apply"; exit 3; }
bash scripts/ab.sh build
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/python/test_torch_gpu.py -k "single_row_operands or dispatch_mode_gets" > "$OUT/new_tests.log" 2>&1
echo "new tests exit $?"; tail -n 15 "$OUT/new_tests.log"
./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuLayerProperties.ManyExpertsMatchFloat64' \
  > "$OUT/many_experts.log" 2>&1
echo "many experts exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/many_experts.log" | tr '\n' ' ')"
bash scripts/ab.sh pyg
tail -n 20 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
bash scripts/ab.sh pack > /dev/null
