#!/bin/bash
# Call 1 (main with this session's Python changes; GPU code unchanged): build, pytest's GPU tests (the new
# test_autocast.py GPU test among them), and what torch.autocast costs the layer (autocast_cost.py).
set -u
here=docs/measurements/2026-12-05-session98
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( time MACHMOE_JOBS=16 bash scripts/build.sh ) > $OUT/build.log 2>&1; echo "build rc $?"; tail -3 $OUT/build.log
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
PYTHONPATH=$PWD/python timeout 100 python3 $here/autocast_cost.py --configs 7B-256 > $OUT/autocast_cost.txt 2>&1
echo "autocast cost rc $?"; cat $OUT/autocast_cost.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" --durations=10 tests/python \
  > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -15 $OUT/pytest_gpu.log
