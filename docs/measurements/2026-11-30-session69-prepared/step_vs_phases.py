"""Why machmoe's forward + backward step took 1.8-2.2 ms more than its forward and backward timed apart on the 120B
rows of session 69's side-by-side run (and 0-0.2 ms on the 30B rows). Written in session 69, not run (its device time
was spent).

For each configuration, on `machmoe.MoE` through the benchmark's own implementation wrapper (shared weights, x that
requires grad, gradients set to None before each repetition), in the same process, alternating blocks of:
  forward   - a forward alone (its output dropped), as the runner's forward_ms;
  backward  - a forward, a synchronize, then the backward timed alone, as the runner's backward_ms;
  step      - zero_grad, forward, backward, timed as one, as the runner's fwdbwd_ms, with one more event between
              the forward and the backward (no synchronize), so the step's two parts are timed separately.
It prints the medians, the caching allocator's device allocations and retries per block (a cudaMalloc or a cache
flush inside the timed calls would show there), and the SM clock and power sampled by nvidia-smi across each block,
so that a clock difference and allocator work can be told apart.

    python3 step_vs_phases.py [--configs 120B-512,30B-256] [--ms 1500] [--blocks 3]
"""
import argparse
import statistics
import subprocess
import threading
import time

import torch

from machmoe.benchmark import configs as C
from machmoe.benchmark import impls as I


class ClockSampler:
    """SM clock (MHz) and power (W) about every 100 ms in a thread, through nvidia-smi's query (no pynvml needed)."""

    def __init__(self):
        self.samples, self._stop, self._t = [], threading.Event(), None

    def __enter__(self):
        def run():
            while not self._stop.is_set():
                try:
                    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                          "-i", str(torch.cuda.current_device())], capture_output=True, text=True,
                                         timeout=2).stdout.strip().split(",")
                    self.samples.append((float(out[0]), float(out[1])))
                except Exception:  # noqa: BLE001 - a missed sample only
                    pass
                self._stop.wait(0.1)
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> str:
        if not self.samples:
            return "no clock samples"
        mhz = [s[0] for s in self.samples]
        w = [s[1] for s in self.samples]
        return f"SM {statistics.median(mhz):.0f} MHz (min {min(mhz):.0f}), {statistics.median(w):.0f} W, n={len(mhz)}"


def alloc_counters():
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_alloc_retries", 0), s.get("segment.all.current", 0)


def run_block(kind, impl, xr, go, ms):
    def fwd():
        return impl.forward(xr)

    times, t_fwd, t_bwd = [], [], []
    c0 = alloc_counters()
    with ClockSampler() as clock:
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < ms:
            impl.zero_grad()
            xr.grad = None
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            if kind == "forward":
                e[0].record(); fwd(); e[1].record(); e[1].synchronize()
                times.append(e[0].elapsed_time(e[1]))
            elif kind == "backward":
                o = fwd().output
                torch.cuda.synchronize()
                e[0].record(); o.backward(go); e[1].record(); e[1].synchronize()
                times.append(e[0].elapsed_time(e[1]))
                del o
            else:
                e[0].record()
                o = fwd().output
                e[1].record()
                o.backward(go)
                e[2].record(); e[2].synchronize()
                times.append(e[0].elapsed_time(e[2]))
                t_fwd.append(e[0].elapsed_time(e[1]))
                t_bwd.append(e[1].elapsed_time(e[2]))
                del o
    c1 = alloc_counters()
    med = statistics.median(times)
    extra = ""
    if t_fwd:
        extra = f" (its forward {statistics.median(t_fwd):.3f}, its backward {statistics.median(t_bwd):.3f})"
    print(f"  {kind:8s} {med:8.3f} ms{extra}  n={len(times)}  cudaMalloc +{c1[0] - c0[0]}, retries "
          f"+{c1[1] - c0[1]}, segments {c1[2]}  {clock.summary()}", flush=True)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="120B-512,30B-256,120B-2048")
    ap.add_argument("--ms", type=float, default=1500.0)
    ap.add_argument("--blocks", type=int, default=3)
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    for name in a.configs.split(","):
        cfg = C.select(name)[0]
        weights = I.Weights(cfg, dtype, dev, 0)
        x, go = I.make_inputs(cfg, dtype, dev, 0)
        xr = x.detach().clone().requires_grad_()
        impl = I.build("machmoe", weights, cfg)
        print(f"{name} (T={cfg.T}, d={cfg.d}, n={cfg.n}, E={cfg.E}, K={cfg.K})", flush=True)
        run_block("step", impl, xr, go, 500)  # warm-up: the allocator's cache and the clock
        for _ in range(a.blocks):
            for kind in ("forward", "backward", "step"):
                run_block(kind, impl, xr, go, a.ms)
        del impl, weights, x, go, xr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
