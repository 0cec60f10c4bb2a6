"""Session 70, second probe: runner.measure()'s step is 1.7-2.0 ms slower than forward + backward on 120B (512,256,16),
while the same step timed in blocks after measure() is not (call2_runner_step.txt). Two differences remain between
the two: what ran just before (measure() times the step right after its forward-only and backward-only loops; the
blocks ran after measure()'s memory section, which empties the allocator's cache), and how long the load had lasted.

This replays measure()'s timing sequence with baselines.time_ms and the same settings, and around each timing prints
the allocator's device allocations and frees, and the SM clock and power (nvidia-smi, every 100 ms):
  A  forward time_ms, the backward loop, step time_ms           (measure()'s order)
  B  step time_ms again, at once                                 (same allocator state, load lasted longer)
  C  torch.cuda.empty_cache(), step time_ms                      (the blocks' allocator state)
  D  the backward loop again, then step time_ms                  (is it the loop before?)
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "2026-11-30-session69-prepared"))
from step_vs_phases import ClockSampler  # noqa: E402

from machmoe.benchmark import configs as C  # noqa: E402
from machmoe.benchmark import impls as I  # noqa: E402
from machmoe.benchmark.baselines import time_ms  # noqa: E402


def counters():
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("segment.all.current", 0)


def timed(label, fn):
    c0 = counters()
    with ClockSampler() as clock:
        ms = fn()
    c1 = counters()
    print(f"  {label:34s} {ms:8.3f} ms  cudaMalloc +{c1[0] - c0[0]} cudaFree +{c1[1] - c0[1]} segments {c1[2]}  "
          f"{clock.summary()}", flush=True)
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="120B-512,30B-256")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    W, N, WMS, TMS = 3, 10, 300.0, 300.0
    for name in a.configs.split(","):
        cfg = C.select(name)[0]
        weights = I.Weights(cfg, dtype, dev, 0)
        x, go = I.make_inputs(cfg, dtype, dev, 0)
        xr = x.detach().clone().requires_grad_()
        impl = I.build("machmoe", weights, cfg)
        print(f"{name} (T={cfg.T}, d={cfg.d}, n={cfg.n}, E={cfg.E}, K={cfg.K})", flush=True)

        def fwd():
            return impl.forward(xr)

        def step():
            impl.zero_grad()
            xr.grad = None
            fwd().output.backward(go)

        def backward_loop():  # measure()'s backward timing, verbatim in effect
            for _ in range(W):
                step()
            t0 = time.perf_counter()
            while (time.perf_counter() - t0) * 1e3 < WMS:
                step()
                torch.cuda.synchronize()
            times = []
            t0 = time.perf_counter()
            while len(times) < N or (time.perf_counter() - t0) * 1e3 < TMS:
                impl.zero_grad()
                xr.grad = None
                o = fwd().output
                torch.cuda.synchronize()
                times.append(time_ms(lambda: o.backward(go), dev, 0, 1))
                del o
            return sorted(times)[len(times) // 2]

        step()  # first call
        torch.cuda.synchronize()
        for rnd in range(2):
            print(f" round {rnd}")
            f = timed("A forward time_ms", lambda: time_ms(fwd, dev, W, N, WMS, TMS))
            b = timed("A backward loop", backward_loop)
            s = timed("A step time_ms", lambda: time_ms(step, dev, W, N, WMS, TMS))
            print(f"  A gap {s - f - b:+.3f}")
            timed("B step time_ms again", lambda: time_ms(step, dev, W, N, WMS, TMS))
            torch.cuda.empty_cache()
            timed("C empty_cache, step time_ms", lambda: time_ms(step, dev, W, N, WMS, TMS))
            timed("D backward loop", backward_loop)
            timed("D step time_ms", lambda: time_ms(step, dev, W, N, WMS, TMS))
        del impl, weights, x, go, xr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
