#!/usr/bin/env bash
# Session 62 call D: the landed code (dX's router term in the gather-sum, no experiment switch): build, the whole gtest
# GPU suite in two shards, pytest's GPU tests.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash scripts/ab.sh build gboth pyg 2>&1 | grep -v "^$"
