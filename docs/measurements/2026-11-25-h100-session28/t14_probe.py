"""Session 28: why an isolated module forward is slower after a forward+backward (alternating) than forward-only.
Prints, per config: fwd GPU time (event before call -> event after) in both patterns for module and C++, the
allocator's device alloc counts across the alternating loop, and a profiler timeline of one alternating forward."""
import os, statistics, sys, time
import torch
import machmoe
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case


def ev():
    return torch.cuda.Event(enable_timing=True)


for name in sys.argv[1:] or ["7B-256"]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    for _ in range(5):
        case.refill(); case.module_forward(); case.module_step()
    torch.cuda.synchronize()
    st0 = torch.cuda.memory_stats()

    def alternating(reps=20, step=True, sleep_ms=0.0):
        f = []
        for _ in range(reps):
            case.refill()
            torch.cuda.synchronize()
            if sleep_ms:
                time.sleep(sleep_ms / 1e3)
            a, b = ev(), ev()
            a.record(); case.module_forward(); b.record()
            torch.cuda.synchronize()
            if step:
                case.module_step()
            f.append(a.elapsed_time(b) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(f)

    alt = alternating()
    st1 = torch.cuda.memory_stats()
    fwd_only = alternating(step=False)
    alt2 = alternating()
    alt_sleep = alternating(sleep_ms=5)
    t = case.cpp(3, 20, True)
    cpp_fwd = statistics.median(t[:, 0].tolist()) * 1e3
    print(f"== {name}: fwd us  module alternating {alt:.1f} / {alt2:.1f}, fwd-only {fwd_only:.1f}, "
          f"alternating+5ms sleep {alt_sleep:.1f}; C++ time_layer {cpp_fwd:.1f}")
    keys = ["num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"]
    print("   allocator over 20 alternating reps: " + ", ".join(f"{k} +{st1.get(k, 0) - st0.get(k, 0)}" for k in keys))

    # One alternating forward under the profiler: the GPU timeline relative to the first activity.
    from torch.profiler import ProfilerActivity, profile
    for label, pre in (("after step", True), ("fwd only", False)):
        case.refill(); case.module_forward(); case.module_step() if pre else None
        case.refill(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            case.module_forward()
            torch.cuda.synchronize()
        evs = [e for e in prof.events()]
        gpu = sorted([e for e in evs if str(getattr(e, "device_type", "")).endswith("CUDA")],
                     key=lambda e: e.time_range.start)
        cpu_api = [e for e in evs if not str(getattr(e, "device_type", "")).endswith("CUDA") and e.name.startswith("cu")]
        base = min([e.time_range.start for e in cpu_api] + [g.time_range.start for g in gpu])
        print(f"   -- profile ({label}): GPU activities (start us, dur us) relative to the first CUDA API call")
        prev_end = None
        for g in gpu:
            s = g.time_range.start - base
            gap = "" if prev_end is None else f" gap {s - prev_end:.1f}"
            print(f"      {s:8.1f} {g.time_range.elapsed_us():8.1f}{gap}  {g.name[:70]}")
            prev_end = s + g.time_range.elapsed_us()
        slow = sorted(cpu_api, key=lambda e: -e.time_range.elapsed_us())[:8]
        print("      slowest CUDA API calls: " + "; ".join(f"{e.name} {e.time_range.elapsed_us():.0f}us@"
                                                           f"{e.time_range.start - base:.0f}" for e in slow))
    del case
    torch.cuda.empty_cache()
