#!/usr/bin/env bash
# The main job, from nothing: set up, build, run one MoE layer forward + backward (machmoe-bench).
# Extra arguments go to machmoe-bench (see: bash scripts/main.sh --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
bash "$root/scripts/build.sh"
exec "${MACHMOE_BUILD_DIR:-$root/build}/bin/machmoe-bench" "$@"
