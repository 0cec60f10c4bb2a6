#!/usr/bin/env bash
# Writes, next to this script, the versions of src/gpu/aggregation_kernels.cu that callA.sh compared as whole files:
# main (85f37d4's file), and reg4, async4, async16 from the file as landed in 1c6cf56 and a diff each (async4 differs
# from 1c6cf56 in comments only; async16 also in its batch). callA.sh ran with the tree's own file at a batch of 8 (the
# "new" side: 1c6cf56's code with kGatherPairBatch = 8).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."
git show 85f37d4:src/gpu/aggregation_kernels.cu > "$here/aggregation_main.cu"
for v in reg4 async4 async16; do
  git show 1c6cf56:src/gpu/aggregation_kernels.cu > "$here/aggregation_$v.cu"
  patch -s "$here/aggregation_$v.cu" "$here/aggregation_$v.diff"
done
echo "wrote aggregation_{main,reg4,async4,async16}.cu in $here"
