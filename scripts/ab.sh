#!/usr/bin/env bash
# A/B of kernels on the GPU machine: this checkout ("new") against an older source tree ("base"), against a diff applied
# to this checkout (apply / revert), or against variants of one file; token rounding's T8 comparison (tab) and the GPU
# suites in steps. Written for token rounding's kernels (sessions 48-58; scripts/ab_token_rounding.sh still calls this).
# Steps that fit one device call each (a call runs 10 minutes at most): bash scripts/ab.sh STEP...
#   basebg    build the base tree's machmoe-bench in the background (8 jobs; the base tree is extracted first from
#             $AB_BASE_TAR, a `git archive --prefix=base/ REF -o FILE -- . ':!docs'` of the older code, into /tmp/base)
#   build     build this checkout (all cores)          basewait  wait for basebg
#   variants  one machmoe-bench per version of one source file, in this checkout's build/ (after build): $VARIANTS is
#             "name=path ..." (each path a whole copy of $VARIANT_FILE, default src/gpu/token_rounding_kernels.cu);
#             bench <name> goes to /tmp/bench_<name> and is a side for ncu and tab (SIDES="main rcp"). One translation
#             unit and the links a variant, against a second tree's whole build for basebg. The checkout's own file
#             is put back and build/ rebuilt from it, touched first: the device's copy of the tree carries the
#             checkout's file times, older than an object compiled from a variant, which ninja would otherwise keep
#             (session 57's whole-suite run tested such an object).
#   keep      copy this checkout's machmoe-bench to /tmp/bench_$KEEP (default main): a side for ncu and tab, e.g. main's
#             binary before `apply` (SIDES="main new")
#   apply     apply $AB_PATCH (a git diff of any number of files, such as one kept in a measurements folder) to this
#             checkout, touch every file it names, and rebuild; `revert` takes it out again the same way. Both touch
#             for the reason `variants` does, and a later call's fresh copy of the tree brings the checkout's own files
#             back with their old times: after an `apply`, the next call on the same machine starts with `revert` or
#             touches those files before it builds
#   gf        the GPU tests matching $GF (default: every token-rounding test)
#   equiv     session 48's equivalence check: forward and backward of token rounding, base against new, 594 cases
#   ncu       per-kernel ncu times and instruction counts ($KRX: kernel regex without ncu's "regex:" prefix, default tr_;
#             $KLC: launches) on $KCFGS, the sides $NSIDES (default "base new") alternating, $NREPS rounds (default 2)
#   tab       machmoe-bench --routing {token_rounding,topk} on $TCFGS, both sides, $ROUNDS rounds (T8's comparison);
#             $SIDES and $ROUTES narrow it, $TAB_ARGS adds options (e.g. --warmup-ms 300 --time-ms 300);
#             scripts/t8_table.py reads its tab.txt (one side's runs: SIDES=new)
#   g0 g1     the whole gtest GPU suite in two shards, one of them
#   gboth     the whole gtest GPU suite as $GPIECES pieces (default 4 x $GSHARDS) that $GSHARDS processes take in
#             turn (default 6). Six fixed shards took 46-195 s each on an H100 in session 111 (the long tests land
#             where gtest's round-robin puts them); smaller pieces taken as processes free up even that out. Its
#             summary: the tests that ran and passed over all pieces, each failed piece's failed tests (or where its
#             log stops), the slowest tests (every test's time is in the logs gtest_g<i>.log, for a later split)
#   pyg       pytest's GPU tests (one GPU) in $PSHARDS processes side by side (default 3; MACHMOE_PYTEST_SHARD, dealt
#             round-robin by tests/python/sharding.py): their logs pytest_gpu_s<i>.log (each with its ten slowest
#             tests), their summary lines
#   suites    the whole GPU suite: gboth with pyg beside it, their summaries, the failed pytest tests and the failed
#             gtest assertions (a landing call's check)
#   san       compute-sanitizer memcheck and racecheck on the tests matching $SF
#   pack      everything under $OUT into one archive (a device call returns at most 8 files)
# Configurations: a name of machmoe-bench's (1.4B-256) or name=--T:16384:--d:4096:... for explicit sizes.
# The script exits 1 when a step that checks something failed: a build (build, apply, revert, variants), a test
# (gf, equiv, g0, g1, gboth, pyg, suites, san) or a shard or process of them; the measuring steps only print.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD; OUT=${OUT:-$root/build/gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
base=/tmp/base
start=$(date +%s)
failed=0  # 1 once a build or test step (or a shard or process of one) exits nonzero; the script's exit status
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
checked() { echo "$1 exit $2"; [ "$2" -eq 0 ] || failed=1; }  # a checking step's status: printed, kept for the exit
bench_args() { case "$1" in *=*) echo "${1#*=}" | tr ':' ' ';; *) echo "--config $1";; esac; }
cfg_name() { echo "${1%%=*}"; }
gtest_shard() {  # shard $1 of ${2:-2} of the gtest GPU suite ($SUITE_FILTER of it, default all), into $OUT/gtest_g$1.log
  GTEST_TOTAL_SHARDS=${2:-2} GTEST_SHARD_INDEX=$1 timeout 420 ./build/tests/machmoe_gpu_tests \
    --gtest_filter="${SUITE_FILTER:-*}" > "$OUT/gtest_g$1.log" 2>&1
}
gtest_piece() {  # gtest_shard, its exit status into $OUT/gtest_g$1.rc (for gboth's pool of processes)
  gtest_shard "$1" "$2"; echo $? > "$OUT/gtest_g$1.rc"
}
shard_summary() { grep -v "reference GEMM" "$OUT/gtest_g$1.log" | tail -n 2; }
bench_of() {
  case "$1" in
    base) echo "$base/build/bin/machmoe-bench";;
    new) echo ./build/bin/machmoe-bench;;
    *) echo "/tmp/bench_$1";;  # a variant's (the variants step)
  esac
}
for step in "$@"; do
  stamp "== $step"
  case "$step" in
  basebg)
    if [ ! -f /tmp/base.done ]; then
      ( rm -rf "$base"; tar -xf "${AB_BASE_TAR:?the base tree as a git archive}" -C /tmp; mkdir -p "$base/third_party"
        cp -r third_party/cutlass "$base/third_party/"
        cmake -S "$base" -B "$base/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMACHMOE_BUILD_TORCH=OFF > "$OUT/basebuild.log" 2>&1 &&
          cmake --build "$base/build" --parallel 8 --target machmoe-bench >> "$OUT/basebuild.log" 2>&1
        echo $? > /tmp/base.done ) &
    fi;;
  basewait) while [ ! -f /tmp/base.done ]; do sleep 2; done; echo "base build exit $(cat /tmp/base.done)";;
  build) MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build.log" 2>&1; checked build $?; tail -n 1 "$OUT/build.log";;
  variants)
    vf=${VARIANT_FILE:-src/gpu/token_rounding_kernels.cu}
    cp "$vf" /tmp/variant_own
    for v in ${VARIANTS:?name=path ...}; do
      name=${v%%=*}
      cp "${v#*=}" "$vf" && touch "$vf"
      cmake --build build --target machmoe-bench > "$OUT/build_variant_$name.log" 2>&1
      checked "variant $name: build" $?; cp build/bin/machmoe-bench "/tmp/bench_$name"
    done
    cp /tmp/variant_own "$vf" && touch "$vf"
    cmake --build build > "$OUT/build_variant_own.log" 2>&1; checked "own version: build" $?;;
  keep) cp ./build/bin/machmoe-bench "/tmp/bench_${KEEP:-main}" && echo "kept /tmp/bench_${KEEP:-main}";;
  apply|revert)
    patch=${AB_PATCH:?a git diff to apply}
    rev=(); [ "$step" = revert ] && rev=(-R)
    git apply "${rev[@]}" "$patch" || { echo "$step: $patch does not apply"; exit 3; }
    for f in $(git apply --numstat "$patch" | cut -f3); do [ -e "$f" ] && touch "$f"; done
    MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$OUT/build_$step.log" 2>&1
    checked "$step $patch: build" $?; tail -n 1 "$OUT/build_$step.log";;
  gf) timeout 300 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="${GF:-*TokenRounding*}" 2>&1 |
        grep -v "reference GEMM" | tail -n 3
    checked gf "${PIPESTATUS[0]}";;
  equiv) BASE_SEL=1 BASE_SRC=$base timeout 300 bash docs/measurements/2026-11-27-h100-session48/tr_equivalence_build.sh \
        > "$OUT/equivalence.txt" 2>&1; checked equivalence $?; tail -n 2 "$OUT/equivalence.txt";;
  ncu)
    for cfg in ${KCFGS:-1.4B-256}; do for rep in $(seq 1 "${NREPS:-2}"); do for side in ${NSIDES:-base new}; do
      ncu --clock-control none -k "regex:${KRX:-tr_}" --launch-count "${KLC:-5}" \
        --metrics gpu__time_duration.sum,sm__inst_executed.sum,launch__registers_per_thread \
        "$(bench_of $side)" $(bench_args "$cfg") --routing token_rounding --iters 1 --warmup 0 --warmup-ms 0 --time-ms 0 \
        --stage-runs 1 > /tmp/ab_ncu.txt 2>&1
      echo "-- $(cfg_name "$cfg") $side rep $rep"
      grep -E "^  [a-z_]+.*<|tr_[a-z_]*kernel|gpu__time|sm__inst|registers" /tmp/ab_ncu.txt | grep -v "==PROF==" | cut -c1-120
    done; done; done 2>&1 | tee -a "$OUT/ncu.txt";;
  tab)
    for r in $(seq 1 "${ROUNDS:-1}"); do for cfg in ${TCFGS:-1.4B-256}; do for side in ${SIDES:-base new}; do
      for route in ${ROUTES:-token_rounding topk}; do
        echo "== round $r cfg $(cfg_name "$cfg") $side $route"
        "$(bench_of $side)" $(bench_args "$cfg") --routing "$route" --iters 10 --warmup 3 --stage-runs 3 ${TAB_ARGS:-} 2>&1 |
          grep -E "^config |^  (forward|backward) |forward/(token_rounding|topk|routing|y_chunk_plan)|backward/router"
      done; done; done; done 2>&1 | tee -a "$OUT/tab.txt";;
  g0|g1) gtest_shard "${step#g}"; checked "g${step#g}" $?; shard_summary "${step#g}";;
  gboth) n=${GSHARDS:-6}; pieces=${GPIECES:-$((4 * n))}
    rm -f "$OUT"/gtest_g*.log "$OUT"/gtest_g*.rc
    export -f gtest_shard gtest_piece; export OUT SUITE_FILTER="${SUITE_FILTER:-*}"
    seq 0 $((pieces - 1)) | xargs -P "$n" -I{} bash -c "gtest_piece {} $pieces"
    ran=0; passed=0; bad=()  # bad: "piece:status" of each failed piece
    for i in $(seq 0 $((pieces - 1))); do
      rc=$(cat "$OUT/gtest_g$i.rc" 2>/dev/null || echo none)  # none: the piece never ran
      r=$(sed -nE 's/^\[==========\] ([0-9]+) tests? from .* ran\..*/\1/p' "$OUT/gtest_g$i.log" | tail -n 1)
      p=$(sed -nE 's/^\[  PASSED  \] ([0-9]+) tests?\..*/\1/p' "$OUT/gtest_g$i.log" | tail -n 1)
      ran=$((ran + ${r:-0})); passed=$((passed + ${p:-0}))
      [ "$rc" = 0 ] || { bad+=("$i:$rc"); failed=1; }
    done
    echo "gtest: $pieces pieces in $n processes, $ran tests ran, $passed passed, failed pieces: $([ ${#bad[@]} -gt 0 ] && echo "${bad[@]%%:*}" || echo none)"
    for b in "${bad[@]}"; do  # its failed tests, or (a crash, a timeout) where its log stops
      i=${b%%:*}; echo "g$i exit ${b#*:}:"
      grep -E "^\[  FAILED  \] [A-Za-z]" "$OUT/gtest_g$i.log" | sed -E 's/ \([0-9]+ ms\)$//' | sort -u | head -n 5 | grep . || shard_summary "$i"
    done
    echo "slowest tests (ms):"
    cat "$OUT"/gtest_g*.log | sed -nE 's/^\[       OK \] (.*) \(([0-9]+) ms\)$/\2 \1/p' | sort -rn | head -n 8;;
  pyg) pids=(); n=${PSHARDS:-3}
    for i in $(seq 0 $((n - 1))); do
      MACHMOE_PYTEST_SHARD=$i/$n MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY=$root/build/lib/libmachmoe_torch.so \
        timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=10 -m "gpu and not multigpu" tests/python \
        > "$OUT/pytest_gpu_s$i.log" 2>&1 & pids+=($!)
    done
    for i in $(seq 0 $((n - 1))); do
      wait "${pids[$i]}"; rc=$?; echo "pytest shard $i/$n exit $rc: $(tail -n 1 "$OUT/pytest_gpu_s$i.log")"
      [ "$rc" -eq 0 ] || failed=1
    done;;
  suites)
    OUT=$OUT bash "$0" pyg > "$OUT/pyg_summary.txt" 2>&1 & pyg=$!
    OUT=$OUT bash "$0" gboth | grep -vE "^\[[0-9]+s\]"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    wait "$pyg" || failed=1; grep "pytest shard" "$OUT/pyg_summary.txt"
    grep -hE "^FAILED|^ERROR" "$OUT"/pytest_gpu_s*.log | head -20
    grep -h -A3 "Failure$" "$OUT"/gtest_g*.log | head -40;;  # (gboth named the failed tests)
  san) for tool in memcheck racecheck; do  # (the test binary's 120 s hang watchdog off: the tools slow tests past it)
      MACHMOE_GPU_TEST_TIMEOUT_S=0 timeout 280 compute-sanitizer --tool $tool --error-exitcode 9 ./build/tests/machmoe_gpu_tests --gtest_brief=1 \
        --gtest_filter="${SF:-*TokenRounding*}" > "$OUT/sanitize_$tool.log" 2>&1
      checked "$tool" $?; echo "  $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$OUT/sanitize_$tool.log" | sort -u | tr '\n' ' ')"
    done;;
  pack) (cd "$OUT" && ls | grep -v '^pack.tar.xz$' > /tmp/ab_pack && tar -cJf pack.tar.xz -T /tmp/ab_pack && xargs rm -f < /tmp/ab_pack);;
  *) echo "unknown step $step"; exit 2;;
  esac
done
stamp done
exit "$failed"
