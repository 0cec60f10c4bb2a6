#!/usr/bin/env bash
# Session 91, call 4 (one H200, fresh): the dH kernel's bytes moved in its own order without its GEMM or math
# (dh_traffic_probe.cu), on the rows where it lags its cuBLAS GEMM most, with 2 and 4 CTAs of 256 threads an SM; the
# layer's dH stage on the same rows is in call 2's tables.
set -uo pipefail
cd "$(dirname "$0")"
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
nvcc -O3 -arch=sm_90a -std=c++17 dh_traffic_probe.cu -o /tmp/dh_traffic_probe || exit 1
for row in "40960 768 256 128 8" "40960 768 512 64 4" "40960 768 1024 32 2" "24576 1536 256 128 8" \
           "24576 1536 1024 32 2" "32768 4096 512 256 16" "32768 4096 2048 64 4"; do
  for c in 2 4; do timeout 60 /tmp/dh_traffic_probe $row $c; done
done 2>&1 | tee "$OUT/call4_dh_traffic_probe.txt"
