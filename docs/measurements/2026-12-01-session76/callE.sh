#!/usr/bin/env bash
# Session 76, call E (one H200, fresh): the start-phase stagger experiment. Every CTA runs the same tiles, so the
# persistent CTAs reach their epilogues together; the dH kernel's cooperative epilogue (H read, dH and A' written:
# 320 KiB a tile) then meets every other CTA's at HBM. MACHMOE_HOPPER_STAGGER_<FAMILY>=c delays CTA group g (of 4) by
# g x c x k-blocks cycles before its first tile. ncu cycles of the dH kernel (one launch, unlocked clock, sides
# alternating), then the layer's stages (sustained, 300 ms windows) with the stagger on dH alone and on every family.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
st build; bash scripts/ab.sh build 2>&1 | tail -n 1
st ncu
python3 scripts/ncu_ab.py run --kernel EpilogueActivationGrad --launches 1 --configs 120B-2048,7B-256 \
  --side off --side s160:MACHMOE_HOPPER_STAGGER_DH=160 --side s328:MACHMOE_HOPPER_STAGGER_DH=328 \
  --timeout 60 --out "$OUT/callE_ncu_dh.csv" > "$OUT/callE_ncu_dh.log" 2>&1
echo "ncu exit $?"; python3 scripts/ncu_ab.py table "$OUT/callE_ncu_dh.csv" | tee "$OUT/callE_ncu_dh_table.md"
st layer
all="MACHMOE_HOPPER_STAGGER_UP=328 MACHMOE_HOPPER_STAGGER_DOWN=328 MACHMOE_HOPPER_STAGGER_DX=328 MACHMOE_HOPPER_STAGGER_DW1=328 MACHMOE_HOPPER_STAGGER_DW2=328 MACHMOE_HOPPER_STAGGER_DH=328"
for round in 1 2; do
  for cfg in 120B-2048 30B-1024 120B-512 7B-256; do
    for side in off dh all; do
      [ $(( $(date +%s) - S )) -lt 500 ] || break 3
      case $side in off) envs="";; dh) envs="MACHMOE_HOPPER_STAGGER_DH=328";; all) envs="$all";; esac
      echo "== $cfg $side round $round"
      env $envs timeout 40 ./build/bin/machmoe-bench --config $cfg --warmup-ms 300 --time-ms 300 --stage-runs 3 2>/dev/null |
        grep -E "^  (forward|backward) |/(dh_kernel|dw1|dw2|dx_expanded|up_projection|down_projection) "
    done
  done
done > "$OUT/callE_layer.txt"
cat "$OUT/callE_layer.txt"
st done
