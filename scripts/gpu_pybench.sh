#!/usr/bin/env bash
# One time-limited step of `python -m machmoe.benchmark` on a GPU machine without network, for runs longer than one
# batch job or device call may take: builds the checkout if needed, installs upstream SonicMoE from .peer_wheels/ if
# needed (scripts/peer_wheels.sh), then continues the run in JSON with --append for at most SECONDS. Call it again
# (same JSON, same machine or with the JSON copied back) until every configuration is in; each call reports what is
# done. Build outputs, the peers' install and their JIT caches (.peer_cache/) stay in ignored folders, so a later
# call on the same machine starts at once; on a fresh machine the first call spends ~100 s building and SonicMoE's
# first configuration ~140-475 s compiling (MACHMOE_PEER_CACHE_OUT=1 returns the caches under $OUT, and a later fresh
# machine restores them from .peer_wheels/peer_cache.tar.xz).
#
#   bash scripts/gpu_pybench.sh SECONDS CONFIGS [JSON] [extra benchmark options...]
#   e.g. bash scripts/gpu_pybench.sh 540 main,sweeps .pybench/results.json
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/gpu_pybench.sh SECONDS CONFIGS [JSON] [extra benchmark options...]" >&2
  exit 2
fi
budget="$1"; configs="$2"; json="${3:-.pybench/results.json}"; shift $(( $# >= 3 ? 3 : 2 ))
case "$budget" in
  ''|*[!0-9]*) echo "gpu_pybench: SECONDS '$budget' is not a whole number of seconds" >&2; exit 2;;
esac
budget=$((10#$budget))
[ "$budget" -ge 1 ] || { echo "gpu_pybench: SECONDS must be at least 1, got $budget" >&2; exit 2; }
case "$json" in  # an option where JSON goes would be taken for the path (and dropped from the options)
  -*) echo "gpu_pybench: JSON '$json' starts with '-': give the JSON path before any extra option" >&2; exit 2;;
esac
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "gpu_pybench: no nvidia-smi"
if [ ! -f build/lib/libmachmoe_torch.so ]; then
  # CUTLASS's headers carried as one small archive (scripts/peer_wheels.sh fetch) on a machine without them.
  if [ ! -d third_party/cutlass/cutlass_library/source/include ] && [ -f .peer_wheels/cutlass_headers.tar.xz ]; then
    tar -xJf .peer_wheels/cutlass_headers.tar.xz && echo "gpu_pybench: CUTLASS's headers unpacked"
  fi
  mkdir -p build
  log=build/gpu_pybench_build.log
  if ! MACHMOE_JOBS="$(nproc)" bash scripts/build.sh > "$log" 2>&1; then
    tail -n 30 "$log"; echo "gpu_pybench: build failed (whole log: $log)" >&2; exit 1
  fi
  tail -n 1 "$log"
fi
if [ -d .peer_wheels ] && [ ! -d .peer_site/sonicmoe ]; then
  bash scripts/peer_wheels.sh install | tail -n 1
  # The run is for the comparison with the peers: without them it would record machmoe's rows alone.
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "gpu_pybench: installing the peers from .peer_wheels/ failed, so upstream SonicMoE is missing" >&2; exit 1
  fi
fi
# Upstream's JIT caches from an earlier machine (peer_cache.tar.xz, as this script leaves it under $OUT), so that a
# fresh machine skips most of the first configuration's compilation (475 s on an H200 in session 69).
if [ -f .peer_wheels/peer_cache.tar.xz ] && [ ! -d .peer_cache ]; then
  tar -xJf .peer_wheels/peer_cache.tar.xz && echo "gpu_pybench: upstream's JIT caches restored from .peer_wheels/peer_cache.tar.xz"
fi
if [ -d .peer_site ]; then eval "$(bash scripts/peer_wheels.sh env)"; fi
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" MACHMOE_TORCH_LIBRARY="$root/build/lib/libmachmoe_torch.so"
export PYTHONUNBUFFERED=1 QUACK_CACHE_DIR="$root/.peer_cache/quack" TRITON_CACHE_DIR="$root/.peer_cache/triton"
mkdir -p "$root/.peer_cache" "$(dirname "$json")"
left=$(( budget - ($(date +%s) - t0) ))
if [ "$left" -lt 1 ]; then  # timeout 0 would set no limit at all, a negative one is refused
  echo "gpu_pybench: the budget of $budget s was spent in setup ($(( $(date +%s) - t0 )) s); call again to run" >&2
  exit 124
fi
echo "gpu_pybench: setup took $(( $(date +%s) - t0 )) s; benchmark for at most ${left} s: $configs"
# No bar off a terminal: one timestamped line per step, so a step cut off by the limit still shows what ran.
timeout --kill-after=10 "$left" python3 -m machmoe.benchmark --configs "$configs" --json "$json" --append "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "gpu_pybench: time limit reached; call again to continue"; fi
python3 - "$json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except FileNotFoundError:
    print("gpu_pybench: no configuration finished yet"); raise SystemExit
print("gpu_pybench: done on", d["device"]["name"] + ":", ", ".join(e["config"]["name"] for e in d["configs"]))
PY
# A batch machine that hands back only what is under $OUT (and may replace the JSON's folder on the next call): a copy
# of the JSON and its Markdown there, so a finished run's per-round figures are not lost with the machine.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -f "$json" ]; then
  cp "$json" "$OUT/" && { [ ! -f "$(dirname "$json")/results.md" ] || cp "$(dirname "$json")/results.md" "$OUT/"; }
  echo "gpu_pybench: copied $(basename "$json") to \$OUT"
fi
# With MACHMOE_PEER_CACHE_OUT=1: the JIT caches for a later machine (carry them back as
# .peer_wheels/peer_cache.tar.xz), if they fit what a device call returns (16 MiB a file).
if [ "${MACHMOE_PEER_CACHE_OUT:-0}" = 1 ] && [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -d .peer_cache ]; then
  tar -cf - .peer_cache 2>/dev/null | xz -T0 -6 > "$OUT/peer_cache.tar.xz"
  size=$(stat -c %s "$OUT/peer_cache.tar.xz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    rm -f "$OUT/peer_cache.tar.xz"; echo "gpu_pybench: JIT caches too large to return ($size bytes compressed)"
  else
    echo "gpu_pybench: JIT caches in \$OUT/peer_cache.tar.xz ($size bytes)"
  fi
fi
exit $rc
