#!/usr/bin/env bash
# Session 59 call A: main built and kept, its module overhead; the cuBLASLt router-GEMM diff applied, the same; isolated
# forward A/B on the small rows; pytest's GPU tests on the applied tree (the overhead GPU tests' first run).
set -uo pipefail
cd "$(dirname "$0")/.."
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export AB_PATCH=docs/measurements/2026-11-29-h200-session58/router_gemm_cublaslt.diff
AB=scripts/ab_token_rounding.sh
ovh() { MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=python timeout 150 \
  python3 -m machmoe.benchmark.overhead --configs 1.4B-256,7B-256 --modes isolated --layers > "$OUT/ovh_$1.txt" 2>&1
  echo "overhead $1 exit $?"; grep -E "^\| (1.4B|7B)-256 \| isolated|^\| (cpp|module_forward) " "$OUT/ovh_$1.txt"; }
bash $AB build keep
st ovh main; ovh main
bash $AB apply
st ovh new; ovh new
SIDES="main new" ROUTES=topk ROUNDS=2 TAB_ARGS="--warmup-ms 300 --time-ms 300" TCFGS="1.4B-256 7B-256 1.4B-512 7B-512" \
  bash $AB tab > /dev/null 2>&1
grep -E "^== |^  (forward|backward) |router_gemms" "$OUT/tab.txt" | cut -c1-160
st pyg; bash $AB pyg
st done
