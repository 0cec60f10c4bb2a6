#!/usr/bin/env bash
# The main job, from nothing: set up, build, run one MoE layer forward + backward (sonicmoe-bench).
# Extra arguments go to sonicmoe-bench (see: bash scripts/main.sh --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
exec "${SONICMOE_BUILD_DIR:-$root/build}/bin/sonicmoe-bench" "$@"
