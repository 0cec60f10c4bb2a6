#!/usr/bin/env bash
# Prepared in session 86 for a later session's device call (not run): row_loads_shared.diff against main's build on
# one machine. Build main and keep its benchmark; apply the diff and rebuild (three files); the top-K and token-rounding
# GPU tests on it; ncu of the top-K kernel (topk_scores) and token rounding's kernels on the rows whose top-K takes the
# warp kernel with rows in registers (E = 512 and E = 256 with K = 16), both binaries alternating; the stages of both
# routings on those rows, both binaries. If it lands: the whole GPU suite (ab.sh gboth, pyg) in the next call, and T8
# on every row with T8_BASE=docs/measurements/2026-12-02-session86/call1_t8_raw.txt.xz (the stages that moved).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
st build; bash scripts/ab.sh build keep 2>&1 | grep -E "exit"
st apply; AB_PATCH=docs/measurements/2026-12-02-session86-prepared/row_loads_shared.diff bash scripts/ab.sh apply
st tests; GF='*TopK*:*TokenRounding*:*GpuRouterKernels*:*ManyExperts*:*ManySelections*' bash scripts/ab.sh gf
st ncu
KCFGS="sw512=--T:16384:--d:1536:--n:256:--E:512:--K:8 30B-256" NSIDES="main new" NREPS=2 KRX='topk_|tr_' KLC=8 \
  bash scripts/ab.sh ncu > /dev/null 2>&1
grep -E "^-- |topk_scores|gpu__time" "$OUT/ncu.txt" | head -n 60
st tab
TCFGS="sw512=--T:16384:--d:1536:--n:256:--E:512:--K:8 30B-256 120B-512" SIDES="main new new main" \
  TAB_ARGS="--warmup-ms 300 --time-ms 300" bash scripts/ab.sh tab > /dev/null 2>&1
grep -E "^== |topk_scores|forward/token_rounding|router_backward" "$OUT/tab.txt" | head -n 80
st done
