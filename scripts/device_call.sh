# Shared pieces of a measurement call on the device machine, sourced by the scripts under docs/measurements/ (each
# session's calls had repeated them): `source scripts/device_call.sh` from the repository root, after `set -uo pipefail`.
#   call_start         $OUT made, the clock started, the GPU's name, driver, power limit and top clock printed
#   st MSG             MSG after the seconds since call_start
#   left               seconds left of the call's ${CALL_S:-560}
#   carried_binaries   checks that the binaries built on the development machine and carried start here; where they
#                      need the CUDA runtime of the `nvidia` Python packages (cu13), puts it on LD_LIBRARY_PATH (exits 3
#                      if they still do not start)
#   with_env "A=1 B=2" CMD...   CMD in a subshell with those variables exported (`env A=1 fn` cannot run a shell
#                      function; an empty list runs CMD as it is)
#   gtest_gate FILTER  the GPU gtests matching FILTER as a call's first check (120 s at most): their summary lines and
#                      any failure
#   bench_routing "A=1" CONFIG   machmoe-bench on CONFIG, top-K, 300 ms windows, with those variables set (an A/B
#                      side): its forward and backward lines and the routing stages
export OUT=${OUT:-/tmp/out}
call_start() {
  mkdir -p "$OUT"
  CALL_START=$(date +%s)
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
}
st() { echo "[$(( $(date +%s) - CALL_START ))s] $*"; }
left() { echo $(( ${CALL_S:-560} - ($(date +%s) - CALL_START) )); }
carried_binaries() {
  ./build/bin/machmoe-bench --help > /dev/null 2>&1 && return 0
  local lib
  lib=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
  export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  ./build/bin/machmoe-bench --help > /dev/null 2>&1 || { ./build/bin/machmoe-bench --help 2>&1 | head -5; exit 3; }
  echo "binaries start with $lib on the library path"
}
with_env() {
  local vars=$1; shift
  (if [ -n "$vars" ]; then export $vars; fi; "$@")
}
gtest_gate() {
  timeout 120 ./build/tests/machmoe_gpu_tests --gtest_brief=1 --gtest_filter="$1" 2>&1 |
    grep -E "PASSED|FAILED|tests ran|Failure" | head -20
}
bench_routing() {
  with_env "$1" timeout 40 ./build/bin/machmoe-bench --config "$2" --routing topk --warmup-ms 300 --time-ms 300 2>&1 |
    grep -E "^  (forward|backward) |topk_scores|routing_metadata"
}
