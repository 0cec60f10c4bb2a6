#!/usr/bin/env bash
# Written in session 69, not run: the step-against-phases probe of step_vs_phases.py on the three rows where it
# matters, in one device call of about 3 minutes on a fresh lease (build ~80 s, the probe ~1 min).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
[ -f build/lib/libmachmoe_torch.so ] || bash scripts/ab.sh build
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$PWD/build/lib/libmachmoe_torch.so PYTHONPATH=$PWD/python timeout 400 \
  python3 docs/measurements/2026-11-30-session69-prepared/step_vs_phases.py --configs 120B-512,30B-256,120B-2048 \
  --ms 1500 --blocks 2 2>&1 | tee "$OUT/step_vs_phases.txt"
