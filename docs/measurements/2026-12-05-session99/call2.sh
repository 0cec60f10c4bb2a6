#!/bin/bash
# Call 2 (main with test_autocast.py's float64 comparison pinned to the GPU's routing; GPU code as main): build,
# then pytest's GPU tests.
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( time MACHMOE_JOBS=16 bash scripts/build.sh ) > $OUT/build.log 2>&1; echo "build rc $?"; tail -3 $OUT/build.log
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
timeout 400 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" --durations=10 tests/python \
  > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -15 $OUT/pytest_gpu.log
