"""Session 70: does the benchmark runner's own step (machmoe alone, no peer in the process) show the 1.8-2.2 ms that
session 69's side-by-side run found on the 120B rows, and if so, where does it go?

The session-69 probe (../2026-11-30-session69-prepared/step_vs_phases.py, run at the start of session 70) timed a step
that sets the gradients to None before its start event and found step = forward + backward within 0.3 ms. The runner
(machmoe/benchmark/runner.py) records its start event before impl.zero_grad(). This script, on one process:
  1. runs runner.measure() on machmoe alone (its forward_ms, backward_ms, fwdbwd_ms, as the side-by-side run);
  2. times the runner's step and the probe's step in alternating 1 s blocks;
  3. profiles two steps of each kind and prints the CUDA kernels and their total times, so an extra kernel shows.
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from machmoe.benchmark import configs as C
from machmoe.benchmark import impls as I
from machmoe.benchmark import runner as R


def block(kind, impl, xr, go, ms):
    times = []
    t0 = time.perf_counter()
    while not times or (time.perf_counter() - t0) * 1e3 < ms:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if kind == "runner-step":      # the runner's: start event, then zero_grad, forward, backward
            s.record(); impl.zero_grad(); xr.grad = None; impl.forward(xr).output.backward(go); e.record()
        else:                          # the probe's: zero_grad, then the start event
            impl.zero_grad(); xr.grad = None; s.record(); impl.forward(xr).output.backward(go); e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), len(times)


def kernels(kind, impl, xr, go):
    for _ in range(3):
        block(kind, impl, xr, go, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(2):
            block(kind, impl, xr, go, 0)
        torch.cuda.synchronize()
    print(f"--- {kind}: two steps, by CUDA time")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="120B-512,120B-2048")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    s = R.Settings(device="cuda", dtype="bf16", warmup=3, iters=10, warmup_ms=300.0, time_ms=300.0,
                   check_tokens=4096, seed=0)
    for name in a.configs.split(","):
        cfg = C.select(name)[0]
        weights = I.Weights(cfg, dtype, dev, 0)
        x, go = I.make_inputs(cfg, dtype, dev, 0)
        impl = I.build("machmoe", weights, cfg)
        print(f"{name} (T={cfg.T}, d={cfg.d}, n={cfg.n}, E={cfg.E}, K={cfg.K})", flush=True)
        for r in range(2):
            m = R.measure(impl, x, go, cfg, s, weights.values())
            print(f"  runner.measure round {r}: forward {m['forward_ms']:.3f} backward {m['backward_ms']:.3f} "
                  f"fwdbwd {m['fwdbwd_ms']:.3f} gap {m['fwdbwd_ms'] - m['forward_ms'] - m['backward_ms']:+.3f}",
                  flush=True)
        xr = x.detach().clone().requires_grad_()
        for _ in range(2):
            for kind in ("runner-step", "probe-step"):
                med, n = block(kind, impl, xr, go, 1000)
                print(f"  {kind:12s} {med:8.3f} ms  n={n}", flush=True)
        for kind in ("runner-step", "probe-step"):
            kernels(kind, impl, xr, go)
        del impl, weights, x, go, xr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
