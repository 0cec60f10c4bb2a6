#!/usr/bin/env bash
# Session 91, call 1 (prepared in session 90; run on a fresh H200 unchanged but for this header and its output names):
# the dH kernel's wide 128 x 256 cooperative tile against its default 128 x 128 ping-pong tile on the six 1.4B and 7B
# rows, on an H200.
#
# Why: heuristics.hpp gives the dH kernel the wide tile only from d = 4096 (kDhWideMinK), from H100 measurements of
# sessions 40-41 (7B (256,128,8): 0.48 ms wide against 0.44 ping-pong). Since then sessions 64 and 65 made the dH
# kernel 6-11 % and 1-3 % faster through its epilogue (H loads batched ahead of the dH stores, the gate/up pair as one
# 8-byte access), which the wide tile needs more (its epilogue runs with the tensor cores idle), and on an H200
# session 63 found the wide tile faster at d = 4096 for n = 256 and 512 where the H100 had it equal. The wide tile also gathers each pair's dO row
# once, where the ping-pong tile at n = 256 reads it for each of its two N tiles. Not measured on an H200 at d <= 1536.
#
# How: MACHMOE_HOPPER_TILE_N=256 forces the wide tile on every varlen-M family, but on these six rows every other
# family already takes it (up-projection N = 2n, down-projection and dX~ N = d <= 1536 below kContiguousPingPongMinN;
# the weight gradients pick 256 with >= 132 wide tiles), so only the dH kernel changes. Sides alternate per row,
# two rounds, 300 ms windows; the stage table's dh_kernel line and the backward's time are what to compare.
#
# Cost: a build (~90 s on a fresh machine) and 24 runs of machmoe-bench (~6 s each): about 4 minutes.
# If the wide tile wins by more than the rounds' spread: lower kDhWideMinK (with kDhWideMinRowsPerExpert kept: these
# rows have 1536-2560 rows per expert), rerun the whole GPU suite and T5 (the dH stage on 7B (256,128,8) <= 0.42 ms).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
[ -x build/bin/machmoe-bench ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
log="$OUT/call1_dh_tile_small_rows.txt"; : > "$log"
for round in 1 2; do
  for cfg in 1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024; do
    for side in pingpong wide; do
      tile=""; [ "$side" = wide ] && tile=256
      st "round $round $cfg $side"
      echo "=== round $round $cfg $side" >> "$log"
      MACHMOE_HOPPER_TILE_N=$tile ./build/bin/machmoe-bench --config "$cfg" --routing topk --warmup-ms 300 \
        --time-ms 300 >> "$log" 2>&1 || echo "exit $? ($cfg $side)"
    done
  done
done
# One line per run: the backward's time and efficiency, and the dH kernel's stage.
awk '/^=== /{key=$3" "$4" "$5} /^  backward /{b=$2" ("$5")"}
     /backward\/dh_kernel/{printf "%-22s backward %s  dh_kernel %s\n", key, b, $2}' "$log" | tee "$OUT/call1_dh_tile_summary.txt"
st done
