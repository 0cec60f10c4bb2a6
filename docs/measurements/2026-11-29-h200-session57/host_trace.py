"""Host timeline of one isolated module forward / forward+backward and one C++ time_layer repetition (torch.profiler):
every CPU-side event (ops, CUDA runtime calls) with its start offset from the first and its duration, in us."""
import sys, torch
from torch.profiler import ProfilerActivity, profile
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case

def timeline(tag, fn, reps=3):
    for r in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
        ev.sort(key=lambda e: e.time_range.start)
        t0 = ev[0].time_range.start
        gpu = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
        print(f"== {tag} rep {r}: {len(ev)} cpu events, {len(gpu)} gpu events")
        if r == reps - 1:
            for e in ev:
                print(f"  {e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:8.1f}  {e.name[:90]}")
        gs = sorted(gpu, key=lambda e: e.time_range.start)
        if gs:
            g0 = gs[0].time_range.start
            print(f"  gpu: first kernel at cpu-offset {g0 - t0:.1f} us; kernels:")
            for e in gs[:40]:
                print(f"    {e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:8.1f}  {e.name[:80]}")

for name in sys.argv[1:]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    for _ in range(5):
        case.refill(); case.module_step()
    case.cpp(3, 1, True)
    torch.cuda.synchronize()
    print(f"##### {name}")
    def fwd():
        case.module_forward()
    def step():
        case.module_step()
    case.refill(); timeline(f"{name} module forward", fwd)
    case.refill(); timeline(f"{name} module fwd+bwd", step, reps=2)
    timeline(f"{name} cpp time_layer(0,1,isolated)", lambda: case.cpp(0, 1, True), reps=2)
