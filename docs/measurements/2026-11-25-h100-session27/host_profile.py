"""Session 26: where the module's forward spends host time on the GPU machine (T14 gap ~0.2 ms isolated)."""
import os, statistics, sys, time
import torch
import machmoe
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case

out = os.environ.get("OUT", "/tmp")
for name in sys.argv[1:] or ["7B-256"]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    m = case.module
    for _ in range(10):
        case.refill(); case.module_step()
    torch.cuda.synchronize()

    def host(fn, reps=50):
        ts = []
        for _ in range(reps):
            case.refill()
            torch.cuda.synchronize()
            t0 = time.perf_counter(); r = fn(); t1 = time.perf_counter()
            del r
            ts.append((t1 - t0) * 1e6)
        return statistics.median(ts), min(ts)

    def gap(fn, reps=50):  # GPU time from an event recorded just before the call to the end of its work
        ts = []
        for _ in range(reps):
            case.refill(); torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); r = fn(); b.record(); torch.cuda.synchronize(); del r
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts)

    ops_args = None
    x = case.x
    rows = []
    rows.append(("module(x) with grad", host(lambda: m(x)), gap(lambda: m(x))))
    op = torch.ops.machmoe.layer_forward.default
    codes = (cfg.K, 0, 0, 0, 0, 0, 128, 0)
    opf = lambda: op(x, m.router_weight, m.w1, None, m.w2, None, None, None, None, *codes)
    rows.append(("op with grad", host(opf), gap(opf)))
    def below():
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            return op(x.detach(), m.router_weight, m.w1, None, m.w2, None, None, None, None, *codes)
    rows.append(("op below autograd", host(below), gap(below)))
    with torch.no_grad():
        rows.append(("module(x) no_grad", host(lambda: m(x)), gap(lambda: m(x))))
        xd = x.detach()
        rows.append(("functional.moe no_grad", host(lambda: machmoe.moe(xd, m.router_weight, m.w1, m.w2, top_k=cfg.K)),
                     gap(lambda: machmoe.moe(xd, m.router_weight, m.w1, m.w2, top_k=cfg.K))))
        t = case.cpp(3, 20, True)
        print(f"C++ time_layer isolated fwd median {t[:,0].median().item():.3f} ms")
    print(f"== {name}: host us (median, min), GPU us from an event before the call to the end")
    for r in rows:
        print(f"  {r[0]:28s} host {r[1][0]:8.1f} {r[1][1]:8.1f}   gpu {r[2]:8.1f}")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            case.refill(); torch.cuda.synchronize()
            y = m(x); torch.cuda.synchronize(); del y
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    prof.export_chrome_trace(os.path.join(out, f"trace_{name}.json"))
