#!/usr/bin/env bash
# On the GPU machine, in one go: build (all cores), the CPU and GPU test suites, compute-sanitizer (memcheck and
# racecheck) on a representative subset, and the benchmark. Logs go to $OUT (the device tool's folder) or
# build/gpu-logs. Usage: bash scripts/gpu_check.sh [tests|sanitize|bench|quick|profile|detail|t7|t8|all] [gtest filter]
# t7: the recompute mode against the default on every main configuration (T7's tables, scripts/t7_table.py).
# t8: token rounding against top-K on every main configuration and both sweeps (T8's table, scripts/t8_table.py).
# profile: kernel by kernel durations of one forward and backward of $BENCH_CONFIGS (ncu, unlocked clocks; nsys when present).
#   BENCH_CONFIGS (profile, detail): names of machmoe-bench's configurations, or rows T:d:n:E:K (16384:1536:256:512:8).
#   BENCH_ARGS: more machmoe-bench arguments for profile and detail (e.g. "--routing token_rounding"), PROFILE_TAG a
#   suffix of their files' names (so that two routings of a configuration keep both).
# detail: ncu --set full of the kernels matching $KERNEL_REGEX and the instructions where they stall, in one archive
# (built with -lineinfo, so that the stalls are also ranked by source line).
# tests runs the GPU suites in shards side by side (scripts/ab.sh suites; GSHARDS, GPIECES and PSHARDS set their counts).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
what="${1:-all}"
filter="${2:-*}"
logs="${OUT:-$root/build/gpu-logs}"
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
cd "$root"
case "$what" in
  tests|sanitize|bench|quick|profile|detail|t7|t8|all) ;;
  *) echo "gpu_check: unknown mode '$what' (expected tests, sanitize, bench, quick, profile, detail, t7, t8 or all)" >&2
     exit 2;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
bash scripts/setup.sh || { echo "gpu_check: setup failed" >&2; exit 1; }
bin=build/bin
# machmoe-bench's arguments for a configuration of BENCH_CONFIGS, and a file name for it (no ':').
config_args() {
  case "$1" in
    *:*) local t d n e k; IFS=: read -r t d n e k <<< "$1"; echo "--T $t --d $d --n $n --E $e --K $k";;
    *) echo "--config $1";;
  esac
}
config_file() { echo "${1//:/x}"; }
if [ "$what" = detail ]; then  # its own build directory: -lineinfo stays out of build/'s cache
  bin=build-lineinfo/bin
  MACHMOE_BUILD_DIR="$root/build-lineinfo" MACHMOE_CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-lineinfo" MACHMOE_JOBS="$(nproc)" \
    bash scripts/build.sh 2>&1 | tail -n 3
else
  MACHMOE_JOBS="$(nproc)" bash scripts/build.sh 2>&1 | tail -n 3
fi
# Tests on a failed build would run stale binaries.
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: build failed" >&2; exit 1; }
status=0
# The Hopper kernels: registers / stack / shared memory per kernel, and HGMMA present in their SASS.
for src in src/gpu/hopper/instantiations/*.cu; do
  obj="${bin%/bin}/CMakeFiles/machmoe.dir/$src.o"
  echo "$(basename "$obj"): $(cuobjdump --dump-resource-usage "$obj" 2>&1 | grep -o 'REG:[0-9]* STACK:[0-9]* SHARED:[0-9]* LOCAL:[0-9]*' | head -1)," \
    "HGMMA instructions: $(cuobjdump --dump-sass "$obj" 2>/dev/null | grep -c HGMMA)"
done 2>&1 | tee "$logs/hopper_kernels.txt"
if [ "$what" = all ] || [ "$what" = tests ]; then
  (cd build && ctest -L cpu --parallel "$(nproc)" 2>&1 | tail -n 3; exit "${PIPESTATUS[0]}") || status=1
  if [ -f build/lib/libmachmoe_torch.so ]; then
    MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$root/build/lib/libmachmoe_torch.so" python3 -m pytest -q -p no:cacheprovider \
      tests/python -m "not gpu and not multigpu" 2>&1 | tee "$logs/pytest_cpu.log" | tail -n 3
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  # The GPU suites side by side (scripts/ab.sh suites): gtest in $GPIECES pieces that $GSHARDS processes take in turn
  # (defaults 24 and 6) with pytest's GPU tests in $PSHARDS processes (default 3) beside them (session 111, H100: six
  # fixed gtest shards took 46-195 s, the whole gtest suite over 490 s in one process on 2026-11-25); each piece has a
  # timeout, so a hung kernel fails the run instead of eating the lease. A gtest filter narrows the gtest pieces, and
  # pytest's GPU tests then stay out.
  suites_args=suites; [ "$filter" = "*" ] || suites_args=gboth
  # ab.sh exits 1 when a shard or a pytest process failed (a failed test, a crash or its timeout).
  SUITE_FILTER="$filter" OUT="$logs" bash scripts/ab.sh $suites_args 2>&1 | tee "$logs/gpu_suites.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = sanitize ]; then
  # Small shapes only (the sanitizers slow kernels down ~100x); every kernel is on these paths.
  subset='GpuLayerProperties.SplitBackward*:*GpuLayer.MatchesFloat64Reference/bf16_swiglu_concatenated_bias_topk_topk_softmax_preact:*GpuLayer.MatchesFloat64Reference/bf16_relu_squared_interleaved_bias_caller_input_only:*GpuLayer.MatchesFloat64Reference/fp32_geglu_interleaved_bias_topk_softmax_topk_input_only:*GpuLayer.MatchesFloat64Reference/bf16_relu_interleaved_nobias_token_rounding_topk_softmax_down_input_only:*GpuEdgeShapes.*odd_dims*:*GpuEdgeShapes.*empty_experts*:*GpuEdgeShapes.*padded_rows*:GpuLayerProperties.SavedMetadata*:GpuLayerProperties.OutOfRange*:HopperUpProjection.*/swiglu_concatenated_bias_H_and_A:HopperUpProjection.*/relu_squared_interleaved_bias_A_only:HopperUpProjectionProperties.EdgeShapes:HopperDownProjection.ManyExperts*:HopperDxExpanded.ManyExperts*:GpuLayerProperties.TopK*:HopperSchedulerProperties.*'
  # racecheck checks shared memory only; the top-K kernels use none, and that test's router-weight gradient GEMM
  # (T=64, E=4096: a cuBLAS nvjet split-K kernel) is reported by racecheck inside cuBLAS, which is not ours to fix.
  for tool in memcheck racecheck; do
    filter="$subset"
    [ "$tool" = racecheck ] && filter="${subset/:GpuLayerProperties.TopK\*/}"
    compute-sanitizer --tool "$tool" --error-exitcode 9 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
      --gtest_filter="$filter" > "$logs/sanitize_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: exit $rc; $(grep -E "SUMMARY|PASSED|FAILED" "$logs/sanitize_$tool.log" | sort -u | tr "\n" " ")"
    [ $rc -eq 0 ] || status=1
  done
fi
if [ "$what" = quick ]; then  # the Hopper kernel tests and one configuration's benchmark
  timeout 300 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$filter" 2>&1 | tee "$logs/gpu_tests.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  ./build/bin/machmoe-bench --config "${BENCH_CONFIG:-7B-256}" --iters 5 --warmup 2 2>&1 | tee "$logs/bench.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = profile ]; then
  for cfg in ${BENCH_CONFIGS:-7B-256}; do
    echo "== $cfg ${BENCH_ARGS:-}"
    name="$(config_file "$cfg")${PROFILE_TAG:+_$PROFILE_TAG}"
    # shellcheck disable=SC2086,SC2046
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      ./build/bin/machmoe-bench $(config_args "$cfg") ${BENCH_ARGS:-} --iters 3 --warmup 1 --profile > "$logs/ncu_$name.csv" 2>&1
    grep -E "back-to-back" "$logs/ncu_$name.csv"
    python3 scripts/ncu_kernel_times.py "$logs/ncu_$name.csv"
    if command -v nsys > /dev/null; then
      # shellcheck disable=SC2086,SC2046
      nsys profile -o "$logs/nsys_$name" --force-overwrite true --capture-range=cudaProfilerApi \
        ./build/bin/machmoe-bench $(config_args "$cfg") ${BENCH_ARGS:-} --iters 3 --warmup 1 --profile > /dev/null 2>&1
      nsys stats -q --report cuda_gpu_trace --format csv "$logs/nsys_$name.nsys-rep" > "$logs/nsys_$name.csv" 2>&1
      head -n 40 "$logs/nsys_$name.csv"
    fi
  done
fi
if [ "$what" = detail ]; then
  # Where the warps of chosen kernels stall, instruction by instruction (ncu --set full, unlocked clocks), packed into
  # one archive (a device machine returns few files): KERNEL_REGEX picks kernels by demangled name (default: the
  # weight-gradient family), LAUNCHES how many launches per configuration.
  regex="${KERNEL_REGEX:-MainloopVarlenK}"
  mkdir -p "$logs/detail"
  for cfg in ${BENCH_CONFIGS:-120B-2048 7B-256}; do
    out="$logs/detail/$(config_file "$cfg")${PROFILE_TAG:+_$PROFILE_TAG}"
    # shellcheck disable=SC2086,SC2046
    timeout "${DETAIL_TIMEOUT:-300}" ncu --clock-control none --kernel-name-base demangled -k "regex:$regex" \
      --launch-count "${LAUNCHES:-2}" --set full --import-source yes -f -o "$out" \
      "./$bin/machmoe-bench" $(config_args "$cfg") ${BENCH_ARGS:-} --iters 1 --warmup 0 > "$out.log" 2>&1
    echo "== $cfg: ncu exit $?"
    ncu -i "$out.ncu-rep" --print-details all > "$out.details.txt" 2>&1
    ncu -i "$out.ncu-rep" --page source --print-source sass --csv > "$out.sass.csv" 2>&1
    ncu -i "$out.ncu-rep" --page source --print-source cuda --csv > "$out.cuda.csv" 2>&1
    grep -E "Duration|Compute \(SM\) Throughput|Registers Per Thread" "$out.details.txt" | head -12
    python3 scripts/ncu_hotspots.py "$out.sass.csv" --top 12
    python3 scripts/ncu_hotspots.py "$out.sass.csv" --barriers --top 6
    python3 scripts/ncu_hotspots.py "$out.cuda.csv" --by-line --top 12
  done
  tar -C "$logs" -cJf "$logs/detail.tar.xz" detail && rm -rf "$logs/detail"
fi
if [ "$what" = t7 ]; then
  # T7 (docs/TARGETS.md): each configuration in the default cache mode and then the recompute mode, back to back
  # (top-K, 300 ms windows), then the rows of T7_TURN again with the modes A B B A, since T7 counts only figures of
  # both modes on one board taken in turn; the tables by scripts/t7_table.py. T7_MAIN / T7_TURN pick the rows. The
  # 24 runs of the main rows and the 16 of four rows in turn took about 260 s on an H200 (session 82).
  : > "$logs/t7_raw.txt"; : > "$logs/t7_in_turn_raw.txt"
  t7_run() {  # configuration, cache mode, output file
    # shellcheck disable=SC2046
    ./build/bin/machmoe-bench $(config_args "$1") --cache "$2" --warmup-ms "${T7_MS:-300}" --time-ms "${T7_MS:-300}" \
      --iters 10 --warmup 3 --stage-runs 3 >> "$3" 2>&1 || status=1
  }
  t7_main="${T7_MAIN-1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024}"
  [ -n "${T7_MAIN+set}" ] || t7_main="$t7_main 120B-2048"
  for row in $t7_main; do
    for cache in preact input_only; do t7_run "$row" "$cache" "$logs/t7_raw.txt"; done
  done
  for row in ${T7_TURN-120B-2048 120B-1024 120B-512 30B-1024}; do
    for cache in preact input_only input_only preact; do t7_run "$row" "$cache" "$logs/t7_in_turn_raw.txt"; done
  done
  python3 scripts/t7_table.py "$logs/t7_raw.txt" | tee "$logs/t7_table.txt"
  python3 scripts/t7_table.py --pairs "$logs/t7_in_turn_raw.txt" | tee "$logs/t7_in_turn_table.txt"
fi
if [ "$what" = t8 ]; then
  # T8 (docs/TARGETS.md): both routings of each configuration back to back, the 12 main configurations and both
  # token-rounding sweeps, then the table (scripts/t8_table.py). T8_MAIN / T8_SWEEPS pick the rows (names of
  # machmoe-bench's configurations; sweep rows as T:d:n:E:K), T8_SWEEP_MS the sweeps' --warmup-ms and --time-ms,
  # T8_MAIN_MS the main rows' (default: the benchmark's sustained timing; 300 took the 28 runs of the main rows and
  # two sweep rows under 3 minutes on an H200, session 53).
  # The 40 runs took about 10 minutes on an H200 (session 52): split them over device calls with T8_MAIN= or
  # T8_SWEEPS= (empty), and give t8_table.py every call's t8_raw.txt.
  # T8_IN_TURN=1 runs each row's routings in turn (token rounding, top-K, top-K, token rounding: t8_table.py makes a
  # row of each pair, and a row of each configuration's pairs on their means), T8_ROUNDS repeats the whole list, and T8_DEADLINE_S (seconds since this step began) stops before
  # a row that would start later, so that a device call's limit ends the step between rows with the table written.
  # T8_BASE (files of an earlier run's raw output) adds the stages that moved since (scripts/stage_diff.py).
  : > "$logs/t8_raw.txt"
  main_rows="${T8_MAIN-1.4B-256 1.4B-512 1.4B-1024 7B-256 7B-512 7B-1024 30B-256 30B-512 30B-1024 120B-512 120B-1024 120B-2048}"
  sweep_rows="${T8_SWEEPS-16384:1536:256:64:8 16384:1536:256:128:8 16384:1536:256:256:8 16384:1536:256:512:8 16384:4096:1024:32:4 16384:4096:1024:64:4 16384:4096:1024:128:4 16384:4096:1024:256:4}"
  routings="token_rounding topk"
  [ "${T8_IN_TURN:-0}" = 1 ] && routings="token_rounding topk topk token_rounding"
  t8_start=$(date +%s)
  for round in $(seq 1 "${T8_ROUNDS:-1}"); do
    for row in $main_rows $sweep_rows; do
      if [ -n "${T8_DEADLINE_S:-}" ] && [ $(( $(date +%s) - t8_start )) -ge "$T8_DEADLINE_S" ]; then
        echo "t8: past T8_DEADLINE_S=$T8_DEADLINE_S s before round $round's $row"; break 2
      fi
      case "$row" in
        *:*) args="$(config_args "$row") --warmup-ms ${T8_SWEEP_MS:-500} --time-ms ${T8_SWEEP_MS:-500}";;
        *) args="$(config_args "$row")${T8_MAIN_MS:+ --warmup-ms $T8_MAIN_MS --time-ms $T8_MAIN_MS}";;
      esac
      for routing in $routings; do
        # shellcheck disable=SC2086
        timeout 120 ./build/bin/machmoe-bench $args --routing "$routing" --iters 10 --warmup 3 --stage-runs 3 \
          >> "$logs/t8_raw.txt" 2>&1 || status=1
      done
    done
  done
  python3 scripts/t8_table.py "$logs/t8_raw.txt" | tee "$logs/t8_table.txt"
  # T8_BASE: raw files of an earlier run (e.g. a measurements folder's t8 raw output, .xz read as such): the stages that
  # moved since, for every row both have (scripts/stage_diff.py), so a kernel slowed by a change to another shows.
  if [ -n "${T8_BASE:-}" ]; then
    # shellcheck disable=SC2086
    python3 scripts/stage_diff.py $T8_BASE -- "$logs/t8_raw.txt" | tee "$logs/t8_stage_diff.txt"
  fi
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  ./build/bin/machmoe-bench --all-configs --iters "${BENCH_ITERS:-3}" --warmup 1 --json "$logs/bench.json" 2>&1 |
    tee "$logs/bench.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
