#!/usr/bin/env bash
# Session 112, call 2 (the same carried binaries as call1.sh, the machine still warm): ncu --set full of the fused
# router GEMM + top-K kernel on 1.4B-256 with top-K, one launch, under each warp grid. Its output is
# ncu_full_call2.tar.xz (ncu_full_4.txt: 4 x 2 warps; ncu_full_8.txt: 8 x 1).
for wm in 4 8; do
  MACHMOE_ROUTER_TOPK_WARPS=$wm timeout 100 ncu --clock-control none --kernel-name-base mangled -k "regex:router_topk" \
    --launch-count 1 --set full ./build/bin/machmoe-bench --config 1.4B-256 --routing topk --iters 1 --warmup 0 \
    --warmup-ms 0 --time-ms 0 --stage-runs 1 > "$OUT/ncu_full_$wm.txt" 2>&1
  echo "== $wm rc $?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Waves Per|Block Limit|L2 Hit|L1/TEX Hit|Issue Slots|Warp Cycles Per Issued|Shared Memory Configuration|Dynamic Shared" \
    "$OUT/ncu_full_$wm.txt" | head -45
done
