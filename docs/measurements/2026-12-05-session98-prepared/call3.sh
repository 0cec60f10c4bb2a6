#!/bin/bash
# Call 3 (warm machine): the gtest GPU suite's second shard, then pytest's GPU tests.
set -u
GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=1 timeout 330 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  > $OUT/gtest_shard1.log 2>&1; echo "shard1 rc $?"; tail -5 $OUT/gtest_shard1.log
export MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so
timeout 255 python3 -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" --durations=10 tests/python \
  > $OUT/pytest_gpu.log 2>&1; echo "pytest rc $?"; tail -15 $OUT/pytest_gpu.log
