#!/usr/bin/env bash
# Session 63 call E: pytest's GPU tests on the landed code (call D's warm machine and build).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}
bash scripts/ab.sh pyg
