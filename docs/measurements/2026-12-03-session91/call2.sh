#!/usr/bin/env bash
# Session 91, call 2 (one H200, fresh): today's GPU code (session 87's kernels) on every main row in both cache modes
# and on T13's odd shapes, so that the docs' main tables rest on the code that lands. Top-K, 300 ms windows.
# - all 12 main rows with the default cache (`--cache preact`), then all 12 with the recompute mode (`input_only`):
#   forward, backward, efficiency, stages against cuBLAS, activation memory and peak (T1, T2, T3, T6, T7);
# - T13: gpt-oss's experts (d = n = 2880, edge tiles) beside the same layer at 2944, the nearest multiple of 128.
# Tables by scripts/bench_tables.py (passes, stages; passes of the two runs: T7).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/call2_gpu.txt"
git log -1 --format='%h %s' | cut -c1-100 | tee -a "$OUT/call2_gpu.txt"
[ -x build/bin/machmoe-bench ] || { st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"; }
B="./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300"
for cache in preact input_only; do
  st "all rows, $cache"
  timeout 200 $B --all-configs --cache $cache --json "$OUT/call2_all_$cache.json" > "$OUT/call2_all_$cache.txt" 2>&1
  echo "exit $?"
done
st t13
for cfg in gptoss20b-2880 gptoss20b-2944 gptoss120b-2880 gptoss120b-2944; do
  [ $(( $(date +%s) - S )) -lt 540 ] || { echo "t13: out of time before $cfg"; break; }
  timeout 60 $B --config $cfg --json "/tmp/t13_$cfg.json" >> "$OUT/call2_t13.txt" 2>&1 || echo "exit $? ($cfg)"
done
python3 - "$OUT/call2_t13.json" /tmp/t13_*.json <<'PY'
import json, sys
runs = [r for p in sys.argv[2:] for r in json.load(open(p))]
json.dump(runs, open(sys.argv[1], "w"), indent=1)
PY
st tables
{
  python3 scripts/bench_tables.py passes "$OUT/call2_all_preact.json"
  echo; python3 scripts/bench_tables.py passes "$OUT/call2_all_preact.json" "$OUT/call2_all_input_only.json"
  echo; python3 scripts/bench_tables.py stages "$OUT/call2_all_preact.json"
  echo; python3 scripts/bench_tables.py stages "$OUT/call2_all_input_only.json"
  echo; python3 scripts/bench_tables.py passes "$OUT/call2_t13.json"
} > "$OUT/call2_tables.md" 2>&1
cat "$OUT/call2_tables.md"
st done
