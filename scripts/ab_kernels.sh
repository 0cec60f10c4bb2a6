#!/usr/bin/env bash
# A/B of the forward kernels between this checkout and an older source tree, on the GPU machine, kernel by kernel
# from ncu (unlocked clocks), alternating A and B to expose run-to-run noise.
#   bash scripts/ab_kernels.sh OLD_TREE [configs...]     (OLD_TREE: e.g. `git archive REF | tar -x -C .ab_old`)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$(cd "$1" && pwd)"; shift
configs="${*:-7B-256 30B-256 120B-2048}"
logs="${OUT:-$root/build/gpu-logs}"; mkdir -p "$logs"
cd "$root"
MACHMOE_JOBS="$(nproc)" MACHMOE_NO_TORCH=1 bash scripts/build.sh 2>&1 | tail -n 1
(cd "$old" && MACHMOE_JOBS="$(nproc)" MACHMOE_NO_TORCH=1 bash scripts/build.sh 2>&1 | tail -n 1)
bench_of() { ls "$1"/build/bin/*-bench; }
for cfg in $configs; do
  for rep in 1 2; do
    for side in new old; do
      tree="$root"; [ "$side" = old ] && tree="$old"
      ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        "$(bench_of "$tree")" --config "$cfg" --iters 1 --warmup 1 --profile > "$logs/ab_${cfg}_${side}_$rep.csv" 2>&1
      echo "== $cfg $side run $rep"
      python3 scripts/ncu_kernel_times.py "$logs/ab_${cfg}_${side}_$rep.csv" | grep -E "kernel<|total" | cut -c1-60
    done
  done
done
