"""T14 methodology: the module's isolated forward measured the overhead tool's way (refill, forward discarded, then an
untimed forward+backward), without any backward between forwards, and with the timed forward's output used by the
backward; against the C++ layer (time_layer), interleaved; medians over reps. Allocator counters around the loop."""
import statistics, sys, time, torch
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case

reps = int(sys.argv[1])
for name in sys.argv[2:]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    m, x, go = case.module, case.x, case.go
    s = torch.cuda.current_stream()
    ev = lambda: torch.cuda.Event(enable_timing=True)

    def tool():  # overhead.py's module_times(0, 1, isolated=True)
        case.refill(); s.synchronize()
        e = [ev() for _ in range(4)]
        e[0].record(); h0 = time.perf_counter(); case.module_forward(); h1 = time.perf_counter(); e[1].record()
        s.synchronize(); e[2].record(); case.module_step(); e[3].record(); s.synchronize()
        return e[0].elapsed_time(e[1]), (h1 - h0) * 1e3

    def nostep():  # forwards only, nothing between them but a synchronize
        m.zero_grad(set_to_none=True); s.synchronize()
        e = [ev() for _ in range(2)]
        e[0].record(); h0 = time.perf_counter(); out = m(x); h1 = time.perf_counter(); e[1].record()
        s.synchronize(); del out
        return e[0].elapsed_time(e[1]), (h1 - h0) * 1e3

    def hold():  # the timed forward's output goes on to the backward (a training step)
        case.refill(); s.synchronize()
        e = [ev() for _ in range(2)]
        e[0].record(); h0 = time.perf_counter(); out = m(x); h1 = time.perf_counter(); e[1].record()
        s.synchronize(); out.output.backward(go); s.synchronize()
        return e[0].elapsed_time(e[1]), (h1 - h0) * 1e3

    def cpp():
        t = case.cpp(0, 1, True)
        return float(t[0, 0]), 0.0

    fns = {"cpp": cpp, "tool": tool, "nostep": nostep, "hold": hold}
    for f in fns.values():
        for _ in range(3): f()
    st0 = torch.cuda.memory_stats()
    res = {k: [] for k in fns}
    order = list(fns)
    for r in range(reps):
        for k in (order if r % 2 == 0 else order[::-1]):
            res[k].append(fns[k]())
    st1 = torch.cuda.memory_stats()
    c = statistics.median(v[0] for v in res["cpp"])
    print(f"## {name} ({reps} reps): C++ isolated forward {c:.4f} ms")
    for k in fns:
        g = statistics.median(v[0] for v in res[k]); h = statistics.median(v[1] for v in res[k])
        q = sorted(v[0] for v in res[k])
        print(f"  {k:8s} gpu {g:.4f} ms ratio {g / c:.3f} (p10 {q[len(q) // 10]:.4f} p90 {q[9 * len(q) // 10]:.4f}) host {h:.4f} ms")
    for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
        if key in st1:
            print(f"  allocator {key}: {st1[key] - st0.get(key, 0)} during the loop")
