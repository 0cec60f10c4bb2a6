#!/bin/bash
# Call 2 (warm machine, build of call 1): the gtest GPU suite's first shard.
set -u
GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=0 timeout 560 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
  > $OUT/gtest_shard0.log 2>&1; echo "shard0 rc $?"; tail -5 $OUT/gtest_shard0.log
