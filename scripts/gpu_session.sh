#!/usr/bin/env bash
# One device call within a small lease: build, the GPU suite, pytest (CPU + GPU) and the 12-configuration benchmark,
# each under its own time limit so the call always returns. Logs under $OUT.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
logs="${OUT:-$root/build/gpu-logs}"; mkdir -p "$logs"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MACHMOE_JOBS="$(nproc)" bash scripts/build.sh 2>&1 | tail -n 1
# Every step's failure reaches the exit status; a failed build stops here (the rest would run stale binaries).
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_session: build failed" >&2; exit 1; }
status=0
timeout 200 ./build/tests/machmoe_gpu_tests --gtest_brief=1 2>&1 | tee "$logs/gpu_tests.log" | grep -vE "reference GEMM" | tail -n 4
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_session: GPU tests failed" >&2; status=1; }
MACHMOE_IN_TREE=1 MACHMOE_TORCH_LIBRARY="$root/build/lib/libmachmoe_torch.so" timeout 120 python3 -m pytest -q \
  -p no:cacheprovider -m "not multigpu" tests/python 2>&1 | tee "$logs/pytest.log" | tail -n 2
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_session: pytest failed" >&2; status=1; }
timeout 150 ./build/bin/machmoe-bench --all-configs --iters 3 --warmup 1 --json "$logs/bench.json" 2>&1 |
  tee "$logs/bench.log" | tail -n 16
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_session: benchmark failed" >&2; status=1; }
exit $status
