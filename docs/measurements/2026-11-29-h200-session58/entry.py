"""Session 58: where the module path's isolated-forward gap to the C++ layer goes (T14). Per layer: isolated GPU time
(host latency counts), the GPU time with a sleep kernel queued ahead (host latency hidden) and the host time of the
call; then host micro-timings of the pieces on a busy GPU."""
import statistics, sys, time, torch
from machmoe.benchmark import configs as C
from machmoe.benchmark.overhead import Case, forward_layers, operator_codes

med = statistics.median
s = torch.cuda.current_stream()

def ev():
    return torch.cuda.Event(enable_timing=True)

def sleep_ms(cycles):
    s.synchronize(); a, b = ev(), ev(); a.record(); torch.cuda._sleep(cycles); b.record(); s.synchronize()
    return a.elapsed_time(b)

cyc = 700_000
print(f"sleep({cyc}) = {med([sleep_ms(cyc) for _ in range(5)]):.3f} ms")

def busy_host_us(fn, calls, pre_cycles=60_000_000):
    s.synchronize(); torch.cuda._sleep(pre_cycles)
    t0 = time.perf_counter_ns()
    outs = [fn() for _ in range(calls)]
    t1 = time.perf_counter_ns()
    del outs
    s.synchronize()
    return (t1 - t0) / calls / 1e3

for name in sys.argv[1:]:
    cfg = C.select(name)[0]
    case = Case(cfg, torch.device("cuda"), torch.bfloat16, 0)
    fns = forward_layers(case.module, case.x)
    rows = ("cpp",) + tuple(fns)
    iso = {r: [] for r in rows}; pre = {r: [] for r in rows}; host = {r: [] for r in rows}
    def run(r, prefixed):
        if r == "cpp":
            return float(case.cpp(0, 1, True)[0, 0]), None
        case.refill(); s.synchronize()
        e0, e1, e2 = ev(), ev(), ev()
        e0.record()
        if prefixed: torch.cuda._sleep(cyc)
        e1.record()
        t0 = time.perf_counter_ns(); out = fns[r](); t1 = time.perf_counter_ns()
        e2.record(); s.synchronize(); del out
        case.module_step()
        return (e1 if prefixed else e0).elapsed_time(e2), (t1 - t0) / 1e3
    for r in rows: run(r, False); run(r, True)
    for i in range(30):
        for r in (rows if i % 2 == 0 else rows[::-1]):
            t, _ = run(r, False); iso[r].append(t)
            if r != "cpp":
                t, h = run(r, True); pre[r].append(t); host[r].append(h)
    print(f"##### {name}: isolated fwd ms / fwd after a queued sleep (host latency hidden) ms / host us of the call")
    for r in rows:
        print(f"  {r:18s} iso {med(iso[r]):.4f}" + (f"  pre {med(pre[r]):.4f}  host {med(host[r]):7.1f}" if pre[r] else ""))
    m = case.module; codes = operator_codes(m); xd = case.x.detach()
    T, d, E = cfg.T, cfg.d, cfg.E
    def nograd_below():
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            return None
    def empties():
        o = xd.new_empty((T, d)); l = xd.new_empty((T, E)); c = torch.empty(E, dtype=torch.int32, device=xd.device)
        sv = torch.empty(300 << 20, dtype=torch.uint8, device=xd.device); w = torch.empty(50 << 20, dtype=torch.uint8, device=xd.device)
        return o, l, c, sv, w
    nb = torch.ops.machmoe.saved_nbytes.default
    micro = {"no_grad+below ctx": nograd_below,
             "saved_nbytes op (13 ints)": lambda: nb(T, d, cfg.n, E, cfg.K, 0, 0, 0, 0, 128, 0, 2, 0),
             "5 torch.empty (cuda)": empties,
             "op_below (GPU busy)": fns["op_below_autograd"], "functional (GPU busy)": fns["functional"],
             "module (GPU busy)": fns["module_forward"]}
    print("  host us per call on a busy GPU (median of 5 rounds):")
    for k, fn in micro.items():
        calls = 20 if "busy" in k else 200
        try:
            print(f"    {k:28s} {med([busy_host_us(fn, calls) for _ in range(5)]):8.1f}")
        except Exception as e:
            print(f"    {k:28s} failed: {e}")
    del case, fns; torch.cuda.empty_cache()
