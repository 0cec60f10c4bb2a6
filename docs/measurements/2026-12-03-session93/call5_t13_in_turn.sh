#!/usr/bin/env bash
# Session 93, call 5 (one H200): T13 in turn. Call 3's one run a shape put gpt-oss-20b's backward efficiency at d = n =
# 2880 at 0.9498 of its 2944 neighbour's (target >= 0.95), where 2944's backward ran 2.4 % faster than in session 91
# (12.465 against 12.762 ms) and 2880's 1.0 % slower. Here each model's two shapes alternate, A B B A twice (8 runs a
# model, 300 ms windows), on main's GPU code (no diff), and the ratio is taken on the means of each shape's runs.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); st() { echo "[$(( $(date +%s) - S ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
git log -1 --format='%h %s' | cut -c1-100; git status --short | head -5
touch src/gpu/hopper/*  # a warm machine may hold objects built from call 4's probe diff
st build; bash scripts/ab.sh build 2>&1 | grep -E "exit"
B="./build/bin/machmoe-bench --routing topk --warmup-ms 300 --time-ms 300"
i=0
for model in gptoss20b gptoss120b; do
  for round in 1 2; do
    for shape in 2880 2944 2944 2880; do
      [ $(( $(date +%s) - S )) -lt 560 ] || { echo "out of time before $model-$shape"; break 3; }
      i=$((i + 1))
      timeout 60 $B --config $model-$shape --json "/tmp/t13_run$(printf %02d $i)_$model-$shape.json" \
        >> "$OUT/call5_t13.txt" 2>&1 || echo "exit $? ($model-$shape)"
    done
  done
done
python3 - "$OUT/call5_t13_in_turn.json" /tmp/t13_run*.json <<'PY' | tee "$OUT/call5_t13_summary.txt"
import json, sys, statistics as stat
runs = [r for p in sorted(sys.argv[2:]) for r in json.load(open(p))]
json.dump(runs, open(sys.argv[1], "w"), indent=1)
by = {}
for r in runs:
    key = (r["E"], r["d"])
    by.setdefault(key, []).append(r)
    print(f"E={r['E']} d={r['d']}: forward {r['forward_ms']:.3f} ms ({r['efficiency_forward']:.4f})  "
          f"backward {r['backward_ms']:.3f} ms ({r['efficiency_backward']:.4f})")
for E in sorted({k[0] for k in by}):
    a, b = by.get((E, 2880), []), by.get((E, 2944), [])
    if not a or not b: continue
    for pas in ("forward", "backward"):
        ea = stat.mean(r[f"efficiency_{pas}"] for r in a); eb = stat.mean(r[f"efficiency_{pas}"] for r in b)
        print(f"E={E} {pas}: 2880 {ea:.4f} (n={len(a)}), 2944 {eb:.4f} (n={len(b)}), ratio {ea / eb:.4f}")
PY
st done
