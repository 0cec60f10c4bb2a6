#!/usr/bin/env bash
# Session 69, call 1 (fresh lease): session 68's prepared single_row_strides_and_dispatch_modes.diff, applied in the
# checkout: build with the PyTorch operators, its two pytest GPU tests and the gtest with E = 512 and 1024 against
# float64, then pytest's whole GPU set. (The diff touches no CUDA source.) Also brings upstream SonicMoE's small
# wheels (carried into .peer_wheels/) for the next call.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
bash scripts/ab.sh build
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/python/test_torch_gpu.py -k "single_row_operands or dispatch_mode_gets" > "$OUT/new_tests.log" 2>&1
echo "new tests exit $?"; tail -n 3 "$OUT/new_tests.log"
./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter='GpuLayerProperties.ManyExpertsMatchFloat64*' \
  > "$OUT/many_experts.log" 2>&1
echo "many experts exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/many_experts.log" | tr '\n' ' ')"
bash scripts/ab.sh pyg
tail -n 20 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
ls -la .peer_wheels
bash scripts/ab.sh pack > /dev/null
