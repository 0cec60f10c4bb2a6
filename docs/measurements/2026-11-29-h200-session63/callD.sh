#!/usr/bin/env bash
# Session 63 call D: the whole gtest GPU suite (two shards side by side) on the landed code (the dH kernel's wide tile
# also at n = 256 and 512 where d >= 4096).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}
bash scripts/ab.sh build gboth
