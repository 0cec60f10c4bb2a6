#!/usr/bin/env bash
# Written in session 68 (its device time was spent), not run: the GPU check single_row_strides_and_dispatch_modes.diff
# needs before it may land. One device call on a fresh lease, about 6 minutes: apply the diff, build (with the
# PyTorch operators), the two new GPU tests first, then pytest's whole GPU suite. The diff touches no CUDA source
# (the binding's views and a Python flag), so the gtest GPU binary is not rerun.
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
bash scripts/ab.sh pyg
tail -n 20 "$OUT/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
bash scripts/ab.sh pack > /dev/null
