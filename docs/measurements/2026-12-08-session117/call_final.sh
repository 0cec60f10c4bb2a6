#!/usr/bin/env bash
# Session 117's last call: every main row on the code being landed (default cache, top-K, 300 ms windows), so that the
# docs' main table rests on the last change to GPU code; then the whole GPU suite on exactly that code. Carry
# build/bin, build/lib and build/tests/machmoe_gpu_tests, built on the development machine from the commit named in
# the session's README.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_call.sh
call_start
carried_binaries
gtest_gate '*GpuRoutingMetadata*'
st "routing gtests"
B="./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300"
timeout 230 $B --all-configs --cache preact --json "$OUT/all_preact.json" > "$OUT/all_preact.txt" 2>&1
st "all rows exit $?"
python3 scripts/bench_tables.py passes "$OUT/all_preact.json" > "$OUT/main_rows_tables.txt" 2>&1
echo >> "$OUT/main_rows_tables.txt"; python3 scripts/bench_tables.py stages "$OUT/all_preact.json" >> "$OUT/main_rows_tables.txt" 2>&1
head -16 "$OUT/main_rows_tables.txt"
OUT=$OUT timeout $(( $(left) - 15 )) bash scripts/ab.sh suites; st "suites exit $?"
(cd "$OUT" && rm -f gtest_g*.rc && tar -cJf logs.tar.xz *.log 2>/dev/null && rm -f *.log)
