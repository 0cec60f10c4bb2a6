"""What torch.autocast costs the layer: one training step (forward + backward) of machmoe.MoE with bf16 parameters,
against the same layer with float32 parameters under torch.autocast("cuda", dtype=torch.bfloat16), which casts the
weights to bf16 in each forward and the weight gradients back to float32 in each backward. CUDA-event medians over
at least --time-ms of steps after --warmup-ms of untimed ones; the two in turn, --rounds rounds; peak allocator
memory of a step over what was allocated before it."""
import argparse
import copy
import statistics

import torch

import machmoe

CONFIGS = {"7B-256": (24576, 1536, 256, 128, 8), "30B-256": (32768, 4096, 1024, 256, 16)}  # T, d, n, E, K


def step_times(m, x, dy, autocast, warmup_ms, time_ms):
    def step():
        for p in m.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = m(x).output
        out.backward(dy)

    def run_for(ms, timed):
        times, spent = [], 0.0
        while spent < ms or (timed and len(times) < 10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            t = a.elapsed_time(b)
            spent += t
            times.append(t)
        return times

    run_for(warmup_ms, False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(run_for(time_ms, True)), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="7B-256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup-ms", type=float, default=300)
    ap.add_argument("--time-ms", type=float, default=300)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in a.configs.split(","):
        T, d, n, E, K = CONFIGS[name]
        torch.manual_seed(0)
        fp32 = machmoe.MoE(d, n, E, K, device="cuda", dtype=torch.float32)
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        res = {"bf16 parameters": [], "fp32 parameters, autocast": []}
        for _ in range(a.rounds):
            res["bf16 parameters"].append(step_times(bf16, x, dy, False, a.warmup_ms, a.time_ms))
            res["fp32 parameters, autocast"].append(step_times(fp32, x, dy, True, a.warmup_ms, a.time_ms))
        for k, v in res.items():
            print(f"{name} (T={T} d={d} n={n} E={E} K={K}) {k}: step ms per round "
                  f"{', '.join(f'{t:.3f}' for t, _ in v)}; mean {statistics.mean(t for t, _ in v):.3f}; "
                  f"peak over baseline {max(p for _, p in v):.0f} MiB")


if __name__ == "__main__":
    main()
